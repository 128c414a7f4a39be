#!/usr/bin/env bash
# Issue 27 on one H200 (random-weight llama-3.1-8b shape, bf16), each step time-limited within
# BUDGET_S; run twice (PART=a, PART=b) so each call stays under the device's 10-minute limit:
#   a: the GPU test suite (tests/gpu, one process), then the offline benchmark at 128/128,
#      512/256 and 1000/1000 with the batch-1 TPOT through the in-process executor;
#   b: the same benchmark through the MultiprocExecutor at TP = 1
#      (--distributed-executor-backend mp).
#
#   OUT=/some/dir PART=a bash scripts/gpu_issue27.sh     (from the repository root; carry .whl)
ISSUE=issue27
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
env_report

if [ "${PART:-a}" = a ]; then
  if [ "${TESTS:-1}" = 1 ]; then
    step "gpu tests" "${TESTS_LIMIT_S:-240}" "$OUT/gpu_tests.log" \
      $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs
    tail -n 3 "$OUT/gpu_tests.log" >>"$summary"
  fi
  offline uniproc "${OFFLINE_LIMIT_S:-300}"
else
  offline mp "${OFFLINE_LIMIT_S:-420}" --distributed-executor-backend mp
fi
finish
