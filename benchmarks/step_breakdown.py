"""Where a GPU step's time goes: wall time per step against device time, by kernel kind.

Runs `--num-prompts` prompts through the engine one step at a time and measures, for the
prefill phase and for the decode phase (every request decoding):

- wall ms per step (no profiler; the device is synchronised at the phase's ends only);
- device ms per step from torch.profiler, split into matmul / attention / norm, rotary,
  activation / sampling / copies / other kernels, and the top kernels by time;
- the device's busy fraction (device time over wall time): below 1 the host is the limit.

    python -m benchmarks.step_breakdown --model random:llama-3.1-8b --out breakdown.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline_workload import make_prompts
from tandem.config import add_engine_args, engine_kwargs_from

# First match wins: attention before matmul, since cuDNN's attention kernels carry "sm90" in
# their names (and our dense prefill kernels match neither otherwise).
_KINDS = [
    (
        "attention",
        re.compile(
            r"attention|attn|paged|_decode_kernel|_decode_reduce|prefill_kernel|dense_hopper"
            r"|dense_causal|fmha|sdpa|flash_fwd",
            re.I,
        ),
    ),
    ("matmul", re.compile(r"gemm|gemv|w8a16|cutlass|xmma|nvjet|cublas|matmul|sm90|sm100", re.I)),
    ("kv_write", re.compile(r"reshape_and_cache|cache_kernel|kv_write", re.I)),
    ("norm_rotary_act", re.compile(r"rms|norm|rotary|rope|silu|act_and_mul|mul_kernel", re.I)),
    ("sampling", re.compile(r"argmax|sort|softmax|exponential|topk|max_kernel", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|fill|index|scatter|gather|cat", re.I)),
]


def kind_of(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def device_profile(engine: Any, num_steps: int) -> dict[str, Any]:
    """Device time of `num_steps` engine steps, by kernel kind (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels: list[tuple[str, float, int]] = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0)
        if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_kind[kind_of(evt.key)] = by_kind.get(kind_of(evt.key), 0.0) + t / 1e3
        kernels.append((evt.key, t / 1e3, evt.count))
    kernels.sort(key=lambda k: -k[1])
    total = sum(by_kind.values())
    return {
        "device_ms_per_step": total / num_steps,
        "by_kind_ms_per_step": {k: v / num_steps for k, v in sorted(by_kind.items())},
        "top_kernels": [
            {"name": n[:120], "ms_per_step": t / num_steps, "calls": c} for n, t, c in kernels[:15]
        ],
    }


def print_kernel_table(profile: dict[str, Any], indent: str = "    ") -> None:
    """A `device_profile`'s kinds, then its eight costliest kernels (calls a step or in all)."""
    for kind, ms in profile["by_kind_ms_per_step"].items():
        print(f"{indent}{kind:16s} {ms:8.3f} ms")
    for k in profile["top_kernels"][:8]:
        calls = k.get("calls_per_step", k.get("calls", 0))
        print(f"{indent}{k['ms_per_step']:8.3f} ms  x{calls:<5.1f} {k['name'][:90]}")


def timed_steps(engine: Any, num_steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / num_steps * 1e3


def build_parser() -> argparse.ArgumentParser:
    """Every engine flag (this benchmark's defaults: an 8B random-weight shape on CUDA, 512
    sequences, 8192 tokens a step), then the workload."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.set_defaults(
        model="random:llama-3.1-8b", device="cuda", max_num_seqs=512, max_num_batched_tokens=8192
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=512)
    w.add_argument("--input-len", type=int, default=512)
    w.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="")
    return p


def main(argv: list[str] | None = None) -> int:
    from tandem import LLM, SamplingParams
    from tandem.request import EngineCoreRequest

    ns = build_parser().parse_args(argv)
    llm = LLM(model=ns.model, **engine_kwargs_from(ns))
    engine = llm.engine
    vocab = engine.vocab_size
    prompts = make_prompts(ns.num_prompts, ns.input_len, vocab, 0)
    decode_steps = 3 * ns.steps + 10
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    # Warm-up: a few requests through prefill and decode.
    llm.generate(
        [{"prompt_token_ids": q} for q in prompts[:4]], params.clone(max_tokens=8), use_tqdm=False
    )
    engine.scheduler.kv_cache_manager.reset_prefix_cache()
    for i, q in enumerate(prompts):
        engine.add_request(
            EngineCoreRequest(f"r{i}", q, params.clone(max_tokens=decode_steps), eos_token_id=None)
        )
    prefill_tokens = ns.num_prompts * ns.input_len
    num_prefill_steps = max(prefill_tokens // ns.max_num_batched_tokens - 1, 1)
    result: dict[str, Any] = {
        "benchmark": "step_breakdown",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": ns.model,
        "async_scheduling": engine.async_scheduling,
        "workload": {
            "num_prompts": ns.num_prompts,
            "input_len": ns.input_len,
            "max_num_seqs": ns.max_num_seqs,
            "max_num_batched_tokens": ns.max_num_batched_tokens,
        },
    }
    half = max(num_prefill_steps // 2, 1)
    wall = timed_steps(engine, half)
    prof = device_profile(engine, max(num_prefill_steps - half, 1))
    result["prefill"] = {
        "tokens_per_step": ns.max_num_batched_tokens,
        "wall_ms_per_step": wall,
        **prof,
        "device_busy": prof["device_ms_per_step"] / wall,
    }
    # Run until every request decodes (prefill done), then the decode phase.
    while len(engine.scheduler.waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    engine.step()
    wall = timed_steps(engine, ns.steps)
    prof = device_profile(engine, ns.steps)
    result["decode"] = {
        "batch": len(engine.scheduler.running),
        "wall_ms_per_step": wall,
        **prof,
        "device_busy": prof["device_ms_per_step"] / wall,
    }
    engine.abort_requests([f"r{i}" for i in range(ns.num_prompts)])
    while engine.has_unfinished_requests():
        engine.step()
    for phase in ("prefill", "decode"):
        r = result[phase]
        print(
            f"{phase}: wall {r['wall_ms_per_step']:.2f} ms/step, device "
            f"{r['device_ms_per_step']:.2f} ms/step ({100 * r['device_busy']:.0f}% busy)"
        )
        print_kernel_table(r)
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
