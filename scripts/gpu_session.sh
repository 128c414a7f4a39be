#!/usr/bin/env bash
# One device call at a session's end (one H200), each step time-limited within BUDGET_S:
#   1. the GPU test suite, all of tests/gpu in one process (`make test-gpu`);
#   2. issue 14's load through `tandem serve` (scripts/gpu_issue14.sh with ISSUE14_ENV, at most
#      ISSUE14_BUDGET_S);
#   3. the structured-output benchmark (STRUCTURED_CMD; skipped when empty);
#   4. the offline throughput benchmark at 512/256 (with the batch-1 TPOT).
#
#   OUT=/some/dir bash scripts/gpu_session.sh           (from the repository root; carry .whl)
ISSUE=session
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
env_report

step "1 gpu tests" "${TESTS_LIMIT_S:-230}" "$OUT/gpu_tests.log" \
  $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs
tail -n 3 "$OUT/gpu_tests.log" >>"$summary"

left=$((BUDGET_S - (SECONDS - START)))
if [ "$left" -gt 120 ]; then
  [ -n "${ISSUE14_BUDGET_S:-}" ] && [ "$ISSUE14_BUDGET_S" -lt "$left" ] && left=$ISSUE14_BUDGET_S
  # shellcheck disable=SC2086
  env OUT="$OUT/issue14" BUDGET_S=$((left - 10)) ${ISSUE14_ENV:-} bash scripts/gpu_issue14.sh \
    >"$OUT/issue14.log" 2>&1
  cat "$OUT/issue14/summary.txt" >>"$summary"
else
  echo "2 issue 14: skipped (budget spent)" | tee -a "$summary"
fi
if [ -n "${STRUCTURED_CMD:-}" ]; then
  read -r -a SCMD <<<"$STRUCTURED_CMD"
  step "3 structured outputs" "${STRUCTURED_LIMIT_S:-90}" "$OUT/structured.log" $PY "${SCMD[@]}"
  tail -n 12 "$OUT/structured.log" >>"$summary"
fi

if [ "${OFFLINE_THROUGHPUT:-1}" = 1 ]; then
  step "4 offline throughput 512/256" 80 "$OUT/offline_throughput.log" \
    $PY -m benchmarks.offline_throughput --model random:llama-3.1-8b --skip-peer \
    --workloads 512/256 --out "$OUT/offline_throughput.json"
  tail -n 6 "$OUT/offline_throughput.log" >>"$summary"
fi

finish
