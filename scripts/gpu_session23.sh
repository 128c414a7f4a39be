#!/usr/bin/env bash
# Wave 3, twenty-third session's device plan: session 22's plan (scripts/gpu_session22.sh, whose
# parts served / long / table / fp8served had not run) and the GPU tests of what changed since
# the last `make test-gpu` part ran, one device call a part, carrying .whl, results under $OUT.
#
#   PART=tests (~4 min): the engine file (late planning's engine process against async
#            scheduling with real CUDA waits, never run; the rest of the engine's parity,
#            graph and shutdown tests) and the W8A16 / W16A16 file (session 21's
#            UnquantizedLinearMethod refactor, c12e5a1, never run on a GPU), then the PDL
#            file (PendingStep.wait_device sits in the step path the PDL chain uses).
#   PART=testslong (~9.5 min): the same tests (220 s at most), then issue 30's long-context
#            serving (8k-32k prompts beside short chats, never run on a GPU; gpu_issue30.sh
#            without its kernel table, which session 17 measured).
#   PART=late (~7 min): the late-planning engine test (rewritten after its first run: near-tie
#            criterion), then 25 req/s under --async-scheduling on, late and off, fresh prompts
#            (FIRST_SEED=5): a second pair beside PART=served's, and the synchronous engine.
#   PART=longthr (~4 min): the late-planning engine test, then long-context serving again with
#            --long-prefill-token-threshold 2048 (a long prompt takes at most 2,048 of a
#            step's 8,192 tokens, leaving the rest to the short requests queued behind it).
#   Other parts: PART=served|fp8served|long|table run scripts/gpu_session22.sh's.
#
#   OUT=/some/dir PART=tests bash scripts/gpu_session23.sh
set -u
ISSUE=session23
case "${PART:-tests}" in
tests)
  BUDGET_S=${BUDGET_S:-330}
  . scripts/device_lib.sh
  step "GPU tests" 300 "$OUT/gpu_tests_s23.log" $PY -m pytest -v -m gpu --timeout=250 -rs \
    --tb=short --durations=12 tests/gpu/test_gpu_engine.py tests/gpu/test_fp8_w8a16_gpu.py \
    tests/gpu/test_pdl_gpu.py
  grep -E " (PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_s23.log" | tail -n 50 >>"$summary"
  finish
  ;;
testslong)
  BUDGET_S=${BUDGET_S:-580}
  . scripts/device_lib.sh
  step "GPU tests" 220 "$OUT/gpu_tests_s23.log" $PY -m pytest -v -m gpu --timeout=200 -rs \
    --tb=short --durations=12 tests/gpu/test_gpu_engine.py tests/gpu/test_fp8_w8a16_gpu.py
  grep -E " (PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_s23.log" | tail -n 40 >>"$summary"
  left=$((BUDGET_S - (SECONDS - START) - 5))
  OUT="$OUT/long" SKIP_KERNELS=1 BUDGET_S=$left bash scripts/gpu_issue30.sh
  cat "$OUT/long/summary.txt" >>"$summary"
  finish
  ;;
late)
  BUDGET_S=${BUDGET_S:-420}
  . scripts/device_lib.sh
  step "late test" 90 "$OUT/gpu_tests_late.log" $PY -m pytest -v -s -m gpu --timeout=80 -rs \
    --tb=short tests/gpu/test_gpu_engine.py -k late_planning
  grep -E "identical|PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_late.log" >>"$summary"
  for mode in on late off; do
    left=$((BUDGET_S - (SECONDS - START) - 5))
    [ "$left" -gt 70 ] || { echo "$mode: skipped ($left s left)" | tee -a "$summary"; continue; }
    mkdir -p "$OUT/async_$mode"
    OUT="$OUT/async_$mode" RUNS=unified OFFLINE=none RATES=25 FIRST_SEED=5 TAG="_async_$mode" \
      ENGINE_EXTRA="--async-scheduling $mode" BUDGET_S=$left bash scripts/gpu_issue14.sh 2>&1 \
      | grep -E "^\| unified|rate 25|late planning" | tee -a "$summary"
  done
  rm -f "$OUT"/*/issue14.png
  finish
  ;;
longthr)
  BUDGET_S=${BUDGET_S:-250}
  . scripts/device_lib.sh
  step "late test" 80 "$OUT/gpu_tests_late.log" $PY -m pytest -v -s -m gpu --timeout=70 -rs \
    --tb=short tests/gpu/test_gpu_engine.py -k late_planning
  grep -E "identical|PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_late.log" >>"$summary"
  left=$((BUDGET_S - (SECONDS - START) - 5))
  OUT="$OUT/long_thr2048" SKIP_KERNELS=1 BUDGET_S=$left \
    ENGINE_EXTRA="--long-prefill-token-threshold 2048" bash scripts/gpu_issue30.sh
  cat "$OUT/long_thr2048/summary.txt" >>"$summary"
  finish
  ;;
*)
  bash scripts/gpu_session22.sh
  ;;
esac
