#!/usr/bin/env bash
# Wave 3, eleventh session's H200 plan (no device was lent in session 11: written for the next
# session that has one), each part one device call from the repository root, carrying .whl:
#
#   PART=moe: the fused MoE kernel's new forms (tandem_kernels/fused_moe.py: GEMM 1 storing
#            silu(gate) * up itself, GEMM 2 with its own tiles, no zero fill when every expert
#            is local), none of which has run on a GPU: its GPU tests and the SiLU-and-mul
#            kernel's (its arithmetic moved into a jit helper), then the kernel benchmark (the
#            "forms" line: fastest unfused against fastest epilogue config, and the tuned pick;
#            issue 32's 60%-of-the-held-ceiling bar at 4,096 and 16,384 tokens), then
#            Qwen3-30B-A3B offline at 1000/1000 (512 requests) against session 8's 6,501.
#
#   OUT=/some/dir PART=moe bash scripts/gpu_session11.sh
set -u
case "${PART:-moe}" in
moe)
  ISSUE=session11 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  step "MoE GPU tests" 200 "$OUT/gpu_tests_moe.log" $PY -m pytest -q -m gpu --timeout=600 \
    -rs --tb=short --durations=8 tests/gpu/test_fused_moe_gpu.py \
    tests/gpu/test_kernels_gpu.py -k "moe or fused or silu"
  step "MoE kernel" 200 "$OUT/moe_kernel.log" $PY -m benchmarks.moe_kernel \
    --tokens 1 64 512 4096 16384 --out "$OUT/moe_kernel.json"
  grep -E "forms|TFLOP" "$OUT/moe_kernel.log" | tail -n 12 >>"$summary"
  step "offline qwen3-30b-a3b" 150 "$OUT/offline_qwen3-30b-a3b.log" \
    $PY -m benchmarks.offline_throughput --model random:qwen3-30b-a3b --device cuda \
    --skip-peer --workloads 1000/1000 --max-requests 512 --out "$OUT/offline_qwen3-30b-a3b.json"
  grep -E "tok/s|TPOT" "$OUT/offline_qwen3-30b-a3b.log" | tail -n 3 >>"$summary"
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
