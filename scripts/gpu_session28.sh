#!/usr/bin/env bash
# Wave 3, twenty-eighth session's device calls.
#
#   PART=flashinfer (~6-9 min, either card): the FLASHINFER backend's first run on a GPU.
#            flashinfer-python 0.7.4's wheel is 101 MB (715 MB unpacked) and needs
#            nvidia-cutlass-dsl, cuda-tile, nccl4py: over a call's 64 MiB. 0.5.3's wheel is
#            7 MB (its csrc, cutlass and include trees inside), imports with none of its
#            optional dependencies (checked on the CPU: tvm-ffi, nvidia-ml-py, einops,
#            tabulate, all on the device image or in .whl/) and compiles its kernels at first
#            use with the image's nvcc. Carried as .fi/ (outside git):
#              mkdir -p .fi && pip download flashinfer-python==0.5.3 --no-deps -d .fi
#            Its compiled kernels go to .ficache/ in the checkout (FLASHINFER_WORKSPACE_BASE),
#            which a warm machine keeps between calls. Order: the kernel tests (bf16 and fp16, the
#            8B's head 128), the engine test (random llama-3.2-1b, head 64), issue 30's kernel
#            table with triton / flashinfer / flashinfer_tc / sdpa.
#            What ran (one H100, two calls on one warm machine; 488 s of device time with the
#            start): this part, whose kernel-test selection then matched only the refusal test
#            (the dtype ids are dtype0/dtype1) and whose engine test found a bug
#            (FlashInferAttentionBackend.write_kv lacked the scales the piecewise graphs pass);
#            then, after the fix, the kernel tests and the engine test alone. Then PART=ab
#            (gpu_session27.sh, BUDGET_S=520). Results: benchmarks/results/*_h100_2026-12-06_s28*.
#
#   PART=h200 (~9.5 min, an H200 only: issue 30's vLLM figures are H200 figures): issue 30's
#            served table at the defaults (gpu_session27.sh's table30), then the same load with
#            --quantization fp8 --kv-cache-dtype fp8 (gpu_session22.sh's fp8served), one call.
#
#   PART=table30 / PART=ab: scripts/gpu_session27.sh's (served, at the defaults / against
#            session 23's tree).
#
# Next session, on an H200: PART=h200 (carry .whl). On an H100: FlashInfer's tensor-core decode
# (8.5% faster than the backend's CUDA-core form at 64 x 32k here) as the backend's form, with
# the engine test and this part's kernel table again (carry .whl and .fi).
#
#   OUT=/some/dir PART=flashinfer bash scripts/gpu_session28.sh
set -u
ISSUE=session28

case "${PART:-flashinfer}" in
flashinfer)
  BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  $PY -m pip install -q --no-deps --target /tmp/site-fi .fi/*.whl >"$LOGS/pip_fi.log" 2>&1 \
    || echo "pip install of .fi/ failed (pip_fi.log)" | tee -a "$summary"
  export PYTHONPATH="/tmp/site-fi:$PYTHONPATH"
  export FLASHINFER_WORKSPACE_BASE=$PWD/.ficache MAX_JOBS=16
  mkdir -p .ficache
  {
    nvidia-smi -L
    nvcc --version | tail -2
    $PY -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)"
  } 2>&1 | tee -a "$summary"
  T=tests/gpu/test_attention_backends_gpu.py
  step fi_tests 300 "$LOGS/fi_tests.log" \
    $PY -m pytest -q -rA -s -p no:cacheprovider "$T" -k "FLASHINFER and not engine" --durations=5
  step fi_engine 240 "$LOGS/fi_engine.log" \
    $PY -m pytest -q -rA -s -p no:cacheprovider "$T" -k "engine and FLASHINFER" --durations=3
  step fi_kernels 200 "$LOGS/fi_kernels.log" \
    $PY -m benchmarks.attention_kernels --backends triton,flashinfer,flashinfer_tc,sdpa \
    --out "$OUT/attention_kernels_flashinfer.json"
  du -sh .ficache 2>&1 | tee -a "$summary"
  finish
  ;;
h200)
  mkdir -p "$OUT/t30" "$OUT/fp8"
  OUT="$OUT/t30" PART=table30 BUDGET_S=300 bash scripts/gpu_session27.sh
  OUT="$OUT/fp8" PART=fp8served BUDGET_S=270 bash scripts/gpu_session22.sh
  ;;
table30 | ab)
  exec bash scripts/gpu_session27.sh
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
