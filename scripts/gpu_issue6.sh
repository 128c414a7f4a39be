#!/usr/bin/env bash
# Issue 6 on one GPU: the CUDA IPC KV connector's tests and the KV transfer benchmark.
#
#   OUT=/some/dir bash scripts/gpu_issue6.sh        (from the repository root)
#
# Writes under $OUT: env.txt, 1_ipc_blocks.log, 2_kv_transfer_cuda.{log,json},
# 3_ipc_serving.log, 4_kv_transfer_cpu.{log,json}, summary.txt. Each step has its own time
# limit; a failing step does not stop the next. About 2-3 minutes on an H200.
set -u
OUT=${OUT:-$PWD/gpu_issue6_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
summary="$OUT/summary.txt"
: >"$summary"

step() {  # step NAME LIMIT_S LOG CMD...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0))s) -> $(basename "$log")" | tee -a "$summary"
  tail -n 25 "$log"
}

{
  nvidia-smi -L 2>&1 || true
  $PY - <<'EOF'
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), "uuid", torch.cuda.get_device_properties(0).uuid)
need = ["grpc", "google.protobuf", "numpy", "pytest", "xxhash", "transformers",
        "grpc_health", "grpc_reflection", "prometheus_client", "safetensors", "triton"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("missing python packages:", missing or "none")
EOF
} 2>&1 | tee "$OUT/env.txt"

# 1. Two processes, one GPU: blocks through CUDA IPC, byte-exact (no model).
step "1 ipc blocks byte-exact" 120 "$OUT/1_ipc_blocks.log" \
  $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_cuda_ipc.py -k two_processes

# 2. Transfer rate, llama-3.1-8b shape, 2048-token prompts, beside the D2D copy rate.
step "2 kv transfer cuda" 120 "$OUT/2_kv_transfer_cuda.log" \
  $PY -m benchmarks.kv_transfer --mode cuda --out "$OUT/2_kv_transfer_cuda.json"

# 3. Disaggregated serving over CUDA IPC vs the unified worker (random:llama-3.2-1b, fp32),
#    then aborts. The scheduler and worker logs land under $OUT/3_ipc_serving_tmp/.
step "3 ipc serving parity + aborts" 300 "$OUT/3_ipc_serving.log" \
  $PY -m pytest -q -s -p no:cacheprovider --basetemp="$OUT/3_ipc_serving_tmp" \
  tests/gpu/test_cuda_ipc.py -k "disaggregated or aborts"

# 4. CPU figures (NCCL code path over gloo, and TCP), 512-token prompts.
step "4 kv transfer cpu" 120 "$OUT/4_kv_transfer_cpu.log" \
  $PY -m benchmarks.kv_transfer --mode cpu --tokens 512 --out "$OUT/4_kv_transfer_cpu.json"

echo "---- summary"
cat "$summary"
