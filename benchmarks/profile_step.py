"""Where a step's time goes: cProfile of the engine loop on one workload (host side).

python -m benchmarks.profile_step --device cuda --model random:llama-3.1-8b
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks.offline_throughput import make_prompts
from tandem import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=512)
    ns = p.parse_args()
    llm = LLM(
        model=ns.model,
        device=ns.device,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    prompts = make_prompts(ns.num_prompts, ns.input_len, llm.engine.vocab_size, 0)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": q} for q in prompts[:4]], params, use_tqdm=False)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    prof.disable()
    if ns.device == "cuda":
        torch.cuda.synchronize()
    print(f"elapsed {time.perf_counter() - t0:.2f}s")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(40)


if __name__ == "__main__":
    main()
