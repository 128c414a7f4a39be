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
esac
