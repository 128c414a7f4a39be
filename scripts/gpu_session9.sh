#!/usr/bin/env bash
# Wave 3, ninth session's H200 runs, each part one device call (from the repository root), two
# back to back on one warm machine so that SmolLM2 travels in halves (scripts/device_lib.sh):
#
#   PART=a (carry .whl, .smol/a): issue 29's replay table after the rule learned the backoff:
#            k = 2 and 4, batch 1 / 8 / 32 / 128, p = 1 / 0.7 / 0.4 / 0, forced record, 256
#            tokens out; then the proposers that run a model (the 1B drafting for the 8B, the
#            8B for itself, the EAGLE head of its shape) at batch 1 / 8 / 32, k = 4.
#   PART=b (carry .whl, .smol/b): the speculation and logits-processor GPU tests (SmolLM2
#            joined from the halves: its draft-model test, n-gram with CUDA graphs), the MoE
#            families' engine tests, then FP8 weights alone and the FP8 KV cache alone offline.
#
#   PART=c: the MoE families' engine tests again (-x off, short tracebacks: part b's run was
#            cut after its first failure), speculation at p = 0 with five interleaved pairs
#            per row (batch 32 and 128, k = 4 and 2).
#
#   PART=d: the EAGLE head's draft steps as CUDA graphs (its GPU tests, its cost per step at
#            batch 1 / 8 / 32), the tiny MoE layers untuned (their tests' time).
#
#   OUT=/some/dir PART=a bash scripts/gpu_session9.sh
set -u
case "${PART:-a}" in
a)
  ISSUE=session9 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  keep_smollm2_half
  for k in 4 2; do
    step "speculative forced table k=$k" 190 "$OUT/speculative_forced_k$k.log" \
      $PY -m benchmarks.speculative --device cuda --model random:llama-3.1-8b --input-len 64 \
      --output-len 256 --max-model-len 4096 --batch-sizes 1,8,32,128 --ks $k \
      --acceptances 1,0.7,0.4,0 --rules measured --force-record \
      --out "$OUT/speculative_forced_k$k.json"
  done
  step "speculative model proposers" 180 "$OUT/speculative_models.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 1,8,32 --ks 4 --acceptances '' \
    --draft-models random:llama-3.2-1b,self --eagle random:eagle-llama-3.1-8b \
    --out "$OUT/speculative_models.json"
  finish
  ;;
b)
  ISSUE=session9 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  join_smollm2
  step "speculation + processors GPU tests" 240 "$OUT/gpu_tests_spec.log" $PY -m pytest -q -m gpu \
    --timeout=200 -rs tests/gpu/test_spec_decode_gpu.py tests/gpu/test_spec_model_proposers_gpu.py \
    tests/gpu/test_spec_decode_rule_gpu.py tests/gpu/test_logits_processors_gpu.py
  step "MoE engine GPU tests" 150 "$OUT/gpu_tests_moe_models.log" $PY -m pytest -q -m gpu \
    --timeout=140 -rs tests/gpu/test_gpu_models.py -k "moe or mixtral"
  WORKLOADS=128/128,512/256 offline fp8_weights 170 --quantization fp8
  finish
  ;;
c)
  ISSUE=session9 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  step "MoE engine GPU tests" 220 "$OUT/gpu_tests_moe_models.log" $PY -m pytest -q -m gpu \
    --timeout=200 -rs --tb=short tests/gpu/test_gpu_models.py -k "moe or mixtral"
  step "MoE tiny engine test, kernels untuned" 90 "$OUT/gpu_tests_moe_untuned.log" \
    env TANDEM_TUNE_KERNELS=0 $PY -m pytest -q -m gpu --timeout=80 -rs --tb=short \
    "tests/gpu/test_gpu_models.py::test_new_families_greedy_match_on_cuda[qwen3_moe]"
  step "speculative p=0 repeats" 200 "$OUT/speculative_p0.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 32,128 --ks 4,2 --acceptances 0 --rules measured \
    --force-record --repeats 5 --out "$OUT/speculative_p0.json"
  finish
  ;;
d)
  ISSUE=session9 BUDGET_S=${BUDGET_S:-470}
  . scripts/device_lib.sh
  step "EAGLE graphs + tiny MoE GPU tests" 200 "$OUT/gpu_tests_eagle_moe.log" $PY -m pytest -q \
    -m gpu --timeout=150 -rs --tb=short --durations=8 \
    -k "eagle or random_8b or tiny_layers or new_families" tests/gpu/test_spec_model_proposers_gpu.py \
    tests/gpu/test_fused_moe_gpu.py::test_tiny_layers_take_the_default_rule_untuned \
    "tests/gpu/test_gpu_models.py::test_new_families_greedy_match_on_cuda"
  step "speculative EAGLE" 150 "$OUT/speculative_eagle.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 1,8,32 --ks 4 --acceptances '' \
    --eagle random:eagle-llama-3.1-8b --out "$OUT/speculative_eagle.json"
  finish
  ;;
esac
