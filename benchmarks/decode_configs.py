"""The split-K decode kernel's configs and split counts at served batch sizes (GPU).

For each (batch, context) of the grid: every decode config (`_DECODE_CANDIDATES` and a few
deeper pipelines) at every split count of `--splits`, timed on paged caches dealt in a
shuffled order, as KV read GB/s (every K and V byte of the contexts once). On CUDA the calls
are captured in a CUDA graph, one a "layer" over its own cache (as many as make the bytes
read a pass at least 8x the L2 cache, at most 64), and the replays timed
(`fp8_w8a16.time_in_graph`, the GEMV tuner's timer): a call's host work (its Python, two
launches with a split) is not in the figure, as in the engine's graphs.
Timed eagerly (`--eager`, the first run of this benchmark), a call of about 60 us is bound by
its host work, and split counts above 1 looked slower than they are. Beside them, the
engine's choice today: the config `tune_decode_attention` picks at its start-up shape
(`--tune-batch` requests of 1,024 tokens) with the split count `decode_num_splits` gives at
`--max-model-len` (the bound a captured CUDA graph passes).

    python -m benchmarks.decode_configs --batches 8,32,64,144 --contexts 1024 \
        --out decode_configs.json

CPU dry run (the Triton interpreter, tiny shapes):

    TRITON_INTERPRET=1 python -m benchmarks.decode_configs --device cpu --dtype float16 \
        --batches 2 --contexts 48 --splits 1,2 --configs 2 --tune-batch 0
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.attention_kernels import time_ms
from benchmarks.prefill_attention import make_paged_batch
from tandem_kernels import paged_attention as pa
from tandem_kernels.fp8_w8a16 import time_in_graph

# Deeper pipelines than the tuner's list: short programs (a few tiles each) at small batches
# may want more loads in flight a program.
EXTRA_CONFIGS: tuple[tuple[int, int, int, bool, int], ...] = (
    (64, 4, 4, True, 0),
    (32, 4, 6, True, 0),
    (64, 2, 4, True, 0),
    (128, 8, 3, True, 0),
)


config_name = pa._config_name  # e.g. "128x4x3/heads-first": the tuner's log's names


def sweep_point(
    batch: int,
    context: int,
    configs: list[tuple[int, int, int, bool, int]],
    splits: list[int],
    dev: torch.device,
    dtype: torch.dtype,
    engine_pick: tuple[int, int, int, bool, int] | None,
    max_model_len: int,
    eager: bool,
) -> dict[str, Any]:
    b = make_paged_batch(batch, 1, context - 1, dev, dtype)
    kv_bytes = batch * context * b.kv_cache.shape[3] * b.kv_cache.shape[4] * 2
    kv_bytes *= b.kv_cache.element_size()
    graphs = dev.type == "cuda" and not eager
    num_layers = 1
    if graphs:
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
        num_layers = max(2, min(64, -(-8 * l2 // kv_bytes)))
    caches = [b.kv_cache] + [torch.randn_like(b.kv_cache) for _ in range(num_layers - 1)]
    ref = pa.paged_attention_ref(
        b.query[:2].float(), b.kv_cache.float(), b.query_start_loc[:3], b.seq_lens[:2],
        b.block_table[:2], b.scale,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    for config in configs:
        for num_splits in splits:
            out = torch.empty_like(b.query)

            def run(layer=0, config=config, num_splits=num_splits, out=out) -> torch.Tensor:
                return pa.paged_decode_attention(
                    b.query, caches[layer], b.seq_lens, b.block_table, b.scale,
                    max_seq_len=context, num_splits=num_splits, out=out, block_n=config[0],
                    num_warps=config[1], num_stages=config[2], heads_first=config[3],
                    max_registers=config[4],
                )  # fmt: skip

            try:
                run()
                err = (out[:2].float() - ref).abs().max().item()
                if graphs:
                    layers = [functools.partial(run, layer) for layer in range(num_layers)]
                    us = time_in_graph(layers)
                    if us is None:
                        raise RuntimeError("the calls could not be captured in a CUDA graph")
                    ms = us / 1e3
                else:
                    ms = time_ms(run, dev)
            except Exception as exc:  # a config that cannot run here: the row says why
                rows.append({"config": config_name(config), "splits": num_splits,
                             "error": f"{type(exc).__name__}: {exc}"[:200]})  # fmt: skip
                continue
            rows.append(
                {
                    "config": config_name(config),
                    "splits": num_splits,
                    "ms": ms,
                    "kv_GBps": kv_bytes / ms / 1e6,
                    "max_abs_err": err,
                }
            )
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    engine_splits = pa.decode_num_splits(
        batch, b.kv_cache.shape[3], max_model_len, pa._num_sms(dev)
    )
    engine = None
    if engine_pick is not None:
        name = config_name(engine_pick)
        engine = next(
            (r for r in timed if r["config"] == name and r["splits"] == engine_splits), None
        )
    return {
        "batch": batch,
        "context": context,
        "kv_bytes": kv_bytes,
        "timing": f"CUDA graph of {num_layers} calls" if graphs else "eager",
        "engine_splits": engine_splits,
        "engine": engine,
        "best": best,
        "rows": rows,
    }


def _describe(row: dict[str, Any] | None) -> str:
    """A timed row as one line's piece ("-" for none)."""
    if row is None:
        return "-"
    return f"{row['config']} x{row['splits']} {row['ms'] * 1e3:.1f} us {row['kv_GBps']:.0f} GB/s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--batches", default="8,32,64,144")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--configs", type=int, default=0, help="only the first N configs (0: all)")
    ap.add_argument("--tune-batch", type=int, default=512, help="0: no engine pick")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--eager", action="store_true", help="time eager calls (host work included)")
    ap.add_argument("--out", default="")
    ns = ap.parse_args(argv)
    dev = torch.device(ns.device)
    dtype = getattr(torch, ns.dtype)
    configs = list(dict.fromkeys(pa._DECODE_CANDIDATES + EXTRA_CONFIGS))
    if ns.configs:
        configs = configs[: ns.configs]
    engine_pick = None
    if ns.tune_batch and dev.type == "cuda":
        tb = make_paged_batch(ns.tune_batch, 1, 1023, dev, dtype)
        engine_pick = pa.tune_decode_attention(
            tb.kv_cache, tb.query.shape[1], num_reqs=ns.tune_batch, seq_len=1024
        )
        del tb
        torch.cuda.empty_cache()
    splits = [int(x) for x in ns.splits.split(",")]
    points = []
    for context in [int(c) for c in ns.contexts.split(",")]:
        for batch in [int(x) for x in ns.batches.split(",")]:
            point = sweep_point(
                batch, context, configs, splits, dev, dtype, engine_pick, ns.max_model_len,
                ns.eager,
            )  # fmt: skip
            points.append(point)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            engine, best = _describe(point["engine"]), _describe(point["best"])
            print(f"batch {batch:4d} ctx {context:6d}: engine {engine} | best {best}")
            by_split: dict[int, float] = {}
            for r in point["rows"]:
                if "ms" in r:
                    by_split[r["splits"]] = max(by_split.get(r["splits"], 0.0), r["kv_GBps"])
            print("    best GB/s by splits: " + ", ".join(
                f"{s}:{g:.0f}" for s, g in sorted(by_split.items())))  # fmt: skip
    result = {
        "benchmark": "decode_configs",
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "engine_pick": config_name(engine_pick) if engine_pick else None,
        "points": points,
    }
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
