#!/usr/bin/env bash
# Wave 3, twenty-ninth session's device calls.
#
#   PART=auto (~9.5 min): whichever card came. An H200: issue 30's served table at the defaults
#            and the same load in FP8 (scripts/gpu_session28.sh's PART=h200; issue 30's vLLM
#            figures are H200 figures). An H100: PART=fi. Carry .whl and .fi.
#   PART=fi (~9.5 min, either card): FlashInfer with its tensor-core decode (the backend's
#            form since this session: 4+ query heads per KV head): the backend's kernel tests
#            (bf16 / fp16, the refusals), the engine test against TRITON_ATTN's engine,
#            issue 30's kernel table
#            (triton / flashinfer / flashinfer_tc / sdpa). .fi/ and .ficache/ as in
#            gpu_session28.sh's PART=flashinfer.
#   PART=h200: gpu_session28.sh's (either card).
#
# What ran: eighteen starts refused (1,411 of the session's 1,800 s), then one H200:
#   OUT=$OUT PART=fi BUDGET_S=250 bash scripts/gpu_session29.sh   (cut while FlashInfer compiled)
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
fi)
  ISSUE=session29
  BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  $PY -m pip install -q --no-deps --target /tmp/site-fi .fi/*.whl >"$LOGS/pip_fi.log" 2>&1 \
    || echo "pip install of .fi/ failed (pip_fi.log)" | tee -a "$summary"
  export PYTHONPATH="/tmp/site-fi:$PYTHONPATH"
  export FLASHINFER_WORKSPACE_BASE=$PWD/.ficache MAX_JOBS=16
  mkdir -p .ficache
  {
    nvidia-smi -L
    $PY -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)"
  } 2>&1 | tee -a "$summary"
  T=tests/gpu/test_attention_backends_gpu.py
  step fi_tests 300 "$LOGS/fi_tests.log" \
    $PY -m pytest -q -rA -s -p no:cacheprovider "$T" -k "flashinfer and not engine" --durations=5
  step fi_engine 200 "$LOGS/fi_engine.log" \
    $PY -m pytest -q -rA -s -p no:cacheprovider "$T" -k "engine and FLASHINFER" --durations=3
  step fi_kernels 200 "$LOGS/fi_kernels.log" \
    $PY -m benchmarks.attention_kernels --backends triton,flashinfer,flashinfer_tc,sdpa \
    --out "$OUT/attention_kernels_flashinfer.json"
  cp "$LOGS"/fi_*.log "$OUT/" 2>/dev/null
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
