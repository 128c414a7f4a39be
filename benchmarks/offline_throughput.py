"""Offline throughput: tandem's `LLM` against transformers' batched `generate`, in one run.

CPU default: SmolLM2-135M fp32, 64 prompts of 128 tokens, 128 new tokens each, greedy,
ignore_eos. Prints output tokens/s of both and their ratio, writes JSON under
benchmarks/results/.

    python -m benchmarks.offline_throughput                 # CPU, embedded model
    python -m benchmarks.offline_throughput --device cuda   # GPU figures (see --help)

Every engine flag applies (the one definition, `tandem.config`); this benchmark's engine
defaults differ from the engine's: --device cpu, --dtype float32 on CPU and bfloat16 on GPU,
--max-num-batched-tokens 2048 CPU / 8192 GPU, --max-num-seqs 256 CPU / 1024 GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch

from tandem.config import add_engine_args, engine_kwargs_from, parse_device

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def run_tandem(
    model: str, prompts: list[list[int]], output_len: int, engine_kwargs: dict[str, Any]
) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, **engine_kwargs)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # Warm-up on a couple of prompts (allocator, kernels), then the timed run.
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], params.clone(max_tokens=4), use_tqdm=False
    )
    llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {
        "load_s": load_s,
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + n_in) / elapsed,
        "num_blocks": llm.engine.num_blocks,
    }


def run_transformers(
    model_path: Path,
    prompts: list[list[int]],
    output_len: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict[str, Any]:
    from tandem.models.presets import load_transformers_model

    model = load_transformers_model(model_path, dtype, device, seed)
    model.eval()
    max_len = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    mask = torch.zeros(len(prompts), max_len, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, max_len - len(p) :] = torch.tensor(p)
        mask[i, max_len - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(
            ids[:2], attention_mask=mask[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - max_len) * len(prompts)
    n_in = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + n_in) / elapsed,
    }


def cpu_main(ns: argparse.Namespace) -> dict[str, Any]:
    from tandem.loader import resolve_model_path

    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    model_path = resolve_model_path(ns.model, ns.cache_dir or None)
    prompts = make_prompts(ns.num_prompts, ns.input_len, 49152, ns.seed)
    engine_kwargs = engine_kwargs_from(ns)
    result: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "model": str(model_path.name),
        "dtype": ns.dtype,
        "workload": {
            "num_prompts": ns.num_prompts,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "greedy": True,
            "ignore_eos": True,
        },
    }
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    result["tandem"] = run_tandem(str(model_path), prompts, ns.output_len, engine_kwargs)
    print(f"tandem:       {result['tandem']['output_tokens_per_s']:8.1f} output tok/s", flush=True)
    if not ns.skip_peer:
        result["transformers"] = run_transformers(
            model_path, prompts, ns.output_len, getattr(torch, ns.dtype), "cpu"
        )
        print(f"transformers: {result['transformers']['output_tokens_per_s']:8.1f} output tok/s")
        result["ratio"] = (
            result["tandem"]["output_tokens_per_s"] / result["transformers"]["output_tokens_per_s"]
        )
        print(f"ratio tandem / transformers: {result['ratio']:.2f}x")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    # This benchmark's engine defaults (0 and auto: by device, see `on_cuda_defaults`).
    p.set_defaults(device="cpu", max_num_batched_tokens=0, max_num_seqs=0)
    p.add_argument(
        "--threads",
        dest="num_threads",
        type=int,
        default=argparse.SUPPRESS,
        help="same as --num-threads (torch threads; 0: torch's default)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--max-requests", type=int, default=1024, help="GPU: cap per workload")
    w.add_argument("--peer-requests", type=int, default=128, help="GPU: transformers subset")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--skip-peer", action="store_true", help="don't run transformers")
    w.add_argument(
        "--workloads", default="", help="GPU: only these, e.g. 512/256,1000/1000 (default: all)"
    )
    p.add_argument("--out", default="", help="JSON path (default: benchmarks/results/...)")
    return p


def on_cuda_defaults(ns: argparse.Namespace) -> bool:
    """Whether the run is on CUDA; fills in the by-device engine defaults of `ns`."""
    kind, _ = parse_device(ns.device)
    on_cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if not ns.max_num_seqs:
        ns.max_num_seqs = 1024 if on_cuda else 256
    if not ns.max_num_batched_tokens:
        ns.max_num_batched_tokens = 8192 if on_cuda else 2048
    if ns.dtype == "auto":
        ns.dtype = "bfloat16" if on_cuda else "float32"
    return on_cuda


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    on_cuda = on_cuda_defaults(ns)
    if on_cuda:
        from benchmarks.gpu_throughput import cuda_main

        result = cuda_main(ns)
    else:
        result = cpu_main(ns)
    out = (
        Path(ns.out)
        if ns.out
        else RESULTS_DIR
        / f"offline_throughput_{'cuda' if on_cuda else 'cpu'}_{dt.date.today().isoformat()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
