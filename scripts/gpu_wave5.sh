#!/usr/bin/env bash
# This session's H200 runs, each part one device call (from the repository root):
#
#   PART=a: speculative decoding on the 8B shape (the replay sweep: batch 1/8/32/128, k 2/4,
#           p 1/0.7/0.4/0; then the 1B draft, the 8B drafting for itself and the EAGLE head at
#           batch 1/8/32, k 4) and the fused MoE kernel's table; carries .smol/a (first half
#           of the embedded model's GGUF) to /tmp/smol;
#   PART=b: joins .smol/b onto it (the GGUF is over one call's 64 MiB), n-gram speculation on
#           the embedded model, then the whole GPU suite (tests/gpu) as one run;
#   PART=d: the new kernels (cascade prefill, split-K W8A16) and FP8 batch 1; PART=e: the
#           speculation rule's sweep and the GPU tests PART=b did not reach;
#   PART=c: FLAGS / WORKLOADS offline runs (see device_lib.sh: offline).
#
#   OUT=/some/dir PART=a bash scripts/gpu_wave5.sh
ISSUE=wave5
BUDGET_S=${BUDGET_S:-565}
. scripts/device_lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SPEC=($PY -m benchmarks.speculative --device cuda --model random:llama-3.1-8b --input-len 64
  --output-len 64 --max-model-len 4096)

case "${PART:-a}" in
a)
  keep_smollm2_half
  env_report
  step "spec replay" 260 "$OUT/spec_replay.log" "${SPEC[@]}" --batch-sizes 1,8,32,128 --ks 2,4 \
    --acceptances 1,0.7,0.4,0 --out "$OUT/spec_replay.json"
  tail -n 40 "$OUT/spec_replay.log" >>"$summary"
  step "spec models" 170 "$OUT/spec_models.log" "${SPEC[@]}" --batch-sizes 1,8,32 --ks 4 \
    --acceptances '' --draft-models random:llama-3.2-1b,self --eagle random:eagle-llama-3.1-8b \
    --out "$OUT/spec_models.json"
  tail -n 25 "$OUT/spec_models.log" >>"$summary"
  step "moe kernel" 90 "$OUT/moe_kernel.log" $PY -m benchmarks.moe_kernel \
    --tokens 1 8 64 512 4096 16384 --out "$OUT/moe_kernel.json"
  tail -n 30 "$OUT/moe_kernel.log" >>"$summary"
  ;;
b)
  ls .whl2/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-deps --upgrade --target /tmp/site \
    .whl2/*.whl >>"$LOGS/pip.log" 2>&1
  join_smollm2
  step "spec ngram" 70 "$OUT/spec_ngram.log" $PY -m benchmarks.speculative --device cuda \
    --batch-sizes 1,8,32 --ks 2,4 --acceptances '' --ngram --out "$OUT/spec_ngram.json"
  tail -n 15 "$OUT/spec_ngram.log" >>"$summary"
  step "gpu tests" "${TESTS_LIMIT_S:-480}" "$OUT/gpu_tests.log" $PY -m pytest -q -s -m gpu \
    ${GPU_TESTS:-tests/gpu} -p no:cacheprovider --durations=25
  grep -E "passed|failed|error|prompts identical|logprob gap" "$OUT/gpu_tests.log" | tail -n 40 >>"$summary"
  ;;
d)
  # the new kernels: the cascade prefill's table and tests, the split-K W8A16 GEMV's tests and
  # table, batch-1 TPOT in FP8; carries .smol/a to /tmp/smol for PART=e
  keep_smollm2_half
  step "prefill attention" 130 "$OUT/prefill_attention.log" $PY -m benchmarks.prefill_attention \
    --out "$OUT/prefill_attention.json"
  grep -E "SDPA|cascade|old" "$OUT/prefill_attention.log" | tail -n 30 >>"$summary"
  step "fp8 w8a16" 100 "$OUT/fp8_w8a16.log" $PY -m benchmarks.fp8_w8a16 --out "$OUT/fp8_w8a16.json"
  tail -n 40 "$OUT/fp8_w8a16.log" >>"$summary"
  WORKLOADS=b1only offline fp8_b1 80 --quantization fp8
  step "kernel tests" 110 "$OUT/kernel_tests.log" $PY -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_cascade_attention_gpu.py tests/gpu/test_fp8_w8a16_gpu.py --tb=short
  tail -n 25 "$OUT/kernel_tests.log" >>"$summary"
  step "spec forced" 150 "$OUT/spec_forced.log" "${SPEC[@]}" --batch-sizes 1,8,32,128 --ks 4 \
    --acceptances 1,0.7,0 --rules measured --force-record --out "$OUT/spec_forced.json"
  tail -n 20 "$OUT/spec_forced.log" >>"$summary"
  ;;
e)
  # joins .smol/b onto PART=d's half; the speculation rule's sweep, then the GPU tests the
  # PART=b run did not reach, and the FP8-against-bf16 tests with their tracebacks
  join_smollm2
  step "spec forced" 170 "$OUT/spec_forced.log" "${SPEC[@]}" --batch-sizes 1,8,32,128 --ks 4 \
    --acceptances 1,0.7,0 --rules measured --force-record --out "$OUT/spec_forced.json"
  tail -n 20 "$OUT/spec_forced.log" >>"$summary"
  step "spec rule" 110 "$OUT/spec_rule.log" "${SPEC[@]}" --batch-sizes 1,32,128 --ks 4 \
    --acceptances 1,0 --rules measured --out "$OUT/spec_rule.json"
  tail -n 20 "$OUT/spec_rule.log" >>"$summary"
  step "gpu tests e" 150 "$OUT/gpu_tests_e.log" $PY -m pytest -q -s -m gpu -p no:cacheprovider \
    --tb=short tests/gpu/test_fp8_gpu.py::test_fp8_weights_against_bf16_self tests/gpu/test_spec_decode_gpu.py \
    tests/gpu/test_spec_decode_rule_gpu.py tests/gpu/test_hybrid_kv_gpu.py \
    tests/gpu/test_disagg_gemma3_gpu.py
  grep -E "passed|failed|Error|assert|identical|gap" "$OUT/gpu_tests_e.log" | tail -n 40 >>"$summary"
  ;;
c)
  offline "${NAME:-fp8}" "${OFFLINE_LIMIT_S:-520}" ${FLAGS:---quantization fp8}
  ;;
esac
finish
