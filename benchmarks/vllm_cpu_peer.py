"""vLLM-CPU as a peer of `benchmarks.offline_throughput`, run in the peer's own venv.

Started by the benchmark as `<peer venv python> benchmarks/vllm_cpu_peer.py SPEC.json` (this
file imports nothing of tandem: the peer venv has vLLM and its torch, not tandem). SPEC holds
the model folder, the prompts (token ids), the output length and the dtype. It loads the
engine once, prints `TANDEM_PEER_READY`, then for each line on stdin ("run") does one timed
greedy, ignore_eos `generate` of every prompt and prints `TANDEM_PEER_RESULT <json>`; EOF ends
it (vLLM prints lines of its own to stdout: the markers tell ours apart). Thread binding
comes from the environment the benchmark sets (`VLLM_CPU_OMP_THREADS_BIND`).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    print("TANDEM_PEER_READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(p) for p in spec["prompts"])
        result = {
            "elapsed_s": elapsed,
            "output_tokens": n_out,
            "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_out + n_in) / elapsed,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        }
        print("TANDEM_PEER_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
