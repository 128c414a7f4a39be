#!/usr/bin/env bash
# Issue 31 on two H200s of one host (device kind nvidia-h200-x2), in parts of one device call
# each (PART=...), every step time-limited within $BUDGET_S:
#   tp2      greedy parity TP = 2 against one GPU (the 1B shape in fp32, 16 prompts: identical),
#            then the offline benchmark of the 8B shape at TP = 2 (three workloads, batch 1)
#   replicas the offline benchmark of the 8B shape on one GPU (the ratio's denominator)
#   70b      the 70B shape in bf16 at TP = 2 (1000/1000, batch 1), then PP = 2
#   disagg   one prefill GPU + one decode GPU (NCCL) against two unified workers, long prompts
#            (4,000-8,000 in, 300-500 out) in bursts beside running decodes
#
#   OUT=/some/dir PART=tp2 bash scripts/gpu_issue31.sh          (from the repository root)
#   MODE=cpu OUT=/tmp/x PART=tp2 bash scripts/gpu_issue31.sh    (dry run: gloo, SmolLM2 at
#                                                               TP = 3, tiny loads)
ISSUE=issue31
BUDGET_S=${BUDGET_S:-560}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. scripts/device_lib.sh
env_report
PART=${PART:-tp2}

parity() {  # parity MODEL TP DTYPE: greedy tokens at TP against one rank, 16 prompts
  step "parity $1 tp$2 $3" 240 "$LOGS/parity_tp$2.log" $PY - "$1" "$2" "$3" "$4" <<'PYEOF'
import sys
from tandem import LLM, SamplingParams
model, tp, dtype, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 10 for j in range(24 + i)]}
           for i in range(16)]
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
outs = {}
for size in (1, tp):
    llm = LLM(model, device=device, dtype=dtype, tensor_parallel_size=size,
              max_model_len=512)
    outs[size] = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
           for a, b in zip(outs[1], outs[tp], strict=True))
top5 = 0
for a, b in zip(outs[1], outs[tp], strict=True):
    x, y = a.outputs[0], b.outputs[0]
    d = next((j for j, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q), None)
    top5 += d is None or (x.token_ids[d] in y.logprobs[d] and y.token_ids[d] in x.logprobs[d])
print(f"TP {tp} vs one rank ({model}, {dtype}): {same}/16 identical, {top5}/16 top-5 rule")
PYEOF
  grep "identical" "$LOGS/parity_tp$2.log" >>"$summary"
}

if [ "$MODE" = cpu ]; then
  parity default 3 float32 cpu
  finish
  exit 0
fi

case $PART in
  tp2)
    parity random:llama-3.2-1b 2 float32 cuda
    offline tp2 300 --tensor-parallel-size 2
    ;;
  replicas)
    offline one_gpu 300
    ;;
  70b)
    WORKLOADS=1000/1000 offline 70b_tp2 300 --model random:llama-3.1-70b \
      --tensor-parallel-size 2
    WORKLOADS=1000/1000 offline 70b_pp2 240 --model random:llama-3.1-70b \
      --pipeline-parallel-size 2
    ;;
  disagg)
    SERVE_MODEL=random:llama-3.1-8b
    id_tokenizer_step "$SERVE_MODEL"
    LOAD=(--num-prompts 48 --input-len 6000 --output-len 400 --range-ratio 0.33
      --request-rate 1,2,4 --warmup 2)
    ARGS=(--dtype bfloat16 --max-model-len 9000 --gpus 0,1)
    TANDEM_SCHEDULER_KV_CONNECTOR=nccl step "serve disaggregated" 250 "$LOGS/disagg.log" \
      $PY -m tandem.cli bench serve --launch --model "$SERVE_MODEL" "${ARGS[@]}" "${LOAD[@]}" \
      --no-plots --out-dir "$OUT" --name serve_disagg --log-dir "$LOGS/disagg_services"
    step "serve 2 unified" 250 "$LOGS/unified2.log" \
      $PY -m tandem.cli bench serve --launch --unified --num-unified-workers 2 \
      --model "$SERVE_MODEL" "${ARGS[@]}" "${LOAD[@]}" --no-plots --out-dir "$OUT" \
      --name serve_unified2 --log-dir "$LOGS/unified2_services"
    step "compare" 30 "$LOGS/compare.log" $PY -m benchmarks.serving compare \
      "$OUT/serve_disagg.json" "$OUT/serve_unified2.json" --goodput-auto \
      --out "$OUT/serve_compare.json" $PLOTS
    cat "$LOGS/compare.log" >>"$summary" 2>/dev/null
    ;;
esac
finish
