#!/usr/bin/env bash
# Issue 6 on one GPU: the block-copy kernel, the CUDA IPC KV connector (tests, transfer rate),
# and disaggregated (prefill + decode worker, two processes, CUDA IPC) against unified serving
# under the same load (`tandem bench serve`).
#
#   OUT=/some/dir bash scripts/gpu_issue6.sh               (from the repository root)
#   MODE=cpu OUT=/tmp/x bash scripts/gpu_issue6.sh         (dry run on a CPU machine: TCP
#                                                           connector, SmolLM2, tiny loads)
#
# A bare machine gets grpcio/protobuf/health/reflection/uvicorn/starlette/... from .whl/ into
# /tmp/site. Serving model:
# $SERVE_MODEL (GPU default random:llama-3.2-1b in bf16; a stand-in id tokenizer is written into
# its folder, since bench serve sends token ids). Every step has a time limit, and the whole run
# a budget ($BUDGET_S, default 450 s): a step gets what is left. A failing step does not stop
# the next. $OUT gets at most 8 files: summary.txt, kv_transfer_cuda.json, serve_disagg.json,
# serve_unified.json, serve_compare.json, serve_compare.png, kv_transfer_cpu.json, logs.tar.gz.
ISSUE=issue6
# Shared set-up ($OUT, $LOGS, ...; the services' packages on the path), `step`, ...
. scripts/device_lib.sh
env_report

if [ "$MODE" = gpu ]; then
  DEVICE=cuda
  SERVE_MODEL=${SERVE_MODEL:-random:llama-3.2-1b}
  SERVE_ARGS=(--dtype bfloat16 --num-gpu-blocks 8192 --max-model-len 2048)
  LOAD=(--num-prompts 64 --input-len 1000 --output-len 128 --request-rate 4,16,inf
    --range-ratio 0.1 --warmup 4)
  export TANDEM_SCHEDULER_KV_CONNECTOR=cuda-ipc  # fail loudly rather than fall back to TCP
  SERVE_LIMIT=170
else
  DEVICE=cpu
  SERVE_MODEL=${SERVE_MODEL:-default}
  SERVE_ARGS=(--num-gpu-blocks 512 --max-model-len 1024)
  LOAD=(--num-prompts 6 --input-len 100 --output-len 8 --request-rate 4,inf --warmup 2)
  export TANDEM_SCHEDULER_KV_CONNECTOR=tcp
  SERVE_LIMIT=150
fi
id_tokenizer_step "$SERVE_MODEL"

if [ "$MODE" = gpu ]; then
  # 1. The block-copy kernel at real size; two processes, one GPU: blocks through CUDA IPC,
  #    byte-exact, single and batched sessions (no model).
  step "1 block copy kernel + ipc blocks" 120 "$LOGS/1_kernel_ipc_blocks.log" \
    $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_block_copy_gpu.py \
    tests/gpu/test_cuda_ipc.py -k "copy_blocks or two_processes"

  # 2. Transfer rate, llama-3.1-8b shape, 2048-token prompts, beside the D2D copy rate.
  step "2 kv transfer cuda" 90 "$LOGS/2_kv_transfer_cuda.log" \
    $PY -m benchmarks.kv_transfer --mode cuda --out "$OUT/kv_transfer_cuda.json"
fi

# 3-5. Disaggregated (CUDA IPC on the GPU, TCP on the CPU) vs unified, same load and seed.
step "3 serve disaggregated" $SERVE_LIMIT "$LOGS/3_serve_disagg.log" \
  $PY -m tandem.cli bench serve --launch --model "$SERVE_MODEL" --device $DEVICE \
  "${SERVE_ARGS[@]}" "${LOAD[@]}" --no-plots --out-dir "$OUT" --name serve_disagg \
  --log-dir "$LOGS/3_services"
step "4 serve unified" $SERVE_LIMIT "$LOGS/4_serve_unified.log" \
  $PY -m tandem.cli bench serve --launch --unified --model "$SERVE_MODEL" --device $DEVICE \
  "${SERVE_ARGS[@]}" "${LOAD[@]}" --no-plots --out-dir "$OUT" --name serve_unified \
  --log-dir "$LOGS/4_services"
grep -h "KV from .* over" "$LOGS"/3_services/scheduler.log 2>/dev/null | tail -n 2 \
  | tee -a "$summary"
step "5 compare" 30 "$LOGS/5_compare.log" \
  $PY -m benchmarks.serving compare "$OUT/serve_disagg.json" "$OUT/serve_unified.json" \
  --out "$OUT/serve_compare.json" $PLOTS

if [ "$MODE" = gpu ]; then
  # 6. Disaggregated serving over CUDA IPC vs the unified worker: greedy parity, then aborts.
  step "6 ipc serving parity + aborts" 200 "$LOGS/6_ipc_serving.log" \
    $PY -m pytest -q -s -p no:cacheprovider --basetemp="$LOGS/6_ipc_serving_tmp" \
    tests/gpu/test_cuda_ipc.py -k "disaggregated or aborts"
fi

# 7. CPU figures (NCCL code path over gloo, and TCP), 512-token prompts.
step "7 kv transfer cpu" 60 "$LOGS/7_kv_transfer_cpu.log" \
  $PY -m benchmarks.kv_transfer --mode cpu --tokens 512 --iters 5 --concurrency 4 --prompts 8 \
  --out "$OUT/kv_transfer_cpu.json"

finish
