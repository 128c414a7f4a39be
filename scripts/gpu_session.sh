#!/usr/bin/env bash
# One device call at a session's end (one H200), each step time-limited within BUDGET_S:
#   1. the GPU test suite, all of tests/gpu in one process (`make test-gpu`);
#   2. issue 14's load through `tandem serve` (scripts/gpu_issue14.sh with ISSUE14_ENV, at most
#      ISSUE14_BUDGET_S);
#   3. the structured-output benchmark (STRUCTURED_CMD; skipped when empty);
#   4. the offline throughput benchmark at 512/256 (with the batch-1 TPOT);
#   5. mixed-step times (decode batch 24 at 1,100 tokens beside a 16/128-token prefill) for
#      each --cudagraph-mode in SWEEP_MODES (skipped when empty).
#
# Steps 1 and 2 are skipped with TESTS=0 / ISSUE14=0.
#
#   OUT=/some/dir bash scripts/gpu_session.sh           (from the repository root; carry .whl)
ISSUE=session
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
env_report

if [ "${TESTS:-1}" = 1 ]; then
  step "1 gpu tests" "${TESTS_LIMIT_S:-230}" "$OUT/gpu_tests.log" \
    $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs
  tail -n 3 "$OUT/gpu_tests.log" >>"$summary"
fi

left=$((BUDGET_S - (SECONDS - START)))
if [ "${ISSUE14:-1}" != 1 ]; then
  :
elif [ "$left" -gt 120 ]; then
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
  step "4 offline throughput 512/256" "${OFFLINE_LIMIT_S:-150}" "$OUT/offline_throughput.log" \
    $PY -m benchmarks.offline_throughput --model random:llama-3.1-8b --device cuda --skip-peer \
    --workloads 512/256 --out "$OUT/offline_throughput.json"
  tail -n 6 "$OUT/offline_throughput.log" >>"$summary"
fi

for mode in ${SWEEP_MODES:-}; do
  step "5 mixed steps $mode" 70 "$OUT/mixed_$mode.log" \
    $PY -m benchmarks.decode_sweep --model random:llama-3.1-8b --dtype bfloat16 \
    --max-model-len 4096 --batches 24 --contexts 1100 --mixed-prefill 16,128 \
    --cudagraph-mode "$mode" --out "$OUT/mixed_$mode.json"
  grep -i "mixed" "$OUT/mixed_$mode.log" | tail -n 4 >>"$summary"
done

finish
