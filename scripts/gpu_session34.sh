#!/usr/bin/env bash
# Wave 3, thirty-fourth session's device calls. Carry .whl.
#
#   PART=auto (~9 min): on an H200, PART=h200; on any other card, PART=h100.
#   PART=h200 (~9 min, on an H200 only): issue 30's served table at the defaults
#            (gpu_session32.sh's PART=base: the four rates, bf16 batch 1 both ways), then FP8 +
#            FP8 KV batch 1 with --enable-pdl (issue 28's 2.3 ms bar).
#   PART=h100 (~9 min, either card): the GPU tests of this session's model changes (as
#            PART=profile's), then issue 30's served table at HEAD (the serving changes of
#            session 33 were not measured on any card).
#   PART=tests (~4 min, either card): only those GPU tests.
#   PART=profile (~7 min, either card): the GPU tests of this session's model changes (Phi-3.5
#            LongRoPE, Phi-4-mini partial rotary, the families, the engine file); then where
#            the decode step of issue 30's load goes, by kernel: bf16, 8 requests of 1,500
#            prompt tokens (the 5 req/s regime's batch and context); then FP8 + FP8 KV batch 1.
#   PART=fp8 (~6 min): gpu_session32.sh's PART=fp8 (the served table in FP8).
#
# What ran: eighteen calls got no machine; the nineteenth (naming the H200 kind) came on an
#   H100 and ran PART=tests (19 passed); then, on the warm machine, gpu_issue14.sh's unified
#   server at 5 and 15 req/s (RUNS=unified OFFLINE=none RATES=5,15 BUDGET_S=250).
#   Results: benchmarks/results/*_h100_2026-12-07_s34*.
#
#   OUT=/some/dir PART=auto bash scripts/gpu_session34.sh
set -u
ISSUE=session34
part=${PART:-auto}
if [ "$part" = auto ]; then
  if nvidia-smi -L 2>/dev/null | grep -q H200; then part=h200; else part=h100; fi
  echo "PART=auto -> $part ($(nvidia-smi -L 2>/dev/null | head -n 1))"
fi

breakdown() {  # breakdown NAME N LEN [engine flags...]: the decode step by kernel
  local name=$1 n=$2 len=$3
  shift 3
  step "breakdown $name" 100 "$OUT/breakdown_$name.log" $PY -m benchmarks.step_breakdown \
    --model random:llama-3.1-8b --device cuda --num-prompts "$n" --input-len "$len" \
    --steps 20 --out "$OUT/breakdown_$name.json" "$@"
  grep -A 18 "^decode:" "$OUT/breakdown_$name.log" | sed "s/^/$name /" >>"$summary"
}

gpu_tests() {  # the GPU tests of this session's model changes and the engine file
  step "GPU model + engine tests" "$1" "$OUT/gpu_models_engine_tests.log" $PY -m pytest -q \
    -m gpu -rA -p no:cacheprovider tests/gpu/test_gpu_engine.py \
    tests/gpu/test_gpu_models.py -k "new_families or longrope or test_gpu_engine"
  grep -E "passed|failed" "$OUT/gpu_models_engine_tests.log" | tail -n 3 >>"$summary"
}

served() {  # served SUBDIR RATES BUDGET_S: gpu_issue14.sh's unified server at the defaults
  mkdir -p "$OUT/$1"
  env OUT="$OUT/$1" RUNS=unified OFFLINE=none RATES="$2" BUDGET_S="$3" ENGINE_EXTRA="" \
    bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| (unified|vLLM)|answered" | tee -a "$summary"
  rm -f "$OUT/$1"/*.png
}

case "$part" in
tests)
  # Either card (~4 min): only the GPU tests of this session's model changes.
  BUDGET_S=${BUDGET_S:-240}
  . scripts/device_lib.sh
  env_report | head -n 3
  gpu_tests 220
  finish
  ;;
h100)
  BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  env_report | head -n 3
  gpu_tests 200
  served t30 5,15,25,inf 300
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
profile)
  BUDGET_S=${BUDGET_S:-330}
  . scripts/device_lib.sh
  env_report | head -n 3
  gpu_tests 200
  breakdown bf16_8x1500 8 1500
  breakdown fp8_fp8kv_1x128 1 128 --quantization fp8 --kv-cache-dtype fp8
  finish
  ;;
fp8)
  OUT=$OUT PART=fp8 bash scripts/gpu_session32.sh
  ;;
*)
  echo "unknown PART=${part}" >&2
  exit 2
  ;;
esac
