#!/usr/bin/env bash
# Issue 30's benchmarks on one H200 (device kind nvidia-h200), one device call, within
# $BUDGET_S (540 s) in all, each step time-limited:
#
#   1. the kernel table (benchmarks/attention_kernels.py, ~2-3 min): prefill 8 x 1,024,
#      4 x 4,096, 1 x 32,768, 1 x 131,072 causal and decode 64 x 32,768 on the 8B attention
#      shape; tandem's Triton kernels (tuned), FlashInfer / FlashAttention where they import
#      (else "not run: ... needs the flashinfer-python package"), SDPA on dense K/V.
#      -> $OUT/attention_kernels.{json,log}
#   2. long-context serving (benchmarks/serving.py long-context, ~4 min with the start-up):
#      `tandem serve` unified on the random-weight llama-3.1-8b, bf16, max_model_len 32,832,
#      120 requests at $RATES req/s (default 4, Poisson), twice: short chats only (500-1,500
#      tokens in, 100-300 out), then the same arrivals with 10% long prompts (8k-32k tokens,
#      32-96 out). -> $OUT/serving_long_context.{json,log}
#
#   OUT=/some/dir bash scripts/gpu_issue30.sh           (from the repository root)
#   ENGINE_EXTRA="--long-prefill-token-threshold 2048" ...   (engine flags for the serving step)
#   SKIP_KERNELS=1 ...                                  (the serving step alone)
#   MODE=cpu OUT=/tmp/x bash scripts/gpu_issue30.sh     (dry run: Triton's interpreter at tiny
#                                                       shapes; SmolLM2 on the CPU, tiny loads)
#
# What it prints (and keeps in $OUT/summary.txt): the environment; then per step
# "NAME: rc=0 (Ns of LIMIT) -> LOG" and the log's tail. The kernel table's lines read
#   held ceilings: bf16 matmul ~T TFLOP/s, copy ~B GB/s (burst ...)
#   prefill 1 x 32768      triton       12.345 ms   356.1 TFLOP/s (52.3% of matmul)  max|err| 0.0039 ok
#   decode 64 x 32768      triton        1.234 ms    ...  3,480 GB/s KV (82.0% of copy)  max|err| ...
# one per shape and backend ("not run: <why>" for a missing package, "MISMATCH" where a result
# is off the fp32 reference; the step's rc is then 1), and "wall N s; mismatches: none". The
# serving step prints one row per rate and load:
#     rate load              ok   TTFT short p50/p99    TTFT long p50/p99   TPOT short p50/p99
#        4 short-only   120/120           ...                           -            ...
#        4 mixed        120/120           ...                 ...                    ...
# (ms). The issue's question: how far the short streams' TPOT p99 and TTFT rise from
# short-only to mixed, and the long prompts' TTFT.
ISSUE=issue30
BUDGET_S=${BUDGET_S:-540}
. scripts/device_lib.sh
env_report

RATES=${RATES:-4}
if [ "$MODE" = gpu ]; then
  KERNELS=()
  KERNEL_ENV=()
  MODEL=${SERVE_MODEL:-random:llama-3.1-8b}
  ENGINE=(--dtype bfloat16 --max-model-len 32832)
  LOAD=(--num-prompts 120 --random-input-len 1000 --random-range-ratio 0.5
    --random-output-len 200 --long-input-len 20000 --long-range-ratio 0.6
    --long-output-len 64 --long-fraction 0.1)
else
  KERNELS=(--device cpu --dtype float16 --prefill 2x64,1x160 --decode 3x200 --check-rows 16)
  KERNEL_ENV=(TRITON_INTERPRET=1)
  MODEL=${SERVE_MODEL:-default}
  ENGINE=(--device cpu --max-model-len 512 --max-num-batched-tokens 128)
  LOAD=(--num-prompts 10 --random-input-len 16 --random-output-len 6 --long-input-len 300
    --long-range-ratio 0.3 --long-output-len 4 --long-fraction 0.2)
fi

if [ -z "${SKIP_KERNELS:-}" ]; then  # SKIP_KERNELS=1: the serving step alone
  step "attention kernels" 200 "$OUT/attention_kernels.log" env "${KERNEL_ENV[@]}" \
    $PY -m benchmarks.attention_kernels "${KERNELS[@]}" --out "$OUT/attention_kernels.json"
  grep -E "ceilings|TFLOP/s|not run|failed|mismatches" "$OUT/attention_kernels.log" >>"$summary"
fi

id_tokenizer_step "$MODEL"
step "long-context serving" 330 "$OUT/serving_long_context.log" \
  $PY -m benchmarks.serving long-context --launch --unified --model "$MODEL" "${ENGINE[@]}" \
  ${ENGINE_EXTRA:-} "${LOAD[@]}" --request-rate "$RATES" --no-plots --out-dir "$OUT" \
  --name serving_long_context --log-dir "$LOGS/long_context_services"
grep -E "rate|short-only|mixed" "$OUT/serving_long_context.log" >>"$summary"
finish
