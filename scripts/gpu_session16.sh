#!/usr/bin/env bash
# Wave 3, sixteenth session's plan for the next device session, each part one device call from
# the repository root, carrying .whl (see scripts/device_lib.sh), results under $OUT:
#
#   PART=prefill: issue 30's prefill after `prefill_path` moved to device time. The timer's
#            GPU test and the path tests, then the kernel table (does the engine now take the
#            cuDNN dense part?), then where FP8's prefill step loses to bf16's (session 16's
#            served FP8 reached the first token later than bf16 on the same prompts):
#            one 1,536-token prefill broken down in bf16, FP8 weights, FP8 cache, both.
#   PART=served_fp8: the served FP8 run at 5 and 15 req/s without and then with --enable-pdl,
#            one call: whether PDL is what worsened session 16's FP8 TTFT p99.
#   PART=w8a16: batch 1 in FP8 with the W8A16 tuner's picks printed (which of session 15's
#            GEMV loops won, per linear), 512/256 beside it.
#
#   OUT=/some/dir PART=prefill bash scripts/gpu_session16.sh
set -u
case "${PART:-prefill}" in
prefill)
  ISSUE=session16 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  step "prefill path tests" 150 "$OUT/gpu_tests_prefill_path.log" $PY -m pytest -q -m gpu \
    --timeout=140 -rs --tb=short tests/gpu/test_cascade_attention_gpu.py \
    -k "device_timing or prefill_path or cudnn"
  step "kernel table" 170 "$OUT/attention_kernels.log" $PY -m benchmarks.attention_kernels \
    --out "$OUT/attention_kernels.json"
  for flags in "bf16:" "fp8w:--quantization fp8" "fp8kv:--kv-cache-dtype fp8" \
    "fp8:--quantization fp8 --kv-cache-dtype fp8"; do
    name=${flags%%:*}
    read -r -a extra <<<"${flags#*:}"
    step "prefill breakdown $name" 55 "$LOGS/breakdown_$name.log" $PY -m benchmarks.step_breakdown \
      --model random:llama-3.1-8b "${extra[@]}" --num-prompts 1 --input-len 1536 --steps 2 \
      --out "$LOGS/breakdown_$name.json"
    grep -m1 "^prefill" "$LOGS/breakdown_$name.log" | sed "s/^/$name /" >>"$summary"
  done
  grep -hE "passed|failed" "$OUT/gpu_tests_prefill_path.log" | tail -n 2 >>"$summary"
  grep -E "^prefill" "$OUT/attention_kernels.log" >>"$summary"
  finish
  ;;
served_fp8)
  # Two served runs in one call (each ~170 s with its start-up): OUT holds both merges.
  mkdir -p "$OUT/plain" "$OUT/pdl"
  for mode in plain pdl; do
    extra="--quantization fp8 --kv-cache-dtype fp8"
    [ "$mode" = pdl ] && extra="$extra --enable-pdl"
    OUT="$OUT/$mode" RUNS=unified OFFLINE=none RATES=5,15 BUDGET_S=270 ENGINE_EXTRA="$extra" \
      bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| unified|answered|total"
    rm -f "$OUT/$mode/issue14.png"
  done
  ;;
w8a16)
  ISSUE=session16 BUDGET_S=${BUDGET_S:-400}
  . scripts/device_lib.sh
  WORKLOADS=512/256 offline fp8_fp8kv 250 --quantization fp8 --kv-cache-dtype fp8
  grep -E "^w8a16" "$OUT/offline_fp8_fp8kv.log" >>"$summary"
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
