#!/usr/bin/env bash
# Wave 3, twenty-first session's device plan (after scripts/gpu_session20.sh's PART=fuse), one
# device call from the repository root carrying .whl, results under $OUT. The fusions' switches
# (TANDEM_DECODE_MERGE, TANDEM_ROTARY_KV) pass through from the caller's environment.
#
#   PART=served: bf16 batch 1 (the 8B shape, offline) with the 16-bit GEMM and with the
#            small-batch kernels on 16-bit weights where they time faster at load
#            (TANDEM_W16A16=tuned); the faster of the two then serves issue 30's table in bf16
#            at the defaults (fresh prompts per rate, 5 / 15 / 25 req/s and all at once).
#
# Session 21 ran PART=rest; the served A/B then ran inline on the same H100 (both settings at
# 5 / 15 / 25 req/s and all at once, `TANDEM_W16A16=off|tuned bash scripts/gpu_issue14.sh`),
# not PART=served, whose H200 run is still to do with W16A16 now the default.
#
#   PART=allatonce: issue 30's widest gap (output tok/s all at once, 0.94x vLLM's against a
#            1.1x bar): the served run at rate inf alone, then the offline engine on the same
#            150 prompts (seed 1, as the served run's first rate) with its step timeline, so
#            the served run's time can be set against the engine's own steps (~150 s).
#
#   OUT=/some/dir PART=served bash scripts/gpu_session21.sh
set -u
ISSUE=session21
case "${PART:-served}" in
rest)  # the GPU tests PART=fuse's 200 s left unrun, by name; bf16 batch 1 both ways
  BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  step "GPU tests" 300 "$OUT/gpu_tests_rest.log" $PY -m pytest -v -m gpu --timeout=250 -rs \
    --tb=short --durations=12 tests/gpu/test_pdl_gpu.py tests/gpu/test_fp8_w8a16_gpu.py \
    tests/gpu/test_fp8_gpu.py tests/gpu/test_cascade_attention_gpu.py
  grep -E " (PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_rest.log" | tail -n 40 >>"$summary"
  export WORKLOADS=none
  TANDEM_W16A16=off offline bf16_b1_gemm 100
  TANDEM_W16A16=tuned offline bf16_b1_w16a16 130
  grep -h "w8a16" "$OUT/offline_bf16_b1_w16a16.log" >>"$summary"
  finish
  ;;
served)
  BUDGET_S=${BUDGET_S:-590}
  . scripts/device_lib.sh
  export WORKLOADS=none
  TANDEM_W16A16=off offline bf16_b1_gemm 110
  TANDEM_W16A16=tuned offline bf16_b1_w16a16 130
  faster=$($PY - "$OUT" <<'PYEOF'
import json, sys
def tpot(name):
    try:
        return json.load(open(f"{sys.argv[1]}/offline_{name}.json"))["batch1"]["tpot_ms"]
    except (OSError, KeyError, ValueError):
        return None
gemm, w16 = tpot("bf16_b1_gemm"), tpot("bf16_b1_w16a16")
print("tuned" if gemm and w16 and w16 < 0.99 * gemm else "off")
PYEOF
)
  echo "batch 1: TANDEM_W16A16=$faster serves the table" | tee -a "$summary"
  mkdir -p "$OUT/bf16"
  left=$((BUDGET_S - (SECONDS - START) - 10))
  OUT="$OUT/bf16" RUNS=unified OFFLINE=none RATES=5,15,25,inf BUDGET_S=$left \
    TANDEM_W16A16=$faster bash scripts/gpu_issue14.sh 2>&1 \
    | grep -E "^\| unified|answered|total|rate" | tee -a "$summary"
  rm -f "$OUT"/*/issue14.png
  finish
  ;;
allatonce)
  BUDGET_S=${BUDGET_S:-400}
  . scripts/device_lib.sh
  mkdir -p "$OUT/served"
  OUT="$OUT/served" RUNS=unified OFFLINE=none RATES=inf BUDGET_S=200 \
    bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| unified|answered|rate" | tee -a "$summary"
  rm -f "$OUT"/served/issue14.png
  step "offline all at once" 150 "$OUT/offline_inf.log" \
    $PY -m benchmarks.serve_offline --model random:llama-3.1-8b --dtype bfloat16 \
    --max-model-len 4096 --num-prompts 150 --input-len 1000 --output-len 200 \
    --range-ratio 0.5 --warmup 4 --request-rate inf --seeds 1 --timeline \
    --out "$OUT/offline_inf.json"
  grep -E "^offline rate|^  [a-z]" "$OUT/offline_inf.log" >>"$summary"
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
