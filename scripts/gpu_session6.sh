#!/usr/bin/env bash
# Wave 3, sixth session's H200 runs, each part one device call (from the repository root):
#
#   PART=s:  the served table (scripts/gpu_issue14.sh, unified, RATES, no offline run) at the
#            serving defaults in bf16, then the same load with FP8 weights and an FP8 KV cache
#            (issue 28's "served FP8 against bf16, same run") -> $OUT/served_{bf16,fp8}/;
#   PART=a:  carries .whl and .smol/a: the GPU test files that do not need SmolLM2 (A_TESTS);
#   PART=b:  carries .whl2 and .smol/b, right after PART=a on the same warm machine: joins
#            SmolLM2, its GPU test files (scripts/gpu_session5.sh's SMOL_FILES), then (B_SERVED=1)
#            the bf16 served table again (after the start-up compile change).
#
#   PART=ab: the offline A/B left for the next session: bf16 and FP8 + FP8 KV at 512/256 with
#            the cascade prefill on and off (TANDEM_PREFILL_CASCADE=0), the 7-10% FP8 drop
#            between 2026-12-03 and 12-04 (scripts/device_lib.sh: offline);
#   PART=sp: speculation at batch 1 and 32 (p = 0.7 and 0, k = 4, 256 output tokens, forced
#            record), then the verify step's cost against a plain step on the device
#            (benchmarks/spec_host_cost.py), the cascade on and off.
#
#   OUT=/some/dir PART=s bash scripts/gpu_session6.sh
set -u
case "${PART:-s}" in
s)
  T0=$SECONDS
  RUNS=unified OFFLINE=none RATES=${RATES:-5,15,25,inf} OUT="$OUT/served_bf16" \
    BUDGET_S=${BF16_BUDGET_S:-285} bash scripts/gpu_issue14.sh
  RUNS=unified OFFLINE=none RATES=${RATES:-5,15,25,inf} OUT="$OUT/served_fp8" TAG=_fp8 \
    ENGINE_EXTRA="--quantization fp8 --kv-cache-dtype fp8" \
    BUDGET_S=$((${TOTAL_S:-575} - (SECONDS - T0))) bash scripts/gpu_issue14.sh
  ;;
a)
  # shellcheck disable=SC2086
  PART=v1 V1_TESTS="${A_TESTS:?}" TESTS_LIMIT_S=${TESTS_LIMIT_S:-560} BUDGET_S=575 \
    bash scripts/gpu_session5.sh
  ;;
b)
  T0=$SECONDS
  PART=v2 TESTS_LIMIT_S=${TESTS_LIMIT_S:-330} BUDGET_S=${B_TESTS_BUDGET_S:-340} \
    bash scripts/gpu_session5.sh
  if [ "${B_SERVED:-1}" = 1 ]; then
    RUNS=unified OFFLINE=none RATES=${RATES:-5,15,25,inf} OUT="$OUT/served_bf16" \
      BUDGET_S=$((${TOTAL_S:-575} - (SECONDS - T0))) bash scripts/gpu_issue14.sh
  fi
  ;;
ab)
  ISSUE=session6 BUDGET_S=575
  . scripts/device_lib.sh
  for fl in "" "--quantization fp8 --kv-cache-dtype fp8"; do
    name=bf16
    [ -n "$fl" ] && name=fp8_fp8kv
    # shellcheck disable=SC2086
    WORKLOADS=512/256 offline "${name}_cascade" 140 $fl
    # shellcheck disable=SC2086
    TANDEM_PREFILL_CASCADE=0 WORKLOADS=512/256 offline "${name}_paged" 140 $fl
  done
  finish
  ;;
sp)
  ISSUE=session6 BUDGET_S=575
  . scripts/device_lib.sh
  step "speculative forced" 300 "$OUT/speculative_forced.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 1,32 --ks 4 --acceptances 0.7,0 --rules measured \
    --force-record --out "$OUT/speculative_forced.json"
  for cascade in 1 0; do
    TANDEM_PREFILL_CASCADE=$cascade step "spec host cost (cascade $cascade)" 120 \
      "$OUT/spec_host_cost_cascade$cascade.log" $PY -m benchmarks.spec_host_cost --device cuda \
      --model random:llama-3.1-8b --batch-sizes 1,8 --k 4 --input-len 64 --output-len 64 \
      --max-model-len 4096 --out "$OUT/spec_host_cost_cascade$cascade.json"
  done
  finish
  ;;
esac
