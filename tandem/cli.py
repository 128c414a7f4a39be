"""`tandem generate | serve | bench | frontend | scheduler | prefill-worker | decode-worker`.

Service subcommands replace this process with `python -m services.<name>` (tandem never
imports the services), so `tandem scheduler --port 1234` and
`python -m services.scheduler --port 1234` are the same program.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_SERVICES = {
    "frontend": "services.frontend",
    "scheduler": "services.scheduler",
    "prefill-worker": "services.prefill_worker",
    "decode-worker": "services.decode_worker",
}


def device_arg(value: str) -> str:
    """argparse type of --device: "auto" | "cpu" | "cuda" | "cuda:<index>"."""
    from tandem.config import ConfigError, parse_device

    try:
        parse_device(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineArgs fields (shared by generate, bench and the workers)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="default", help="HF folder, .gguf file, or 'default'")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--max-model-len", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks", type=int, default=0)
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument(
        "--async-scheduling",
        default="auto",
        choices=["auto", "on", "off"],
        help="plan step N+1 while the device runs step N (auto: on for CUDA)",
    )
    g.add_argument(
        "--device",
        default="auto",
        type=device_arg,
        help="auto | cpu | cuda | cuda:<index> (that GPU; every GPU stays visible)",
    )
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--num-threads", type=int, default=0)
    g.add_argument("--cache-dir", default=os.environ.get("TANDEM_CACHE_DIR", ""))


def engine_kwargs_from(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "dtype": ns.dtype,
        "max_model_len": ns.max_model_len,
        "block_size": ns.block_size,
        "num_gpu_blocks": ns.num_gpu_blocks,
        "kv_cache_memory_gb": ns.kv_cache_memory_gb,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "enable_prefix_caching": not ns.no_prefix_caching,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "max_num_seqs": ns.max_num_seqs,
        "policy": ns.policy,
        "async_scheduling": ns.async_scheduling,
        "device": ns.device,
        "attention_backend": ns.attention_backend,
        "enforce_eager": ns.enforce_eager,
        "num_threads": ns.num_threads,
        "cache_dir": ns.cache_dir,
    }


def _generate(argv: list[str]) -> int:
    from tandem import LLM, SamplingParams

    p = argparse.ArgumentParser(prog="tandem generate", description="Offline generation.")
    p.add_argument("prompt", nargs="*", help="prompts (default: one chat question)")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)
    ns = p.parse_args(argv)
    prompts = ns.prompt or ["What is the capital of France? Answer in one sentence."]
    chat = ns.chat or not ns.prompt
    t0 = time.perf_counter()
    llm = LLM(model=ns.model, **engine_kwargs_from(ns))
    t1 = time.perf_counter()
    params = SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.seed
    )
    if chat:
        outs = llm.chat([[{"role": "user", "content": q}] for q in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    t2 = time.perf_counter()
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"\n[load {t1 - t0:.1f}s, generate {t2 - t1:.1f}s, {n_tok} tokens]",
        file=sys.stderr,
    )
    return 0


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in ("serve", "offline"):
        print("usage: tandem bench {serve|offline} [options]", file=sys.stderr)
        return 2
    if argv[0] == "serve":
        from tandem.bench.serve import main as bench_serve

        return bench_serve(argv[1:])
    import runpy

    sys.argv = ["offline_throughput", *argv[1:]]
    runpy.run_module("benchmarks.offline_throughput", run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["generate", "serve", "bench", *_SERVICES]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(f"usage: tandem {{{'|'.join(commands)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "generate":
        return _generate(rest)
    if cmd == "bench":
        return _bench(rest)
    if cmd == "serve":
        from tandem.launcher import main as serve_main

        return serve_main(rest)
    module = _SERVICES[cmd]
    os.execv(sys.executable, [sys.executable, "-m", module, *rest])
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
