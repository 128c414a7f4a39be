#!/usr/bin/env bash
# Wave 3, thirty-first session's device calls.
#
#   PART=measure (~9 min, an H200: issue 30's vLLM figures are H200 figures): issue 30's served
#            table at the defaults (scripts/gpu_session27.sh PART=table30: bf16, 5 / 15 / 25
#            req/s and all at once, fresh prompts per rate), then where a small bf16 decode
#            step's time goes (benchmarks.step_breakdown, random llama-3.1-8b, 1 and 8 requests
#            of 1,024 prompt tokens: the batches the served table's 5 req/s decodes at).
#            Carry .whl. Back: summary.txt, logs.tar.gz (the breakdowns' logs and JSON), t30/.
#   PART=fp8 (~8 min, the same H200 after PART=measure): the served table in FP8
#            (--quantization fp8 --kv-cache-dtype fp8: scripts/gpu_session22.sh PART=fp8served,
#            issue 28's served comparison against PART=measure's bf16 rows) and FP8 batch 1
#            with --enable-pdl (issue 28's 2.3 ms bar). Carry .whl.
#
# What ran: ten calls got no machine (about 620 s), then PART=measure on an H100 (a plain call
#   may get either card), so its served table is not set against vLLM's H200 figures; then,
#   on the warm H100, the GPU files touched since the last suite, in three pytest calls
#   (tests/gpu/test_attention_backends_gpu.py with .fi's FlashInfer on PYTHONPATH; the
#   engine-level files; the kernel files): 225 passed. PART=fp8 did not run (device time).
#   Results: benchmarks/results/*_h100_2026-12-07_s31*.
#
#   OUT=/some/dir PART=measure bash scripts/gpu_session31.sh
set -u
ISSUE=session31

small_breakdowns() {  # the bf16 decode step at batches 1 and 8 (step_breakdown's decode phase)
  for n in 1 8; do
    decode_breakdown "$n" 1024 40 "$LOGS"
  done
}

case "${PART:-measure}" in
measure)
  BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  env_report | head -n 3
  mkdir -p "$OUT/t30"
  OUT="$OUT/t30" PART=table30 BUDGET_S=310 bash scripts/gpu_session27.sh 2>&1 | tail -n 20
  small_breakdowns
  finish
  ;;
fp8)
  BUDGET_S=${BUDGET_S:-540}
  . scripts/device_lib.sh
  mkdir -p "$OUT/fp8"
  OUT="$OUT/fp8" PART=fp8served BUDGET_S=300 bash scripts/gpu_session22.sh 2>&1 | tail -n 20
  WORKLOADS=none offline fp8_fp8kv_b1_pdl 150 --quantization fp8 --kv-cache-dtype fp8 \
    --enable-pdl
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
