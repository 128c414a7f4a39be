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
#            criterion) and serve_offline's device-timed timeline (CUDA events; new), then 25 req/s under --async-scheduling on, late and off, fresh prompts
#            (FIRST_SEED=5): a second pair beside PART=served's, and the synchronous engine.
#   PART=longthr (~4 min): the same two tests, then long-context serving again with
#            --long-prefill-token-threshold 2048 (a long prompt takes at most 2,048 of a
#            step's 8,192 tokens, leaving the rest to the short requests queued behind it).
#   Other parts: PART=served|fp8served|long|table run scripts/gpu_session22.sh's.
#
#   OUT=/some/dir PART=tests bash scripts/gpu_session23.sh
set -u
ISSUE=session23
gpu_tests() {  # gpu_tests LIMIT_S LOG PYTEST_ARGS...: GPU tests, their verdicts into the summary
  local limit=$1 log="$OUT/$2"
  shift 2
  step "GPU tests" "$limit" "$log" $PY -m pytest -v -s -m gpu --timeout=$((limit - 20)) -rs \
    --tb=short --durations=12 "$@"
  grep -E "identical|PASSED|FAILED|ERROR|passed|failed" "$log" | tail -n 50 >>"$summary"
}

long_serving() {  # long_serving DIR [ENGINE_FLAGS]: gpu_issue30.sh's serving step, in what is left
  local left=$((BUDGET_S - (SECONDS - START) - 5))
  OUT="$OUT/$1" SKIP_KERNELS=1 BUDGET_S=$left ENGINE_EXTRA="${2:-}" bash scripts/gpu_issue30.sh
  cat "$OUT/$1/summary.txt" >>"$summary"
}

# Session 23's GPU tests not yet run on a GPU (PART=late and PART=longthr run them first).
NEW_GPU_TESTS=(tests/gpu/test_serve_offline_gpu.py
  "tests/gpu/test_gpu_engine.py::test_late_planning_engine_process_agrees_with_async")

case "${PART:-tests}" in
tests)
  BUDGET_S=${BUDGET_S:-330}
  . scripts/device_lib.sh
  gpu_tests 300 gpu_tests_s23.log tests/gpu/test_gpu_engine.py tests/gpu/test_fp8_w8a16_gpu.py \
    tests/gpu/test_pdl_gpu.py
  finish
  ;;
testslong)
  BUDGET_S=${BUDGET_S:-580}
  . scripts/device_lib.sh
  gpu_tests 220 gpu_tests_s23.log tests/gpu/test_gpu_engine.py tests/gpu/test_fp8_w8a16_gpu.py
  long_serving long
  finish
  ;;
late)
  BUDGET_S=${BUDGET_S:-420}
  . scripts/device_lib.sh
  gpu_tests 120 gpu_tests_late.log "${NEW_GPU_TESTS[@]}"
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
  gpu_tests 120 gpu_tests_late.log "${NEW_GPU_TESTS[@]}"
  long_serving long_thr2048 "--long-prefill-token-threshold 2048"
  finish
  ;;
*)
  bash scripts/gpu_session22.sh
  ;;
esac
