#!/usr/bin/env bash
# Wave 3, twenty-seventh session's device calls, and the next session's check they call for.
#
# What ran (one H100: five starts were refused first, the H200 never came; 1,651 of the
# session's 1,800 s of device time): session 25's parts, from its script, one call each on one
# warm machine:
#   OUT=$OUT PART=pair BUDGET_S=560 bash scripts/gpu_session25.sh       (.whl + .smol/2.0)
#   OUT=$OUT PART=smoltests BUDGET_S=560 bash scripts/gpu_session25.sh  (the rest of the model)
#   OUT=$OUT PART=fp8served BUDGET_S=290 bash scripts/gpu_session25.sh
# The embedded SmolLM2 (98,362,432 bytes) went in two pieces named 2.0 and 2.1 (gpu_session25's
# smol_pieces joins N pieces named N.i): 2.0, 40,500,000 bytes, beside .whl (16.8 MB) and the
# 8.7 MB tree; 2.1 (57.9 MB) beside the tree was refused as over 64 MiB, so it travelled as two
# halves in two calls (kept in /tmp/part by the first, joined into .smol/2.1 by the second):
#   head -c 40500000 $GGUF >.smol/2.0; tail -c +40500001 $GGUF >.smol/2.1
#   head -c 29000000 .smol/2.1 >.smolx/a; tail -c +29000001 .smol/2.1 >.smolx/b
# (.smol/ and .smolx/ in .git/info/exclude.) Next time, three pieces that smol_pieces joins by
# itself: 3.0 with .whl on the first call (40,500,000 bytes), 3.1 and 3.2 (about 29 MB each) on
# the next two, each beside other work:
#   head -c 40500000 $GGUF >.smol/3.0
#   tail -c +40500001 $GGUF | head -c 29000000 >.smol/3.1
#   tail -c +69500001 $GGUF >.smol/3.2
# Results: benchmarks/results/*_h100_2026-12-06_s27*.
#
#   PART=ab (~7 min; for the next session, on whichever card comes): this session's bf16 served
#            TPOT p50 at 5 and 15 req/s (8.36 / 11.92 ms) sat 13% over sessions 23-24's on
#            other H100s (7.39-7.48 / 10.50), all at once 5% under in output tok/s. The served
#            path changed in between only by the split-K rule (64c129c: one split from batch 13;
#            at 5 req/s the batch is mostly under 13, where the rule is as before) and the
#            long-prompt cap (2c181ed: prompts over 2,048 tokens only). This runs the unified
#            server from HEAD and from session 23's tree (b1cea05) on the same machine, the
#            same prompts, 5 and 15 req/s: the same gap there is the code, none is the machine.
#            Make the old tree first (outside git; carried):
#              echo /.old/ >>.git/info/exclude; rm -rf .old; mkdir .old
#              git archive b1cea05 tandem tandem_kernels tandem_services tandem_protos \
#                benchmarks scripts | tar -x -C .old
#            then carry .old (and .whl on a fresh machine).
#
#   PART=table30 (~4.5 min; on an H200, where issue 30's vLLM figures were measured): the
#            served table at the defaults (bf16, async scheduling on; 5 / 15 / 25 req/s and all
#            at once, fresh prompts per rate), nothing else: late planning, measured three
#            times on H100s (sessions 23, 24, 27), stays opt-in.
#
#   OUT=/some/dir PART=ab bash scripts/gpu_session27.sh
set -u
ISSUE=session27

served() {  # served SUBDIR VAR=VALUE...: gpu_issue14.sh's unified server under $OUT/SUBDIR
  local sub=$1
  shift
  mkdir -p "$OUT/$sub"
  env OUT="$OUT/$sub" RUNS=unified OFFLINE=none BUDGET_S=$((BUDGET_S - 20)) "$@" \
    bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| (unified|vLLM)|answered" | tee -a "$summary"
  rm -f "$OUT/$sub"/*.png
}

case "${PART:-ab}" in
ab)
  BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  [ -d .old/tandem ] || { echo "no .old tree: see this script's header" | tee -a "$summary"; exit 2; }
  served ab OLD_TREE=.old RATES=5,15 TAG=_ab
  finish
  ;;
table30)
  BUDGET_S=${BUDGET_S:-300}
  . scripts/device_lib.sh
  served bf16 RATES=5,15,25,inf
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
