#!/usr/bin/env bash
# Wave 3, twenty-ninth session's device calls.
#
#   PART=auto (~9.5 min): whichever card came. An H200: issue 30's served table at the defaults
#            and the same load in FP8 (scripts/gpu_session28.sh's PART=h200; issue 30's vLLM
#            figures are H200 figures). An H100: FlashInfer with its tensor-core decode (the
#            backend's form since this session: group of query heads per KV head >= 4), the
#            backend's kernel and engine tests and issue 30's kernel table
#            (gpu_session28.sh's PART=flashinfer). Carry .whl and .fi.
#   PART=fi / PART=h200: either half, whatever the card.
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
