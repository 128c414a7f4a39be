#!/usr/bin/env bash
# Wave 3, seventeenth session's device plan, each part one device call from the repository
# root, carrying .whl (see scripts/device_lib.sh), results under $OUT:
#
#   PART=prefill: issue 30's kernel table after three changes none of which ran on a GPU:
#            `prefill_path` timed in device time (session 16), the cascade without its context
#            launch when no request has a cached prefix (`has_context`), and a path per length
#            class (steps of more than 1,024 rows a request: `is_long_step`, the other class
#            timed on a stand-in batch). Their GPU tests, the MoE GPU tests (session 16's
#            shared helpers), then the kernel table (which path each class took: "path
#            timing" lines). (As run in session 17 it also broke down a one-prompt prefill,
#            which profiled decode steps only: PART=tests breaks down full-budget steps.)
#   PART=served: issue 30's served table at the defaults (bf16, 5 / 15 / 25 req/s), then FP8
#            weights + cache without PDL at 5 and 15 (session 16's FP8 run had PDL on).
#   PART=w8a16: batch 1 in FP8 with the W8A16 tuner's picks printed, 512/256 beside it.
#   PART=tests: the engine-level GPU files, then a full-budget prefill step in bf16 and FP8.
#
#   OUT=/some/dir PART=prefill bash scripts/gpu_session17.sh
set -u
case "${PART:-prefill}" in
prefill)
  ISSUE=session17 BUDGET_S=${BUDGET_S:-565}
  . scripts/device_lib.sh
  step "prefill path + MoE tests" 200 "$OUT/gpu_tests_prefill_path.log" $PY -m pytest -q -m gpu \
    --timeout=180 -rs --tb=short tests/gpu/test_cascade_attention_gpu.py \
    tests/gpu/test_dense_hopper_gpu.py tests/gpu/test_fused_moe_gpu.py \
    -k "device_timing or prefill_path or cudnn or start_up or (moe and (graph or grouped_mm))"
  step "kernel table" 170 "$OUT/attention_kernels.log" $PY -m benchmarks.attention_kernels \
    --out "$OUT/attention_kernels.json"
  grep -hE "passed|failed" "$OUT/gpu_tests_prefill_path.log" | tail -n 2 >>"$summary"
  grep -E "^prefill|^path timing" "$OUT/attention_kernels.log" >>"$summary"
  finish
  ;;
served)
  # bf16 at the three rates (~170 s with its start-up), then FP8 without PDL at two (~130 s).
  mkdir -p "$OUT/bf16" "$OUT/fp8"
  OUT="$OUT/bf16" RUNS=unified OFFLINE=none RATES=5,15,25 BUDGET_S=260 \
    bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| unified|answered|total"
  OUT="$OUT/fp8" RUNS=unified OFFLINE=none RATES=5,15 BUDGET_S=220 \
    ENGINE_EXTRA="--quantization fp8 --kv-cache-dtype fp8" \
    bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| unified|answered|total"
  rm -f "$OUT"/*/issue14.png
  ;;
tests)
  # The engine-level GPU files (the engine now takes the cuDNN dense part when its timing
  # says so, and skips the context launch on fresh prompts), FP8 W8A16, windowed layers; then
  # a full-budget prefill step (8,192 rows of 1,536-token prompts) broken down in bf16 and
  # in FP8 weights + cache (PART=prefill's one-prompt breakdown profiled decode steps only).
  ISSUE=session17 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  files=(test_gpu_engine.py test_gpu_models.py test_attention_backends_gpu.py
    test_long_context_gpu.py test_fp8_w8a16_gpu.py test_sliding_window_gpu.py
    test_hybrid_kv_gpu.py)
  step "GPU engine-level files" 330 "$OUT/gpu_tests_engine.log" $PY -m pytest -q -m gpu \
    --timeout=300 -rs --tb=short --durations=10 "${files[@]/#/tests/gpu/}"
  grep -E "passed|failed|error" "$OUT/gpu_tests_engine.log" | tail -n 2 >>"$summary"
  for flags in "bf16:" "fp8:--quantization fp8 --kv-cache-dtype fp8"; do
    name=${flags%%:*}
    read -r -a extra <<<"${flags#*:}"
    step "prefill step $name" 90 "$OUT/breakdown_$name.log" $PY -m benchmarks.step_breakdown \
      --model random:llama-3.1-8b "${extra[@]}" --num-prompts 32 --input-len 1536 --steps 2 \
      --out "$LOGS/breakdown_$name.json"
    grep -m1 "^prefill" "$OUT/breakdown_$name.log" | sed "s/^/$name /" >>"$summary"
  done
  finish
  ;;
diag)
  # PART=tests' three failures: Gemma 3's windowed layers now reach our first dense kernel
  # at head size 256 (its tiles fixed for that: the two Gemma tests again); the whole-step
  # graph against the eager forward at 2.5% (bar 1%; the eager step now pinned to the graph's
  # all-paged path) and the Hopper kernel at head sizes 64 and 256, which that eager step
  # may have taken. Then the cuDNN part without its LSE: its tests and the kernel table.
  ISSUE=session17 BUDGET_S=${BUDGET_S:-470}
  . scripts/device_lib.sh
  step "hopper head sizes" 80 "$OUT/gpu_tests_diag.log" $PY -m pytest -q -m gpu --timeout=70 \
    -rs --tb=line tests/gpu/test_dense_hopper_gpu.py -k head_sizes
  grep -E "passed|failed" "$OUT/gpu_tests_diag.log" | tail -n 1 | sed "s/^/hopper heads: /" >>"$summary"
  step "gemma" 150 "$OUT/gpu_tests_gemma.log" $PY -m pytest -q -m gpu --timeout=140 -rs \
    --tb=short tests/gpu/test_sliding_window_gpu.py tests/gpu/test_hybrid_kv_gpu.py -k "4b"
  grep -E "passed|failed" "$OUT/gpu_tests_gemma.log" | tail -n 1 | sed "s/^/gemma: /" >>"$summary"
  step "mixed graphs vs eager" 70 "$LOGS/mixed.log" $PY -m pytest -q -m gpu --timeout=60 \
    --tb=line tests/gpu/test_gpu_engine.py -k "mixed_step_graphs"
  grep -hE "assert|passed|failed" "$LOGS/mixed.log" | tail -n 2 | sed "s/^/mixed: /" >>"$summary"
  step "cudnn tests" 60 "$LOGS/gpu_tests_cudnn.log" $PY -m pytest -q -m gpu --timeout=50 \
    --tb=short tests/gpu/test_cascade_attention_gpu.py -k "cudnn or prefill_path"
  grep -E "passed|failed" "$LOGS/gpu_tests_cudnn.log" | tail -n 1 | sed "s/^/cudnn: /" >>"$summary"
  step "kernel table" 60 "$OUT/attention_kernels.log" $PY -m benchmarks.attention_kernels \
    --out "$OUT/attention_kernels.json"
  grep -E "^prefill.*(triton|sdpa) |^path timing" "$OUT/attention_kernels.log" >>"$summary"
  finish
  ;;
w8a16)
  ISSUE=session17 BUDGET_S=${BUDGET_S:-400}
  . scripts/device_lib.sh
  WORKLOADS=512/256 offline fp8_fp8kv 250 --quantization fp8 --kv-cache-dtype fp8
  grep -E "^w8a16" "$OUT/offline_fp8_fp8kv.log" >>"$summary"
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
