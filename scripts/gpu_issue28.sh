#!/usr/bin/env bash
# Issue 28 (FP8) on one H200, random-weight llama-3.1-8b shape; two calls under the device's
# 10-minute limit:
#   PART=a: the FP8 GEMM ceilings (benchmarks/fp8_gemm.py), then the offline benchmark with
#           --quantization fp8 --kv-cache-dtype fp8 at 128/128, 512/256, 1000/1000 and batch 1;
#   PART=b: each flag alone (WORKLOADS, default all three);
#   PART=c: the fused activation quantization: its GPU tests (tests/gpu/test_fp8_fused_gpu.py),
#           its kernels against the unfused pairs (benchmarks/fp8_fused.py), then the offline
#           benchmark with --quantization ptpc_fp8 (per-token activations: one-pass fusion).
#
#   OUT=/some/dir PART=a bash scripts/gpu_issue28.sh     (from the repository root)
ISSUE=issue28
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
env_report

if [ "${PART:-a}" = a ]; then
  step "fp8 gemm" 150 "$OUT/fp8_gemm.log" $PY -m benchmarks.fp8_gemm --out "$OUT/fp8_gemm.json"
  tail -n 20 "$OUT/fp8_gemm.log" >>"$summary"
  offline fp8_fp8kv "${OFFLINE_LIMIT_S:-380}" --quantization fp8 --kv-cache-dtype fp8
elif [ "${PART:-a}" = c ]; then
  step "fp8 fused gpu tests" 180 "$OUT/fp8_fused_tests.log" \
    $PY -m pytest -q -s -m gpu tests/gpu/test_fp8_fused_gpu.py
  tail -n 8 "$OUT/fp8_fused_tests.log" >>"$summary"
  step "fp8 fused kernels" 150 "$OUT/fp8_fused.log" \
    $PY -m benchmarks.fp8_fused --out "$OUT/fp8_fused.json"
  tail -n 24 "$OUT/fp8_fused.log" >>"$summary"
  offline ptpc_fp8 "${OFFLINE_LIMIT_S:-260}" --quantization ptpc_fp8
else
  offline fp8 "${OFFLINE_LIMIT_S:-260}" --quantization fp8
  offline fp8kv "${OFFLINE_LIMIT_S:-260}" --kv-cache-dtype fp8
fi
finish
