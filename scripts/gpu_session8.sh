#!/usr/bin/env bash
# Wave 3, eighth session's H200 runs, each part one device call (from the repository root,
# carrying .whl):
#
#   PART=n:  the FP8 decode tests (the fp16 read against the fp32 reference, every candidate
#            with the register caps), FP8 + FP8 KV offline at all three workloads and batch 1
#            (the capped candidates' first timing: decode tuning's GB/s in the log), then the
#            step breakdown of FP8 + FP8 KV at batch 1 (where the 3.2 ms go);
#   PART=sp: speculation at batch 1 and 32 (p = 0.7 and 0, k = 4), forced record, then the
#            verify step's host and device cost against a plain decode step (spec_host_cost).
#
#   PART=moe: the fused MoE decode path (tandem_kernels/fused_moe.py): its GPU tests and the MoE
#            families' engine tests, the kernel benchmark eager and from a CUDA graph
#            (benchmarks/moe_kernel.py), then the Qwen3-30B-A3B and Mixtral-8x7B shapes offline
#            in bf16 at 1000/1000 and batch 1 (issue 32's benchmark; Mixtral at 512 requests).
#
#   PART=f:  the last call: the Hopper dense kernel's GPU tests and the dense-attention probe
#            (scripts/gpu_dense8.sh PART=t's first half; if its tests fail, the rest runs with
#            the cascade forced on our first dense kernel), speculation forced at batch 1 and 32
#            after the rule learned the backoff, then Qwen3-30B-A3B offline at 1000/1000 (512
#            requests).
#
#   OUT=/some/dir PART=n bash scripts/gpu_session8.sh
set -u
case "${PART:-n}" in
n)
  ISSUE=session8 BUDGET_S=${BUDGET_S:-480}
  . scripts/device_lib.sh
  step "fp8 decode GPU tests" 90 "$OUT/gpu_tests_fp8_decode.log" $PY -m pytest -q -m gpu \
    --timeout=85 tests/gpu/test_fp8_gpu.py::test_attention_over_fp8_cache_at_real_sizes \
    tests/gpu/test_fp8_gpu.py::test_fp8_decode_reads_the_cache_exactly_and_survives_large_queries \
    "tests/gpu/test_kernels_gpu.py::test_decode_every_tuning_candidate_and_the_tuned_config"
  # shellcheck disable=SC2086
  offline fp8_fp8kv 220 --quantization fp8 --kv-cache-dtype fp8
  step "step breakdown fp8+fp8kv batch 1" 90 "$OUT/breakdown_b1.log" \
    $PY -m benchmarks.step_breakdown --model random:llama-3.1-8b --device cuda \
    --quantization fp8 --kv-cache-dtype fp8 --num-prompts 1 --input-len 512 --steps 64 \
    --out "$OUT/breakdown_b1.json"
  finish
  ;;
moe)
  ISSUE=session8 BUDGET_S=${BUDGET_S:-470}
  . scripts/device_lib.sh
  step "MoE GPU tests" 150 "$OUT/gpu_tests_moe.log" $PY -m pytest -q -m gpu -x --timeout=140 \
    tests/gpu/test_fused_moe_gpu.py tests/gpu/test_gpu_models.py -k "moe or mixtral or fused"
  step "MoE kernel" 100 "$OUT/moe_kernel.log" $PY -m benchmarks.moe_kernel \
    --tokens 1 2 4 8 16 64 512 4096 --out "$OUT/moe_kernel.json"
  for model in qwen3-30b-a3b mixtral-8x7b; do
    n=1024
    [ $model = mixtral-8x7b ] && n=512
    step "offline $model" 130 "$OUT/offline_$model.log" $PY -m benchmarks.offline_throughput \
      --model random:$model --device cuda --skip-peer --workloads 1000/1000 --max-requests $n \
      --out "$OUT/offline_$model.json"
    grep -E "tok/s|TPOT" "$OUT/offline_$model.log" | tail -n 3 >>"$summary"
  done
  finish
  ;;
f)
  ISSUE=session8 BUDGET_S=${BUDGET_S:-575}
  . scripts/device_lib.sh
  step "hopper dense GPU tests" 150 "$OUT/gpu_tests_dense_hopper.log" $PY -m pytest -q -m gpu \
    --timeout=140 -rs tests/gpu/test_dense_hopper_gpu.py
  if ! grep -q " passed" "$OUT/gpu_tests_dense_hopper.log" \
    || grep -qE "[0-9]+ (failed|error)" "$OUT/gpu_tests_dense_hopper.log"; then
    echo "hopper dense tests not clean: the rest with TANDEM_PREFILL_DENSE=triton" | tee -a "$summary"
    export TANDEM_PREFILL_CASCADE=1 TANDEM_PREFILL_DENSE=triton
  fi
  step "dense attention probe" 150 "$OUT/dense_probe.log" $PY -m benchmarks.dense_attention_probe \
    --out "$OUT/dense_attention_probe.json"
  step "speculative forced" 100 "$OUT/speculative_forced.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 1,32 --ks 4 --acceptances 0.7,0 --rules measured \
    --force-record --out "$OUT/speculative_forced.json"
  step "offline qwen3-30b-a3b" 170 "$OUT/offline_qwen3-30b-a3b.log" \
    $PY -m benchmarks.offline_throughput --model random:qwen3-30b-a3b --device cuda --skip-peer \
    --workloads 1000/1000 --max-requests 512 --out "$OUT/offline_qwen3-30b-a3b.json"
  grep -E "tok/s|TPOT" "$OUT/offline_qwen3-30b-a3b.log" | tail -n 3 >>"$summary"
  finish
  ;;
sp)
  ISSUE=session8 BUDGET_S=${BUDGET_S:-470}
  . scripts/device_lib.sh
  step "speculative forced" 300 "$OUT/speculative_forced.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 1,32 --ks 4 --acceptances 0.7,0 --rules measured \
    --force-record --out "$OUT/speculative_forced.json"
  step "spec host cost" 150 "$OUT/spec_host_cost.log" $PY -m benchmarks.spec_host_cost \
    --device cuda --model random:llama-3.1-8b --batch-sizes 1,8 --k 4 --input-len 64 \
    --output-len 64 --max-model-len 4096 --out "$OUT/spec_host_cost.json"
  finish
  ;;
esac
