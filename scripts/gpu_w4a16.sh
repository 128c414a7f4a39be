#!/usr/bin/env bash
# The W4A16 branch's device call (carry .whl): the integer-weight GEMM's GPU tests, then its
# benchmark at the 8B shapes (4 bits in groups of 128, then 8 bits in one group).
#
# What ran (session 35, one H100): 5 GPU tests passed; both benchmarks
#   (benchmarks/results/int_w4a16_*_h100_2026-12-07_s35*).
#
#   OUT=/some/dir bash scripts/gpu_w4a16.sh
set -u
ISSUE=w4a16
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
env_report | head -n 4
step "int_w4a16 GPU tests" 330 "$OUT/int_w4a16_gpu_tests.log" $PY -m pytest -q -m gpu -rA \
  -p no:cacheprovider -s tests/gpu/test_int_w4a16_gpu.py
grep -E "passed|failed|error" "$OUT/int_w4a16_gpu_tests.log" | tail -n 3 >>"$summary"
step "int_w4a16 benchmark, 4 bits" 150 "$OUT/int_w4a16_bench.log" $PY -m benchmarks.int_w4a16 \
  --out "$OUT/int_w4a16_4bit.json"
step "int_w4a16 benchmark, 8 bits" 90 "$OUT/int_w4a16_bench8.log" $PY -m benchmarks.int_w4a16 \
  --bits 8 --group-size -1 --batches 1,8 --out "$OUT/int_w4a16_8bit.json"
cat "$summary"
