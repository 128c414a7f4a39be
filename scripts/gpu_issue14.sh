#!/usr/bin/env bash
# Issue 14 on one GPU: `tandem serve` under the issue's load (random prompts of 500-1,500
# tokens, 100-300 output tokens, ignore_eos, 150 requests per rate, Poisson at 5, 15, 25 req/s
# and all at once, the OpenAI HTTP endpoint), unified and disaggregated (prefill + decode on one
# GPU over CUDA IPC), beside the offline engine on the same requests, with every process's CPU
# per rate. With OLD_TREE=<dir> (a checkout of an earlier commit inside the repository) the
# unified run is repeated from that tree: the before/after of one change in one sitting.
#
#   OUT=/some/dir bash scripts/gpu_issue14.sh            (from the repository root)
#   MODE=cpu OUT=/tmp/x bash scripts/gpu_issue14.sh      (dry run: SmolLM2, tiny loads)
#
# $OUT: summary.txt, issue14.json (every run merged: latency, throughput, CPU, start-up), and
# logs.tar.gz (the services' logs, each bench run's own JSON).
ISSUE=issue14
BUDGET_S=${BUDGET_S:-560}
. scripts/device_lib.sh
env_report

if [ "$MODE" = gpu ]; then
  MODEL=${SERVE_MODEL:-random:llama-3.1-8b}
  ENGINE=(--dtype bfloat16 --max-model-len 4096)
  DISAGG_ENGINE=(--gpu-memory-utilization 0.42)
  LOAD=(--num-prompts 150 --input-len 1000 --output-len 200 --range-ratio 0.5 --warmup 4)
  RATES=${RATES:-5,15,25,inf}
  export TANDEM_SCHEDULER_KV_CONNECTOR=cuda-ipc
else
  MODEL=${SERVE_MODEL:-default}
  ENGINE=(--max-model-len 1024 --num-gpu-blocks 512 --device cpu)
  DISAGG_ENGINE=()
  LOAD=(--num-prompts 6 --input-len 60 --output-len 8 --range-ratio 0.5 --warmup 1)
  RATES=${RATES:-4,inf}
  export TANDEM_SCHEDULER_KV_CONNECTOR=tcp
fi
# Extra engine flags for every engine of the run (e.g. ENGINE_EXTRA="--max-num-batched-tokens
# 8192"); OFFLINE=first|last|both|none places the offline engine's run (last: after the
# served runs warmed the kernel caches).
read -r -a EXTRA <<<"${ENGINE_EXTRA:-}"
ENGINE+=("${EXTRA[@]}")
OFFLINE=${OFFLINE:-first}
id_tokenizer_step "$MODEL"
RES=$WORK/logs/results
mkdir -p "$RES"
SITE=${PYTHONPATH#"$PWD"}

# Each rate draws its own prompts (workload seed = the rate's position, from 1): a rate never
# hits the prefix cache that an earlier rate filled, served or offline. SAME_PROMPTS=1: every
# rate sends the same prompts (seed 1) to the same warm server, as `vllm bench serve` re-run at
# each rate with its default seed does (rates after the first hit the prefix cache).
# FIRST_SEED=k: the first rate's seed (default 1), so a run of one rate can send the prompts
# that rate had at position k of an earlier run.
if [ "${SAME_PROMPTS:-0}" = 1 ]; then
  SEEDS=$(python3 -c "print(','.join('1' for _ in '$RATES'.split(',')))")
  OFFLINE_FLAGS=(--keep-prefix-cache)
else
  SEEDS=$(python3 -c "print(','.join(str(i + ${FIRST_SEED:-1}) for i in range(len('$RATES'.split(',')))))")
  OFFLINE_FLAGS=()
fi
[ "${TIMELINE:-0}" = 1 ] && OFFLINE_FLAGS+=(--timeline)

offline_run() {  # offline_run NAME: the offline engine on the same requests and arrival times
  step "offline engine ($1)" "${OFFLINE_LIMIT_S:-150}" "$LOGS/offline_$1.log" \
    $PY -m benchmarks.serve_offline --model "$MODEL" "${ENGINE[@]}" "${LOAD[@]}" \
    --request-rate "$RATES" --seeds "$SEEDS" "${OFFLINE_FLAGS[@]}" --out "$RES/offline_$1.json"
  grep -E "^offline rate|^  (decode|mixed|prompts)" "$LOGS/offline_$1.log" >>"$summary"
}
if [ "$OFFLINE" = first ] || [ "$OFFLINE" = both ]; then offline_run first; fi

serve_run() {  # serve_run NAME TREE PORT [tandem serve flags...]
  local name=$1 tree=$2 port=$3
  shift 3
  local left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt 60 ]; then
    echo "$name: skipped (budget spent)" | tee -a "$summary"
    return
  fi
  local pypath="$tree$SITE"
  local t0
  t0=$(date +%s.%N)
  (cd "$tree" && PYTHONPATH="$pypath" exec $PY -m tandem.cli serve --model "$MODEL" \
    "${ENGINE[@]}" --http-port "$port" --grpc-port $((port + 1)) --log-dir "$LOGS/$name" "$@") \
    >"$LOGS/${name}_serve.log" 2>&1 &
  local spid=$!
  if ! PYTHONPATH="$pypath" $PY - "$port" <<'PYEOF'; then
import sys, time, urllib.request
deadline = time.time() + 240
while time.time() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=2).read()
        sys.exit(0)
    except Exception:
        time.sleep(0.25)
