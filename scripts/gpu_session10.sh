#!/usr/bin/env bash
# Wave 3, tenth session's H200 runs, each part one device call (from the repository root):
#
#   PART=a (carry .smol/a only: the 64 MiB): where speculation that has stopped drafting
#            loses its ~3% at batch 128 (scripts/spec_p0_profile.py: interleaved timings, a
#            profiler trace of each engine); issue 29's p = 0 point at batch 128, k = 4,
#            five interleaved pairs, after the rule's host cost came down.
#   PART=b (carry .whl, .smol/b): the speculation GPU tests, the model proposers' after their
#            graph code moved (tandem/spec_decode/proposer_graphs.py); the FP8 KV cache alone
#            offline with batch 1.
#   PART=c: issue 29's p = 0 rows, five interleaved pairs (batch 32 and 128, k = 4 and 2).
#   PART=d (carry .smol/a only): p = 0.7 at batch 1 and 32, k = 4, three pairs, after the
#            rule's timing change (the two targets it must keep).
#   PART=e (carry .whl, .smol/b; right after d): n-gram on SmolLM2 (copy prompts, k = 2 and
#            4, five pairs, 256 tokens at most).
#
#   OUT=/some/dir PART=a bash scripts/gpu_session10.sh
set -u
case "${PART:-a}" in
a)
  ISSUE=session10 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  keep_smollm2_half
  step "spec p=0 profile B=128 k=4" 260 "$OUT/spec_p0_profile.log" $PY scripts/spec_p0_profile.py \
    --batch 128 --k 4 --out "$OUT/profile"
  step "speculative p=0 B=128 k=4 repeats" 200 "$OUT/speculative_p0_b128.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 128 --ks 4 --acceptances 0 --rules measured \
    --force-record --repeats 5 --out "$OUT/speculative_p0_b128.json"
  finish
  ;;
b)
  ISSUE=session10 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  join_smollm2
  step "speculation GPU tests" 240 "$OUT/gpu_tests_spec.log" $PY -m pytest -q -m gpu \
    --timeout=200 -rs --tb=short --durations=6 tests/gpu/test_spec_decode_gpu.py \
    tests/gpu/test_spec_model_proposers_gpu.py \
    tests/gpu/test_spec_decode_rule_gpu.py tests/gpu/test_logits_processors_gpu.py
  WORKLOADS=128/128,512/256 offline fp8_kv 200 --kv-cache-dtype fp8
  finish
  ;;
c)
  ISSUE=session10 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  step "speculative p=0 repeats" 400 "$OUT/speculative_p0.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 32,128 --ks 4,2 --acceptances 0 --rules measured \
    --force-record --repeats 5 --out "$OUT/speculative_p0.json"
  finish
  ;;
d)
  ISSUE=session10 BUDGET_S=${BUDGET_S:-300}
  . scripts/device_lib.sh
  keep_smollm2_half
  step "speculative p=0.7 B=1,32 repeats" 280 "$OUT/speculative_p07.log" $PY -m benchmarks.speculative \
    --device cuda --model random:llama-3.1-8b --input-len 64 --output-len 256 \
    --max-model-len 4096 --batch-sizes 1,32 --ks 4 --acceptances 0.7 --rules measured \
    --force-record --repeats 3 --out "$OUT/speculative_p07.json"
  finish
  ;;
e)
  ISSUE=session10 BUDGET_S=${BUDGET_S:-240}
  . scripts/device_lib.sh
  join_smollm2
  step "n-gram on SmolLM2" 220 "$OUT/speculative_ngram.log" $PY -m benchmarks.speculative \
    --device cuda --ks 2,4 --acceptances '' --ngram --output-len 256 --repeats 5 \
    --out "$OUT/speculative_ngram.json"
  finish
  ;;
esac
