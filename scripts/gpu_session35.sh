#!/usr/bin/env bash
# Wave 3, thirty-fifth session's device calls. Carry .whl.
#
#   PART=auto (~9 min): on an H200, PART=h200; on any other card, PART=h100.
#   PART=h200 (~9 min, on an H200 only): issue 30's served table at the defaults
#            (gpu_session32.sh's PART=base: the four rates, bf16 batch 1 both ways), then FP8 +
#            FP8 KV batch 1 with --enable-pdl (issue 28's 2.3 ms bar).
#   PART=h100 (~8 min, either card): what session 34's H100 left of the served table at HEAD
#            (25 req/s and all at once), then FP8 + FP8 KV batch 1 with --enable-pdl.
#   PART=budget (~9 min, either card): the served token budget A/B for issue 30's defaults:
#            gpu_issue14.sh's unified server at 15 / 25 req/s and all at once (prompts of a
#            full table's 15 req/s on: FIRST_SEED=2), --max-num-batched-tokens 4096 against the
#            8,192 default, one after the other in one call. Then $EXTRA_TESTS (pytest node ids
#            or files, -m gpu) if set.
#   Other parts: scripts/gpu_session34.sh's.
#
# What ran: PART=auto, naming the H200 kind, came on an H100 (first call, no refusal): PART=h100,
#   but before `served` took FIRST_SEED, so its 25 req/s and all-at-once sent the prompts of a
#   full table's 5 and 15 req/s (seeds 1, 2): not like for like with the earlier tables' rows.
#   Then, each on an H100: scripts/gpu_w4a16.sh (BUDGET_S=420) with tests/gpu/test_fp8_w8a16_gpu.py
#   after it (cut at 150 s; 9 passed in a later call), PART=budget (BUDGET_S=540), and the
#   integer GEMM's benchmark with TANDEM_W4A16_MAGIC=0 / 1 (a form since removed).
#   Results: benchmarks/results/*_h100_2026-12-07_s35*.
#
#   OUT=/some/dir PART=auto bash scripts/gpu_session35.sh
set -u
ISSUE=session35
part=${PART:-auto}
if [ "$part" = auto ]; then
  if nvidia-smi -L 2>/dev/null | grep -q H200; then part=h200; else part=h100; fi
  echo "PART=auto -> $part ($(nvidia-smi -L 2>/dev/null | head -n 1))"
fi

breakdown() {  # breakdown NAME N LEN [engine flags...]: the decode step by kernel
  local name=$1 n=$2 len=$3
  shift 3
  step "breakdown $name" 100 "$OUT/breakdown_$name.log" $PY -m benchmarks.step_breakdown \
    --model random:llama-3.1-8b --device cuda --num-prompts "$n" --input-len "$len" \
    --steps 20 --out "$OUT/breakdown_$name.json" "$@"
  grep -A 18 "^decode:" "$OUT/breakdown_$name.log" | sed "s/^/$name /" >>"$summary"
}

gpu_tests() {  # the GPU tests of this session's model changes and the engine file
  step "GPU model + engine tests" "$1" "$OUT/gpu_models_engine_tests.log" $PY -m pytest -q \
    -m gpu -rA -p no:cacheprovider tests/gpu/test_gpu_engine.py \
    tests/gpu/test_gpu_models.py -k "new_families or longrope or test_gpu_engine"
  grep -E "passed|failed" "$OUT/gpu_models_engine_tests.log" | tail -n 3 >>"$summary"
}

served() {  # served SUBDIR RATES BUDGET_S [FIRST_SEED [ENGINE_EXTRA]]: gpu_issue14.sh's
  # unified server at the defaults (+ ENGINE_EXTRA); FIRST_SEED: the first rate's prompts (3
  # for a full table's 25 req/s)
  mkdir -p "$OUT/$1"
  env OUT="$OUT/$1" FIRST_SEED="${4:-1}" RUNS=unified OFFLINE=none RATES="$2" BUDGET_S="$3" \
    ENGINE_EXTRA="${5:-}" \
    bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| (unified|vLLM)|answered" | tee -a "$summary"
  rm -f "$OUT/$1"/*.png
  # its services' logs into this call's logs.tar.gz (a call brings back at most 8 files)
  mv "$OUT/$1/logs.tar.gz" "$LOGS/$1_logs.tar.gz" 2>/dev/null
}

case "$part" in
budget)
  BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  env_report | head -n 3
  served b4096 15,25,inf 250 2 "--max-num-batched-tokens 4096"
  served b8192 15,25,inf 250 2
  if [ -n "${EXTRA_TESTS:-}" ]; then
    step "extra GPU tests" 120 "$OUT/gpu_extra_tests.log" $PY -m pytest -q -m gpu -rA \
      -p no:cacheprovider $EXTRA_TESTS
    grep -E "passed|failed" "$OUT/gpu_extra_tests.log" | tail -n 3 >>"$summary"
  fi
  finish
  ;;
tests)
  # Either card (~4 min): only the GPU tests of this session's model changes.
  BUDGET_S=${BUDGET_S:-240}
  . scripts/device_lib.sh
  env_report | head -n 3
  gpu_tests 220
  finish
  ;;
h100)
  BUDGET_S=${BUDGET_S:-520}
  . scripts/device_lib.sh
  env_report | head -n 3
  served t30 25,inf 260 3
  WORKLOADS=none offline fp8_fp8kv_b1_pdl 140 --quantization fp8 --kv-cache-dtype fp8 \
    --enable-pdl
  finish
  ;;
h200)
  BUDGET_S=${BUDGET_S:-560}
  OUT="$OUT/base" PART=base BUDGET_S=400 bash scripts/gpu_session32.sh 2>&1 | tail -n 30
  . scripts/device_lib.sh
  WORKLOADS=none offline fp8_fp8kv_b1_pdl 140 --quantization fp8 --kv-cache-dtype fp8 \
    --enable-pdl
  finish
  ;;
profile)
  BUDGET_S=${BUDGET_S:-330}
  . scripts/device_lib.sh
  env_report | head -n 3
  gpu_tests 200
  breakdown bf16_8x1500 8 1500
  breakdown fp8_fp8kv_1x128 1 128 --quantization fp8 --kv-cache-dtype fp8
  finish
  ;;
fp8)
  OUT=$OUT PART=fp8 bash scripts/gpu_session32.sh
  ;;
*)
  echo "unknown PART=${part}" >&2
  exit 2
  ;;
esac