sys.exit(1)
PYEOF
    echo "$name: never answered (see ${name}_serve.log)" | tee -a "$summary"
    tail -n 20 "$LOGS/${name}_serve.log"
    kill -TERM $spid 2>/dev/null
    wait $spid
    return
  fi
  local up
  up=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
  echo "$name: answered ${up}s after start" | tee -a "$summary"
  echo "{\"name\": \"$name\", \"startup_s\": $up}" >"$RES/${name}_startup.json"
  local k=0
  local seeds=(${SEEDS//,/ })
  for rate in ${RATES//,/ }; do
    k=$((k + 1))
    $PY scripts/proc_cpu.py "$RES/${name}_cpu_${rate}.json" &
    local cpid=$!
    (cd "$tree" && PYTHONPATH="$pypath" timeout 200 $PY -m tandem.cli bench serve \
      --url "http://127.0.0.1:$port" --backend http --model "$MODEL" "${LOAD[@]}" \
      --request-rate "$rate" --seed "${seeds[$((k - 1))]}" --no-plots --out-dir "$RES" --name "${name}_${rate}") \
      >>"$LOGS/${name}_bench.log" 2>&1
    echo "$name rate $rate: rc=$? $(grep -E "^ *serve" "$LOGS/${name}_bench.log" | tail -n 1)" \
      | tee -a "$summary"
    kill -TERM $cpid
    wait $cpid
  done
  kill -TERM $spid
  wait $spid
  grep -hE "engine step frames|late planning" "$LOGS/$name"/*.log 2>/dev/null | tee -a "$summary"
}

TAG=${TAG:-}
RUNS=${RUNS:-unified disagg}  # which served layouts, in order
for run in $RUNS; do
  case $run in
    unified) serve_run "unified$TAG" "$PWD" 8100 --unified ;;
    disagg) serve_run "disagg$TAG" "$PWD" 8300 "${DISAGG_ENGINE[@]}" ;;
  esac
  if [ "$run" = unified ] && [ -n "${OLD_TREE:-}" ]; then
    serve_run "unified_before$TAG" "$PWD/$OLD_TREE" 8200 --unified
  fi
done
if [ "$OFFLINE" = last ] || [ "$OFFLINE" = both ]; then offline_run last; fi

MERGE_FLAGS=()
[ "${SAME_PROMPTS:-0}" = 1 ] && MERGE_FLAGS=(--same-prompts)  # whose vLLM figures to show
step "9 merge" 30 "$LOGS/9_merge.log" $PY -m benchmarks.serving_report "$RES" "$OUT/issue14.json" \
  "${MERGE_FLAGS[@]}"
cat "$LOGS/9_merge.log" >>"$summary"
finish
