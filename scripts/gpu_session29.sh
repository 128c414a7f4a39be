#!/usr/bin/env bash
# Wave 3, twenty-ninth session's device calls.
#
#   PART=auto (~9.5 min): whichever card came. An H200: issue 30's served table at the defaults
#            and the same load in FP8 (scripts/gpu_session28.sh's PART=h200; issue 30's vLLM
#            figures are H200 figures). An H100: PART=fi. Carry .whl and .fi.
#   PART=fi (~9.5 min, either card): FlashInfer with its tensor-core decode (the backend's
#            form since this session: 4+ query heads per KV head): the backend's kernel tests
#            (bf16 / fp16, the refusals), the engine test against TRITON_ATTN's engine,
#            issue 30's kernel table (triton / flashinfer / flashinfer_tc / sdpa):
#            gpu_session28.sh's PART=flashinfer (.fi/ and .ficache/ as there).
#   PART=h200: gpu_session28.sh's (either card).
#
# What ran: eighteen starts refused (1,411 of the session's 1,800 s), then one H200:
#   OUT=$OUT PART=fi BUDGET_S=250 bash scripts/gpu_session29.sh   (cut while FlashInfer compiled;
#   PART=fi then ran its own copy of gpu_session28.sh's steps, with the kernel tests' limit 200 s)
#   then, warm, the kernel tests alone (pytest -k "flashinfer and not engine", 46 s): bf16 and
#   fp16 passed; an FP8 cache's decode passed and its mixed step did not compile (FlashInfer's
#   Hopper prefill, bf16 queries over e4m3 pages), so the FP8 cache is refused on FLASHINFER
#   since. Results: benchmarks/results/gpu_flashinfer_h200_2026-12-06_s29.log.
# Next session: PART=auto (carry .whl and .fi).
#
#   OUT=/some/dir PART=auto bash scripts/gpu_session29.sh
set -u
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "card: $card"
part=${PART:-auto}
if [ "$part" = auto ]; then
  case "$card" in
  *H200*) part=h200 ;;
  *) part=fi ;;
  esac
fi
case "$part" in
h200) PART=h200 exec bash scripts/gpu_session28.sh ;;
fi) PART=flashinfer exec bash scripts/gpu_session28.sh ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
