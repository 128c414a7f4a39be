#!/usr/bin/env bash
# Wave 3, thirty-third session's device calls. Carry .whl.
#
#   PART=probe (~1.5 min, either card): which card this is, then the FP8 checkpoint test on
#            CUDA against the CPU references, ModelOpt's three layouts and FBGEMM's among its
#            kinds (tests/gpu/test_fp8_gpu.py::test_fp8_checkpoint_on_the_gpu_matches_the_cpu_
#            reference), and the activation quantizers bit for bit (the per-token one with
#            FBGEMM's bound among them).
#   PART=h200 (~9 min, on an H200 only): issue 30's served table at the defaults
#            (gpu_session32.sh's PART=base), then FP8 + FP8 KV batch 1 with --enable-pdl
#            (issue 28's 2.3 ms bar).
#   PART=fp8 (~6 min): gpu_session32.sh's PART=fp8 (the served table in FP8).
#   PART=families (~3 min, either card): tests/gpu/test_gpu_models.py's families on CUDA (Phi-3
#            and Granite among them) and tests/gpu/test_gpu_engine.py.
#
# What ran (every call naming the H200 kind came on an H100): gpu_session32.sh's PART=base
#   (the served table at HEAD, bf16 batch 1 both ways), PART=probe twice (ModelOpt's layouts,
#   then with FBGEMM's and the quantizers), and gpu_issue14.sh's offline engine with its
#   device-timed timeline at 5 / 15 / 25 req/s (RUNS=" " OFFLINE=first TIMELINE=1).
#   Then PART=families on an H100 (its -k, since fixed, deselected the engine file, which ran
#   in the next call on the warm machine: 5 + 11 passed).
#   Results: benchmarks/results/*_h100_2026-12-07_s33*. PART=h200 and PART=fp8 did not run
#   (no H200).
#
#   OUT=/some/dir PART=probe bash scripts/gpu_session33.sh
set -u
ISSUE=session33

case "${PART:-probe}" in
probe)
  BUDGET_S=${BUDGET_S:-170}
  . scripts/device_lib.sh
  env_report | head -n 3
  step "FP8 checkpoint tests" 150 "$OUT/gpu_fp8_checkpoint_tests.log" $PY -m pytest -q -m gpu \
    -rA -s -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
    -k "checkpoint_on_the_gpu or dynamic_activation_quant"
  grep -E "passed|failed|layers; logits" "$OUT/gpu_fp8_checkpoint_tests.log" | tail -n 10 \
    >>"$summary"
  finish
  ;;
families)
  # Either card (~3 min): the model families on CUDA (Phi-3 and Granite new) and the engine's
  # GPU file, after the Llama class took Granite's scales and a layer class.
  BUDGET_S=${BUDGET_S:-300}
  . scripts/device_lib.sh
  step "GPU family + engine tests" 280 "$OUT/gpu_families_engine_tests.log" $PY -m pytest -q \
    -m gpu -rA -p no:cacheprovider \
    tests/gpu/test_gpu_models.py::test_new_families_greedy_match_on_cuda tests/gpu/test_gpu_engine.py
  grep -E "passed|failed" "$OUT/gpu_families_engine_tests.log" | tail -n 3 >>"$summary"
  finish
  ;;
h200)
  BUDGET_S=${BUDGET_S:-560}
  OUT="$OUT/base" PART=base BUDGET_S=400 bash scripts/gpu_session32.sh 2>&1 | tail -n 30
  . scripts/device_lib.sh
  WORKLOADS=none offline fp8_fp8kv_b1_pdl 140 --quantization fp8 --kv-cache-dtype fp8 \
    --enable-pdl
  finish
  ;;
fp8)
  OUT=$OUT PART=fp8 bash scripts/gpu_session32.sh
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
