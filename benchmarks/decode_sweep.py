"""Decode step time by batch size and context length (GPU): where a served decode step goes.

For every (batch, context) of the grid, `batch` requests of `context` prompt tokens are
prefilled, then the engine steps with every request decoding: wall ms per step (as the engine
runs it: CUDA graphs, async scheduling), and device ms per step by kernel kind
(torch.profiler), beside the bytes a step must read (weights + the batch's KV) and the time
that takes at `--peak-gbps`.

    python -m benchmarks.decode_sweep --model random:llama-3.1-8b --dtype bfloat16 \
        --batches 1,8,24,48,96,160 --contexts 128,1100 --out decode_sweep.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline_workload import make_prompts
from benchmarks.step_breakdown import device_profile
from tandem.config import add_engine_args
from tandem.engine.core import EngineCore
from tandem.engine_args import EngineArgs
from tandem.request import EngineCoreRequest
from tandem.sampling_params import SamplingParams


def _weight_bytes(engine: EngineCore) -> int:
    model = engine.model_runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(
    engine: EngineCore,
    batch: int,
    context: int,
    steps: int,
    seed: int,
    mixed_prefill: list[int],
) -> dict[str, Any]:
    """One grid point; every request is aborted before it returns (the pool whole again)."""
    engine.scheduler.reset_prefix_cache()
    prompts = make_prompts(batch, context, engine.vocab_size, seed)
    cuda = torch.cuda.is_available()
    params = SamplingParams(
        temperature=0.0, max_tokens=(3 + len(mixed_prefill)) * steps + 16, ignore_eos=True
    )
    ids = [f"s{batch}-{context}-{i}" for i in range(batch)]
    for rid, q in zip(ids, prompts, strict=True):
        engine.add_request(EngineCoreRequest(rid, q, params, eos_token_id=None))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    prof: dict[str, Any] = (
        device_profile(engine, min(steps, 10))
        if cuda
        else {"device_ms_per_step": 0.0, "by_kind_ms_per_step": {}}
    )
    point: dict[str, Any] = {"batch": batch, "context": context, "wall_ms_per_step": wall, **prof}
    # Mixed steps: the same decode batch, and before every step one new request of P prompt
    # tokens (one output token): every step is mixed, as when requests keep arriving.
    mixed = {}
    for p_len in mixed_prefill:
        extra = make_prompts(steps + 4, p_len, engine.vocab_size, seed + p_len)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for j in range(steps):
            engine.add_request(EngineCoreRequest(f"m{p_len}-{j}-{seed}", extra[j], one, None))
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        mixed[str(p_len)] = (time.perf_counter() - t0) / steps * 1e3
    point["mixed_wall_ms_per_step"] = mixed
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.set_defaults(model="random:llama-3.1-8b", dtype="bfloat16", max_model_len=4096)
    p.add_argument("--batches", default="1,8,24,48,96,160")
    p.add_argument("--contexts", default="128,1100")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--mixed-prefill",
        default="16,512",
        help="prompt lengths of a request added before every step (mixed steps); '' for none",
    )
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM bandwidth (H200: 4.8 TB/s)")
    p.add_argument("--out", default="")
    ns = p.parse_args(argv)
    engine = EngineCore(EngineArgs.from_cli_args(ns).create_engine_config())
    cfg = engine.model_runner.hf_config
    head_size = cfg.hidden_size // cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    dtype = next(engine.model_runner.model.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    kv_per_token = cfg.num_hidden_layers * 2 * num_kv_heads * head_size * elem
    weights = _weight_bytes(engine)
    points = []
    for context in [int(x) for x in ns.contexts.split(",")]:
        for batch in [int(x) for x in ns.batches.split(",")]:
            pt = measure(
                engine,
                batch,
                context,
                ns.steps,
                seed=batch * 7919 + context,
                mixed_prefill=[int(x) for x in ns.mixed_prefill.split(",") if x],
            )
            read = weights + batch * (context + 2 * ns.steps) * kv_per_token
            pt["bytes_read"] = read
            pt["bandwidth_floor_ms"] = read / (ns.peak_gbps * 1e6)
            pt["floor_fraction"] = pt["bandwidth_floor_ms"] / pt["wall_ms_per_step"]
            points.append(pt)
            kinds = " ".join(f"{k} {v:.2f}" for k, v in pt["by_kind_ms_per_step"].items())
            print(
                f"batch {batch:4d} context {context:5d}: wall {pt['wall_ms_per_step']:6.2f} ms, "
                f"device {pt['device_ms_per_step']:6.2f} ms (floor {pt['bandwidth_floor_ms']:.2f}"
                f" ms, {100 * pt['floor_fraction']:.0f}%) | {kinds} | mixed "
                + " ".join(f"+{k}: {v:.2f} ms" for k, v in pt["mixed_wall_ms_per_step"].items()),
                flush=True,
            )
    if ns.out:
        report = {
            "benchmark": "decode_sweep",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "engine": {k: v for k, v in vars(ns).items() if isinstance(v, (int, float, str))},
            "weight_bytes": weights,
            "kv_bytes_per_token": kv_per_token,
            "points": points,
        }
        Path(ns.out).write_text(json.dumps(report, indent=1) + "\n")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
