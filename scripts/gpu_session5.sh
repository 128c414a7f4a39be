#!/usr/bin/env bash
# Wave 3, fifth session's H200 runs, each part one device call (from the repository root):
#
#   PART=v1: carries .whl and .smol/a (the first half of SmolLM2's GGUF, kept in /tmp/smol);
#            V1_TESTS (the fused FP8 producers' GPU tests), then offline FLAGS at
#            WORKLOADS and batch 1 under NAME (device_lib.sh: offline);
#   PART=v2: carries .whl2 and .smol/b, right after v1 on the same warm machine: joins SmolLM2,
#            then the GPU test files that need it (FP8 against bf16, SmolLM2 drafting,
#            structured outputs) and the Gemma 3 disaggregated GPU test;
#   PART=o:  offline FLAGS at WORKLOADS under NAME;
#   PART=s:  the served table (scripts/gpu_issue14.sh: unified, RATES, after the offline run).
#
#   OUT=/some/dir PART=v1 NAME=fp8_fp8kv FLAGS="--quantization fp8 --kv-cache-dtype fp8" \
#     bash scripts/gpu_session5.sh
ISSUE=session5
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SMOL_FILES="tests/gpu/test_fp8_gpu.py tests/gpu/test_spec_model_proposers_gpu.py \
tests/gpu/test_structured_gpu.py tests/gpu/test_disagg_gemma3_gpu.py"

gpu_tests() {  # gpu_tests NAME LIMIT_S FILES...: pytest -m gpu on FILES -> $OUT/gpu_tests_NAME.log
  local name=$1 limit=$2
  shift 2
  step "gpu tests $name" "$limit" "$OUT/gpu_tests_$name.log" $PY -m pytest -q -s -m gpu "$@" \
    -p no:cacheprovider --durations=15 --tb=short
  grep -E "passed|failed|Error|assert|identical|gap|^E " "$OUT/gpu_tests_$name.log" \
    | tail -n 40 >>"$summary"
}

case "${PART:-v1}" in
v1)
  keep_smollm2_half
  # shellcheck disable=SC2086
  gpu_tests v1 "${TESTS_LIMIT_S:-120}" ${V1_TESTS:-tests/gpu/test_fp8_fused_gpu.py}
  # shellcheck disable=SC2086
  [ -n "${NAME:-}" ] && offline "$NAME" "${OFFLINE_LIMIT_S:-400}" ${FLAGS:-}
  ;;
v2)
  ls .whl2/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-deps --upgrade --target /tmp/site \
    .whl2/*.whl >>"$LOGS/pip.log" 2>&1
  join_smollm2
  # shellcheck disable=SC2086
  gpu_tests smollm2 "${TESTS_LIMIT_S:-520}" ${SMOL_TESTS:-$SMOL_FILES}
  ;;
o)
  # shellcheck disable=SC2086
  offline "${NAME:-bf16}" "${OFFLINE_LIMIT_S:-540}" ${FLAGS:-}
  ;;
s)
  RUNS=unified OFFLINE=${OFFLINE:-last} RATES=${RATES:-5,15,25,inf} OUT="$OUT/served" \
    BUDGET_S=$((BUDGET_S - 10)) bash scripts/gpu_issue14.sh
  ;;
esac
finish
