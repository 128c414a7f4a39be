#!/usr/bin/env bash
# Wave 3, thirty-sixth session's device calls. Carry .whl.
#
#   PART=int (~9 min, either card): the integer GEMM's GPU tests (act-order engine run, the
#            dense form among the candidates), then $EXTRA_TESTS (pytest files, -m gpu).
#
#   PART=bench (~6 min, either card): the FP8 W8A16 GPU tests, then the integer GEMM's
#            benchmark at decode and prefill sizes (4 bits, groups of 128) with the values
#            converted to float (cvt), then at decode sizes with them made from their bits
#            (TANDEM_W4A16_CONVERT=bits), 4 and 8 bits.
#
#   PART=all (~9.5 min, either card): PART=int's tests, then the benchmark's forms at fewer
#            sizes, then the W8A16 tests, as the budget allows.
#
# What ran: fourteen calls got no machine; the fifteenth, PART=all naming the H200 kind, came
#   on an H100: 6 GPU tests passed, the three benchmark runs (the bits and split forms since
#   removed), the W8A16 tests cut at 60 s while compiling. Results:
#   benchmarks/results/int_w4a16_*_h100_2026-12-07_s36*.
#
#   OUT=/some/dir PART=int bash scripts/gpu_session36.sh
set -u
ISSUE=session36
part=${PART:-int}

case "$part" in
int)
  BUDGET_S=${BUDGET_S:-540}
  . scripts/device_lib.sh
  env_report | head -n 3
  step "int_w4a16 GPU tests" 330 "$OUT/int_w4a16_gpu_tests.log" $PY -m pytest -q -m gpu -rA \
    -p no:cacheprovider -s --durations=8 tests/gpu/test_int_w4a16_gpu.py
  grep -E "passed|failed|error" "$OUT/int_w4a16_gpu_tests.log" | tail -n 3 >>"$summary"
  if [ -n "${EXTRA_TESTS:-}" ]; then
    step "extra GPU tests" 200 "$OUT/gpu_extra_tests.log" $PY -m pytest -q -m gpu -rA \
      -p no:cacheprovider --durations=8 $EXTRA_TESTS
    grep -E "passed|failed|error" "$OUT/gpu_extra_tests.log" | tail -n 3 >>"$summary"
  fi
  finish
  ;;
bench)
  BUDGET_S=${BUDGET_S:-500}
  . scripts/device_lib.sh
  env_report | head -n 3
  step "fp8_w8a16 GPU tests" 80 "$OUT/fp8_w8a16_gpu_tests.log" $PY -m pytest -q -m gpu -rA \
    -p no:cacheprovider tests/gpu/test_fp8_w8a16_gpu.py
  grep -E "passed|failed|error" "$OUT/fp8_w8a16_gpu_tests.log" | tail -n 3 >>"$summary"
  step "int_w4a16 benchmark, 4 bits, cvt" 170 "$OUT/int_w4a16_bench.log" \
    $PY -m benchmarks.int_w4a16 --batches 1,8,32,256,1024,4096 --out "$OUT/int_w4a16_4bit.json"
  grep -E "M=" "$OUT/int_w4a16_bench.log" | sed "s/^/cvt /" >>"$summary"
  step "int_w4a16 benchmark, 4 bits, bits" 100 "$OUT/int_w4a16_bench_bits.log" \
    env TANDEM_W4A16_CONVERT=bits $PY -m benchmarks.int_w4a16 --batches 1,8,32,256 \
    --out "$OUT/int_w4a16_4bit_bits.json"
  grep -E "M=" "$OUT/int_w4a16_bench_bits.log" | sed "s/^/bits /" >>"$summary"
  step "int_w4a16 benchmark, 8 bits, bits" 70 "$OUT/int_w4a16_bench8_bits.log" \
    env TANDEM_W4A16_CONVERT=bits $PY -m benchmarks.int_w4a16 --bits 8 --group-size -1 \
    --batches 1,8 --out "$OUT/int_w4a16_8bit_bits.json"
  grep -E "M=" "$OUT/int_w4a16_bench8_bits.log" | sed "s/^/bits8 /" >>"$summary"
  finish
  ;;
all)
  # One call for both (~9.5 min, either card), most needed first.
  BUDGET_S=${BUDGET_S:-575}
  . scripts/device_lib.sh
  env_report | head -n 3
  step "int_w4a16 GPU tests" 270 "$OUT/int_w4a16_gpu_tests.log" $PY -m pytest -q -m gpu -rA \
    -p no:cacheprovider -s --durations=8 tests/gpu/test_int_w4a16_gpu.py
  grep -E "passed|failed|error" "$OUT/int_w4a16_gpu_tests.log" | tail -n 3 >>"$summary"
  int_bench() {  # int_bench TAG BATCHES CONVERT NIBBLES LIMIT: 4 bits, groups of 128
    step "int_w4a16 benchmark $1" "$5" "$OUT/int_w4a16_$1.log" \
      env TANDEM_W4A16_CONVERT="$3" TANDEM_W4A16_NIBBLES="$4" $PY -m benchmarks.int_w4a16 \
      --batches "$2" --sustain-s 0.2 --out "$OUT/int_w4a16_4bit_$1.json"
    grep -E "M=" "$OUT/int_w4a16_$1.log" | sed "s/^/$1 /" >>"$summary"
  }
  int_bench cvt_join 1,8,32,1024,4096 cvt join 130
  int_bench bits_join 1,8,32 bits join 80
  int_bench bits_split 32 bits split 45
  step "fp8_w8a16 GPU tests" 60 "$OUT/fp8_w8a16_gpu_tests.log" $PY -m pytest -q -m gpu -rA \
    -p no:cacheprovider tests/gpu/test_fp8_w8a16_gpu.py
  grep -E "passed|failed|error" "$OUT/fp8_w8a16_gpu_tests.log" | tail -n 3 >>"$summary"
  finish
  ;;
*)
  echo "unknown PART=${part}" >&2
  exit 2
  ;;
esac
