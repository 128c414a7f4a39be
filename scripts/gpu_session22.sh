#!/usr/bin/env bash
# Wave 3, twenty-second session's device plan: what issues 28 and 30 still need measured, in the
# order to run it, one device call a part, from the repository root carrying .whl, results
# under $OUT. Session 22 had no device time (159 s left at its start); nothing here has run.
#
#   PART=served (~9.5 min): issue 30's served table in bf16 at the defaults (W16A16 on since
#            session 21; fresh prompts per rate, 5 / 15 / 25 req/s and all at once), then the
#            offline engine on the same requests and arrival times, at the same served defaults
#            (serve_offline takes them since session 22; before, its 2,048-token budget was not
#            the served 8,192), with its step timeline: the served/offline ratio per rate says
#            how much of the all-at-once gap (0.94x vLLM's throughput against a 1.1x bar) is the
#            serving path and how much the engine. Then, as time allows:
#            - bf16 with --enable-pdl at 5 and 15 req/s (the decode chain's kernels launched
#              with PDL; the W16A16 GEMVs read weights before their wait), where TPOT p50 at
#              5 req/s is 0.94x vLLM's against a 0.9x bar;
#            - bf16 at 25 req/s with --async-scheduling late, then off, where TTFT p99 is
#              1.15x vLLM's against 0.9x. Under async scheduling step N+1 is planned as step N
#              starts, so a request that arrives during step N waits for N+1 before its own
#              prefill: one step more than a synchronous engine. "late" (session 22, never run
#              on a GPU) plans N+1 shortly before N is predicted to end, taking requests until
#              then; "off" shows what the synchronous engine gives (TTFT down by about one
#              step, TPOT up by the host's planning time). Set both against the table's
#              25 req/s row (same prompts: FIRST_SEED=3). If "late" keeps TPOT and cuts TTFT,
#              it becomes the served default.
#            About 170 + 100 + 90 + 60 + 60 s.
#   PART=fp8served (~3 min): the same table in FP8 (--quantization fp8 --kv-cache-dtype fp8;
#            issue 28's served comparison, whose last same-call run, session 17's, lacked 25 req/s
#            and all at once); set against PART=served's bf16 rows of the same device session.
#   PART=long (~8.5 min): scripts/gpu_issue30.sh, the kernel table (prefill to 128k, decode
#            64 x 32k) and long-context serving (8k-32k prompts beside short chats), which has
#            never run on a GPU.
#   PART=table (~9 min): issue 28's table (FP8 + FP8 KV, each flag alone, 128/128, 512/256,
#            1000/1000, batch 1): scripts/gpu_session20.sh PART=table with FUSED=0.
#
#   OUT=/some/dir PART=served bash scripts/gpu_session22.sh
set -u
ISSUE=session22
case "${PART:-served}" in
served)
  BUDGET_S=${BUDGET_S:-585}
  . scripts/device_lib.sh
  mkdir -p "$OUT/bf16" "$OUT/bf16_pdl"
  OUT="$OUT/bf16" RUNS=unified OFFLINE=last TIMELINE=1 OFFLINE_LIMIT_S=150 RATES=5,15,25,inf \
    BUDGET_S=300 bash scripts/gpu_issue14.sh 2>&1 \
    | grep -E "^\| |answered|total|rate|of the offline" | tee -a "$summary"
  left=$((BUDGET_S - (SECONDS - START) - 10))
  if [ "$left" -gt 100 ]; then
    OUT="$OUT/bf16_pdl" RUNS=unified OFFLINE=none RATES=5,15 TAG=_pdl ENGINE_EXTRA=--enable-pdl \
      BUDGET_S=$left bash scripts/gpu_issue14.sh 2>&1 \
      | grep -E "^\| unified|answered|total|rate" | tee -a "$summary"
  else
    echo "bf16 --enable-pdl: skipped ($left s left)" | tee -a "$summary"
  fi
  for mode in late off; do
    left=$((BUDGET_S - (SECONDS - START) - 10))
    if [ "$left" -gt 60 ]; then
      mkdir -p "$OUT/bf16_async_$mode"
      OUT="$OUT/bf16_async_$mode" RUNS=unified OFFLINE=none RATES=25 FIRST_SEED=3 \
        TAG="_async_$mode" ENGINE_EXTRA="--async-scheduling $mode" BUDGET_S=$left \
        bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| unified|answered|total|rate|late planning" \
        | tee -a "$summary"
    else
      echo "bf16 --async-scheduling $mode: skipped ($left s left)" | tee -a "$summary"
    fi
  done
  rm -f "$OUT"/*/issue14.png
  finish
  ;;
fp8served)
  BUDGET_S=${BUDGET_S:-300}
  . scripts/device_lib.sh
  mkdir -p "$OUT/fp8"
  OUT="$OUT/fp8" RUNS=unified OFFLINE=none RATES=5,15,25,inf BUDGET_S=$((BUDGET_S - 20)) \
    ENGINE_EXTRA="--quantization fp8 --kv-cache-dtype fp8" bash scripts/gpu_issue14.sh 2>&1 \
    | grep -E "^\| unified|answered|total" | tee -a "$summary"
  rm -f "$OUT"/*/issue14.png
  finish
  ;;
long)
  BUDGET_S=${BUDGET_S:-570} bash scripts/gpu_issue30.sh
  ;;
table)
  FUSED=0 PART=table bash scripts/gpu_session20.sh
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
