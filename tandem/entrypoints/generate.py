"""`tandem generate`: offline generation with `LLM`, engine flags from `tandem.config`."""

from __future__ import annotations

import argparse
import sys
import time

from tandem.config import ConfigError, add_engine_args
from tandem.engine_args import EngineArgs


def build_parser() -> argparse.ArgumentParser:
    """The parser of `tandem generate`: sampling flags, then every engine flag."""
    p = argparse.ArgumentParser(prog="tandem generate", description="Offline generation.")
    p.add_argument("prompt", nargs="*", help="prompts (default: one chat question)")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    add_engine_args(p)
    return p


def main(argv: list[str]) -> int:
    """Generate and print; a bad flag, sampling value or prompt exits 2 with one line naming
    it (the sampling values and the engine flags are checked before the model loads)."""
    from tandem import LLM, SamplingParams
    from tandem.engine.core import InvalidRequestError
    from tandem.sampling_params import SamplingParamsError

    parser = build_parser()
    ns = parser.parse_args(argv)
    prompts = ns.prompt or ["What is the capital of France? Answer in one sentence."]
    chat = ns.chat or not ns.prompt
    try:
        params = SamplingParams(
            temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.seed
        )
        args = EngineArgs.from_cli_args(ns)
        args.create_engine_config(resolve=False)
        t0 = time.perf_counter()
        llm = LLM(**vars(args))
        t1 = time.perf_counter()
        if chat:
            outs = llm.chat([[{"role": "user", "content": q}] for q in prompts], params)
        else:
            outs = llm.generate(prompts, params)
    except (ConfigError, InvalidRequestError, SamplingParamsError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    t2 = time.perf_counter()
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"\n[load {t1 - t0:.1f}s, generate {t2 - t1:.1f}s, {n_tok} tokens]",
        file=sys.stderr,
    )
    return 0
