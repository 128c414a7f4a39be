#!/usr/bin/env bash
# Wave 3, twenty-fourth session's device plan, one device call a part, carrying .whl, results
# under $OUT.
#
#   PART=late (~9.5 min): session 23's PART=late (the two GPU tests never run, then 25 req/s
#            under --async-scheduling on / late / off, fresh prompts) in 400 s, then where a
#            bf16 decode step's device time goes at the batch and context of issue 30's
#            all-at-once tail (144 sequences of ~1,150 tokens) and at its 5 req/s load (32).
#   PART=sweep (~9.5 min): the late-planning engine test (its criterion rewritten after its
#            second run: logprob agreement before the first difference, top 5 at it), the
#            split-K decode kernel's configs x split counts at batches 8-144
#            (benchmarks/decode_configs.py), then long-context serving with
#            --long-prefill-token-threshold 2048 (session 23's PART=longthr) in what is left.
#   PART=splits (~9 min): the decode kernel's configs x split counts again, timed in CUDA
#            graphs (PART=sweep timed eager calls, bound by their host work), then the bf16
#            decode step at 32 x 1,024 and 5 req/s served (fresh prompts, FIRST_SEED=3) with
#            TANDEM_DECODE_SPLIT_TARGET=2 (today's rule) and 1, then the late-planning test.
#            That variable existed for this run only (the working tree it ran from): the
#            measured rule replaced it in tandem_kernels.paged_attention.decode_num_splits, so
#            on main both loops below run that rule.
#   PART=pair (~9.5 min; meant for an H200, against issue 30's vLLM figures): issue 30's served
#            table (5 / 15 / 25 req/s and all at once, fresh prompts per rate, the served
#            defaults) under --async-scheduling on (the default) and late, the same prompts.
#   Other parts: scripts/gpu_session23.sh's.
#
#   OUT=/some/dir PART=late bash scripts/gpu_session24.sh
set -u
ISSUE=session24

decode_breakdowns() {  # the bf16 decode step at two batches (step_breakdown's decode phase)
  decode_breakdown 144 1152 20 "$OUT"
  decode_breakdown 32 1024 20 "$OUT"
}

case "${PART:-late}" in
pair)
  BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  for mode in on late; do
    left=$((BUDGET_S - (SECONDS - START) - 10))
    [ "$left" -gt 120 ] || { echo "table $mode: skipped ($left s left)" | tee -a "$summary"; continue; }
    [ "$mode" = on ] && left=$((left / 2))
    mkdir -p "$OUT/bf16_$mode"
    OUT="$OUT/bf16_$mode" RUNS=unified OFFLINE=none RATES=5,15,25,inf TAG="_async_$mode" \
      ENGINE_EXTRA="--async-scheduling $mode" BUDGET_S=$left bash scripts/gpu_issue14.sh 2>&1 \
      | grep -E "^\| unified|answered|late planning" | tee -a "$summary"
  done
  rm -f "$OUT"/*/issue14.png
  finish
  ;;
splits)
  BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  step "decode configs" 150 "$OUT/decode_configs_graphs.log" $PY -m benchmarks.decode_configs \
    --batches 1,8,16,32,64,144 --contexts 1024 --splits 1,2,3,4,8 \
    --out "$OUT/decode_configs_graphs.json"
  grep -E "^batch|GB/s by|target" "$OUT/decode_configs_graphs.log" >>"$summary"
  for t in 2 1; do
    step "decode breakdown 32 x 1024, target $t" 60 "$OUT/breakdown_decode_32x1024_t$t.log" \
      env TANDEM_DECODE_SPLIT_TARGET=$t $PY -m benchmarks.step_breakdown \
      --model random:llama-3.1-8b --device cuda --num-prompts 32 --input-len 1024 --steps 20 \
      --out "$OUT/breakdown_decode_32x1024_t$t.json"
    grep -A 9 "^decode:" "$OUT/breakdown_decode_32x1024_t$t.log" >>"$summary"
  done
  for t in 2 1; do
    left=$((BUDGET_S - (SECONDS - START) - 100))
    [ "$left" -gt 70 ] || { echo "served t$t: skipped ($left s left)" | tee -a "$summary"; continue; }
    mkdir -p "$OUT/served_t$t"
    TANDEM_DECODE_SPLIT_TARGET=$t OUT="$OUT/served_t$t" RUNS=unified OFFLINE=none RATES=5 \
      FIRST_SEED=3 TAG="_split_t$t" BUDGET_S=$left bash scripts/gpu_issue14.sh 2>&1 \
      | grep -E "^\| unified" | tee -a "$summary"
  done
  rm -f "$OUT"/*/issue14.png
  step "GPU tests" 150 "$OUT/gpu_tests_splits.log" $PY -m pytest -v -s -m gpu --timeout=140 \
    -rs --tb=short \
    "tests/gpu/test_gpu_engine.py::test_late_planning_engine_process_agrees_with_async"
  grep -E "identical|PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_splits.log" >>"$summary"
  finish
  ;;
sweep)
  BUDGET_S=${BUDGET_S:-575}
  . scripts/device_lib.sh
  step "GPU tests" 90 "$OUT/gpu_tests_sweep.log" $PY -m pytest -v -s -m gpu --timeout=80 -rs \
    --tb=short "tests/gpu/test_gpu_engine.py::test_late_planning_engine_process_agrees_with_async"
  grep -E "identical|PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_sweep.log" >>"$summary"
  step "decode configs" 200 "$OUT/decode_configs.log" $PY -m benchmarks.decode_configs \
    --batches 8,32,64,144 --contexts 1024 --out "$OUT/decode_configs.json"
  grep -E "^batch|GB/s by" "$OUT/decode_configs.log" >>"$summary"
  left=$((BUDGET_S - (SECONDS - START) - 5))
  OUT="$OUT/long_thr2048" SKIP_KERNELS=1 BUDGET_S=$left \
    ENGINE_EXTRA="--long-prefill-token-threshold 2048" bash scripts/gpu_issue30.sh
  cat "$OUT/long_thr2048/summary.txt" >>"$summary"
  finish
  ;;
late)
  OUT="$OUT/late" PART=late BUDGET_S=400 bash scripts/gpu_session23.sh
  BUDGET_S=${BUDGET_S:-575}
  . scripts/device_lib.sh
  START=0  # the budget counts from this script's start, before the part above
  cat "$OUT/late/summary.txt" >>"$summary"
  decode_breakdowns
  finish
  ;;
*)
  bash scripts/gpu_session23.sh
  ;;
esac
