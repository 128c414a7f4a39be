#!/usr/bin/env bash
# Wave 3, thirty-second session's device calls (an H200: issue 30's vLLM figures are H200
# figures). Carry .whl.
#
#   PART=base (~5 min): issue 30's served table at the defaults (`served` below:
#            gpu_issue14.sh's unified server, bf16, 5 / 15 / 25 req/s and all at once, fresh
#            prompts per rate), then bf16 batch 1 on the 8B shape without and with --enable-pdl (the bf16 decode
#            chain runs the same Triton GEMV, norm, rotary and attention kernels PDL launches;
#            never timed in bf16).
#   PART=pdl (~9 min): the same served table with --enable-pdl (the same-run A/B session 17
#            asked for: PDL was the likelier cause of session 16's worse FP8 TTFT p99), then
#            FP8 + FP8 KV batch 1 with --enable-pdl (issue 28's 2.3 ms bar).
#   PART=gpu_ab (~9.5 min, either card): tests/gpu/test_gpu_engine.py (prompt logprobs on
#            CUDA), the served A/B at 5 req/s without and with --enable-pdl, bf16 batch 1 both.
#   PART=fp8 (~6 min): the served table in FP8 (--quantization fp8 --kv-cache-dtype fp8:
#            scripts/gpu_session22.sh PART=fp8served), issue 28's served comparison against
#            PART=base's bf16 rows.
#
# What ran: twelve calls got no machine (about 750 s with the lockouts), then PART=base on an
#   H100 (a call naming nvidia-h200 may get either card), so its served table is not set
#   against vLLM's H200 figures; then, on the warm H100: tests/gpu/test_gpu_engine.py and the
#   served table with --enable-pdl (one call: device_lib's `step` and this script's `served`),
#   the logits-processor, speculation, model and structured GPU files (three calls: the first
#   stopped at its first failure, the second lacked /tmp/site on PYTHONPATH), FP8 + FP8 KV
#   batch 1 with --enable-pdl.
#   Results: benchmarks/results/*_h100_2026-12-07_s32*.
# Next session, on an H200: PART=base, then PART=fp8 (both on the warm machine; carry .whl).
#
#   OUT=/some/dir PART=base bash scripts/gpu_session32.sh
set -u
ISSUE=session32

served() {  # served SUBDIR RATES BUDGET_S [ENGINE_EXTRA]: gpu_issue14.sh's unified server
  # under $OUT/SUBDIR at the defaults (+ extra engine flags), fresh prompts per rate
  mkdir -p "$OUT/$1"
  env OUT="$OUT/$1" RUNS=unified OFFLINE=none RATES="$2" BUDGET_S="$3" ENGINE_EXTRA="${4:-}" \
    bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| (unified|vLLM)|answered" | tee -a "$summary"
  rm -f "$OUT/$1"/*.png
}

case "${PART:-base}" in
base)
  BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  env_report | head -n 3
  served t30 5,15,25,inf 290
  WORKLOADS=none offline bf16_b1 110
  WORKLOADS=none offline bf16_b1_pdl 110 --enable-pdl
  finish
  ;;
pdl)
  BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  served t30_pdl 5,15,25,inf 290 --enable-pdl
  WORKLOADS=none offline fp8_fp8kv_b1_pdl 150 --quantization fp8 --kv-cache-dtype fp8 \
    --enable-pdl
  finish
  ;;
gpu_ab)
  # Either card: the engine's GPU file (prompt logprobs on CUDA among its tests), then the
  # served A/B at 5 req/s without and with --enable-pdl, then bf16 batch 1 both ways.
  BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  env_report | head -n 3
  step "GPU engine tests" 170 "$OUT/gpu_engine_tests.log" $PY -m pytest -q -m gpu -rA -s \
    -p no:cacheprovider tests/gpu/test_gpu_engine.py --durations=5
  grep -E "passed|failed|prompt logprobs vs|top-1 in" "$OUT/gpu_engine_tests.log" | tail -n 4 \
    >>"$summary"
  served ab_plain 5 120
  served ab_pdl 5 120 --enable-pdl
  WORKLOADS=none offline bf16_b1 90
  WORKLOADS=none offline bf16_b1_pdl 90 --enable-pdl
  finish
  ;;
fp8)
  BUDGET_S=${BUDGET_S:-330}
  . scripts/device_lib.sh
  mkdir -p "$OUT/fp8"
  OUT="$OUT/fp8" PART=fp8served BUDGET_S=300 bash scripts/gpu_session22.sh 2>&1 | tail -n 20
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
