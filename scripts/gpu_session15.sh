#!/usr/bin/env bash
# Wave 3, fifteenth session's H200 plan (no device was lent in session 15: written for the next
# session that has one), each part one device call from the repository root, carrying .whl:
#
#   PART=pdl_tests: programmatic dependent launch (tandem_kernels/pdl.py, `--enable-pdl`),
#            which has never run on a GPU: its GPU tests (the 8B decode chain launched with PDL
#            in a CUDA graph against plain launches, bit for bit, replay after replay; the FP8
#            engine's greedy tokens with PDL on and off), then the kernel files whose launchers
#            changed (W8A16, RMSNorm, rotary, KV write, decode attention).
#   PART=pdl_bench: issue 28's batch 1 (FP8 weights + FP8 KV cache, random llama-3.1-8b)
#            without and with `--enable-pdl` in one call, 512/256 beside it; then the batch-1
#            step breakdown with PDL (the W8A16 GEMV's 2.35 ms of 3.14 in session 8).
#
#   PART=cudnn: the cascade's "cudnn" dense part (torch's cuDNN attention for prefill steps whose
#            requests share one length), never run on a GPU: the cascade GPU tests (its probe,
#            the "equal" scene through it, the other scenes falling back), then the dense probe
#            (`tandem_cudnn` beside SDPA's cuDNN and our kernels), then issue 30's kernel table
#            (prefill at 8 x 1,024 to 1 x 131,072: the engine's path, timed at start-up).
#
#   OUT=/some/dir PART=pdl_tests bash scripts/gpu_session15.sh
set -u
case "${PART:-pdl_tests}" in
pdl_tests)
  ISSUE=session15 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  step "PDL GPU tests" 300 "$OUT/gpu_tests_pdl.log" $PY -m pytest -q -m gpu --timeout=280 \
    -rs --tb=short --durations=8 tests/gpu/test_pdl_gpu.py tests/gpu/test_fp8_w8a16_gpu.py
  step "kernel GPU tests" 240 "$OUT/gpu_tests_pdl_kernels.log" $PY -m pytest -q -m gpu \
    --timeout=230 -rs --tb=short --durations=8 tests/gpu/test_kernels_gpu.py \
    -k "rms or rotary or reshape or decode or paged"
  grep -hE "passed|failed|error" "$OUT"/gpu_tests_pdl*.log | tail -n 4 >>"$summary"
  finish
  ;;
combo)
  # The most wanted of each part in one call, for a session that may get one: the PDL GPU
  # tests, batch 1 without and with --enable-pdl, the MoE grouped-GEMM path's GPU tests and
  # Qwen3-30B-A3B's MoE kernel table (issue 32's 4,096 tokens).
  ISSUE=session15 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  step "PDL GPU tests" 150 "$OUT/gpu_tests_pdl.log" $PY -m pytest -q -m gpu --timeout=140 \
    -rs --tb=short --durations=8 tests/gpu/test_pdl_gpu.py
  WORKLOADS=none offline fp8_fp8kv_b1 120 --quantization fp8 --kv-cache-dtype fp8
  WORKLOADS=none offline fp8_fp8kv_b1_pdl 100 --quantization fp8 --kv-cache-dtype fp8 \
    --enable-pdl
  step "MoE GPU tests" 90 "$OUT/gpu_tests_moe.log" $PY -m pytest -q -m gpu --timeout=80 \
    -rs --tb=short --durations=8 tests/gpu/test_fused_moe_gpu.py -k "grouped_mm"
  step "MoE kernel" 100 "$OUT/moe_kernel.log" $PY -m benchmarks.moe_kernel \
    --shapes qwen3-30b-a3b --tokens 4096 16384 --out "$OUT/moe_kernel.json"
  grep -hE "passed|failed|error" "$OUT"/gpu_tests_*.log | tail -n 4 >>"$summary"
  grep -E "forms|TFLOP" "$OUT/moe_kernel.log" | tail -n 6 >>"$summary"
  finish
  # Over 8 files do not come back: all but the summary in one archive.
  (cd "$OUT" && tar -czf results.tar.gz --exclude=summary.txt --exclude=results.tar.gz ./* \
    && find . -type f ! -name summary.txt ! -name results.tar.gz -delete)
  ;;
pdl_bench)
  ISSUE=session15 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  WORKLOADS=512/256 offline fp8_fp8kv 250 --quantization fp8 --kv-cache-dtype fp8
  WORKLOADS=512/256 offline fp8_fp8kv_pdl 250 --quantization fp8 --kv-cache-dtype fp8 \
    --enable-pdl
  step "batch-1 breakdown, PDL" 60 "$OUT/step_breakdown_b1_pdl.log" $PY -m benchmarks.step_breakdown \
    --model random:llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --enable-pdl \
    --num-prompts 1 --input-len 512 --out "$OUT/step_breakdown_b1_pdl.json"
  finish
  ;;
cudnn)
  ISSUE=session15 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  step "cascade GPU tests" 240 "$OUT/gpu_tests_cascade.log" $PY -m pytest -q -m gpu \
    --timeout=230 -rs --tb=short --durations=8 tests/gpu/test_cascade_attention_gpu.py
  step "dense probe" 150 "$OUT/dense_attention_probe.log" $PY -m benchmarks.dense_attention_probe \
    --out "$OUT/dense_attention_probe.json"
  step "kernel table" 170 "$OUT/attention_kernels.log" $PY -m benchmarks.attention_kernels \
    --out "$OUT/attention_kernels.json"
  grep -hE "passed|failed|tandem_cudnn|CUDNN" "$OUT"/gpu_tests_cascade.log \
    "$OUT"/dense_attention_probe.log | tail -n 12 >>"$summary"
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
