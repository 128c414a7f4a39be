"""Where a step's time goes: cProfile of the engine loop on one workload (host side).

python -m benchmarks.profile_step --device cuda --model random:llama-3.1-8b
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks.offline_workload import make_prompts
from tandem import LLM, SamplingParams
from tandem.config import add_engine_args, engine_kwargs_from


def build_parser() -> argparse.ArgumentParser:
    """Every engine flag (this benchmark's defaults: an 8B random-weight shape on CUDA, 512
    sequences, 8192 tokens a step, 4096 tokens of context), then the workload."""
    p = argparse.ArgumentParser(description=__doc__)
    add_engine_args(p)
    p.set_defaults(
        model="random:llama-3.1-8b",
        device="cuda",
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=512)
    w.add_argument("--input-len", type=int, default=512)
    w.add_argument("--output-len", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    llm = LLM(model=ns.model, **engine_kwargs_from(ns))
    prompts = make_prompts(ns.num_prompts, ns.input_len, llm.engine.vocab_size, 0)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": q} for q in prompts[:4]], params, use_tqdm=False)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    prof.disable()
    if llm.engine.config.device.resolved_device().startswith("cuda"):
        torch.cuda.synchronize()
    print(f"elapsed {time.perf_counter() - t0:.2f}s")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(40)


if __name__ == "__main__":
    main()
