#!/usr/bin/env bash
# Issue 8 on two GPUs of one host (device kind nvidia-h200-x2): the NCCL KV hand-off between the
# GPUs, greedy parity of disaggregated serving across them, and disaggregated (prefill worker on
# GPU 0 + decode worker on GPU 1, NCCL) against two unified workers (one per GPU) under the same
# `tandem bench serve` load.
#
#   OUT=/some/dir bash scripts/gpu_issue8.sh               (from the repository root)
#   MODE=cpu OUT=/tmp/x bash scripts/gpu_issue8.sh         (dry run on a CPU machine: the NCCL
#                                                           code path over gloo, SmolLM2, tiny loads)
#
# Serving model: $SERVE_MODEL, GPU default random:llama-3.1-8b in bf16 (seeded random weights
# built on the GPU, a stand-in id tokenizer written into its folder: bench serve sends token
# ids). Parity model: random:llama-3.2-1b in float32 (tests/gpu/test_two_gpus.py). Both
# processes of a pair see both GPUs (no CUDA_VISIBLE_DEVICES); each worker gets
# `--device cuda:<i>` from `--gpus 0,1`. NCCL_NVLS_ENABLE=0 stays set.
#
# Load (GPU): 64 random prompts of 1,000-3,000 tokens (--input-len 2000 --range-ratio 0.5), 100-300
# output tokens (--output-len 200, same ratio), Poisson at 2, 5 and 10 req/s, same seed for both
# systems. Goodput limits: the unified pair's p99 TTFT and p99 TPOT at 2 req/s, rounded up to two
# significant digits (`benchmarks.serving compare --goodput-auto`; the limits are in the JSON).
#
# A bare machine gets grpcio/protobuf/health/reflection/uvicorn/starlette/... from .whl/ into
# /tmp/site. Every step has a time limit, and the whole run a budget ($BUDGET_S, default 530 s,
# for one 600 s device call): a step gets what is left. A failing step does not stop the next.
# $OUT gets at most 8 files: summary.txt, kv_transfer_nccl.json, serve_disagg.json,
# serve_unified2.json, serve_compare.json, serve_compare.png, logs.tar.gz.
ISSUE=issue8
BUDGET_S=${BUDGET_S:-530}
export NCCL_NVLS_ENABLE=0
# Shared set-up ($OUT, $LOGS, ...; the services' packages on the path), `step`, ...
. scripts/device_lib.sh
env_report

if [ "$MODE" = gpu ]; then
  SERVE_MODEL=${SERVE_MODEL:-random:llama-3.1-8b}
  SERVE_ARGS=(--dtype bfloat16 --num-gpu-blocks 16384 --max-model-len 4096)
  LOAD=(--num-prompts 64 --input-len 2000 --output-len 200 --range-ratio 0.5
    --request-rate 2,5,10 --warmup 4)
  PLACE=(--gpus 0,1)
  # The parity test: prefill cuda:0, decode cuda:1; NCCL and CUDA IPC across the GPUs.
  PARITY_ENV=(TANDEM_TWO_GPU_DEVICES=cuda:0,cuda:1)
  SERVE_LIMIT=175
else
  SERVE_MODEL=${SERVE_MODEL:-default}
  SERVE_ARGS=(--num-gpu-blocks 512 --max-model-len 1024)
  LOAD=(--num-prompts 6 --input-len 100 --output-len 8 --range-ratio 0.5 --request-rate 4,inf
    --warmup 2)
  PLACE=(--device cpu)
  PARITY_ENV=(TANDEM_TWO_GPU_DEVICES=cpu,cpu TANDEM_TWO_GPU_CONNECTORS=nccl
    TANDEM_GPU_IPC_MODEL=default TANDEM_TWO_GPU_VOCAB=49152 TANDEM_TWO_GPU_MAX_PROMPT=120)
  SERVE_LIMIT=170
fi
# Forced, so a pair that cannot speak NCCL fails loudly instead of falling back (on the CPU the
# same connector runs over gloo). The parity test sets its schedulers' --kv-connector itself.
export TANDEM_SCHEDULER_KV_CONNECTOR=nccl
id_tokenizer_step "$SERVE_MODEL"

if [ "$MODE" = gpu ]; then
  # 1. NCCL transfer rate cuda:0 -> cuda:1, llama-3.1-8b shape, 2,048-token prompts, beside
  #    the GPU-to-GPU copy rate.
  step "1 kv transfer nccl" 90 "$LOGS/1_kv_transfer_nccl.log" \
    $PY -m benchmarks.kv_transfer --mode nccl --out "$OUT/kv_transfer_nccl.json"
fi

# 2. Greedy parity: disaggregated across the two GPUs (NCCL, then CUDA IPC between GPUs) vs
#    a unified worker, 20 prompts; each worker's model on its own GPU; aborts free both pools.
#    (--noconftest: tests/gpu/conftest.py skips every gpu test where CUDA is missing.)
step "2 two-GPU parity + aborts" 170 "$LOGS/2_two_gpu_parity.log" \
  env "${PARITY_ENV[@]}" $PY -m pytest -q -s -p no:cacheprovider --noconftest \
  --basetemp="$LOGS/2_parity_tmp" tests/gpu/test_two_gpus.py

# 3-5. Disaggregated (prefill GPU 0, decode GPU 1, NCCL) vs two unified workers (GPU 0, GPU 1),
#      same load and seed.
step "3 serve disaggregated (nccl)" $SERVE_LIMIT "$LOGS/3_serve_disagg.log" \
  $PY -m tandem.cli bench serve --launch --model "$SERVE_MODEL" "${PLACE[@]}" \
  "${SERVE_ARGS[@]}" "${LOAD[@]}" --no-plots --out-dir "$OUT" --name serve_disagg \
  --log-dir "$LOGS/3_services"
grep -h "KV from .* over" "$LOGS"/3_services/scheduler.log 2>/dev/null | tail -n 2 \
  | tee -a "$summary"
step "4 serve 2 unified workers" $SERVE_LIMIT "$LOGS/4_serve_unified2.log" \
  $PY -m tandem.cli bench serve --launch --unified --num-unified-workers 2 --model "$SERVE_MODEL" \
  "${PLACE[@]}" "${SERVE_ARGS[@]}" "${LOAD[@]}" --no-plots --out-dir "$OUT" \
  --name serve_unified2 --log-dir "$LOGS/4_services"
step "5 compare" 30 "$LOGS/5_compare.log" \
  $PY -m benchmarks.serving compare "$OUT/serve_disagg.json" "$OUT/serve_unified2.json" \
  --goodput-auto --out "$OUT/serve_compare.json" $PLOTS
cat "$LOGS/5_compare.log" >>"$summary" 2>/dev/null

finish
