"""CPU paged attention: the `cpu` backend's C++ kernel against the `torch` backend, one call.

The embedded model's attention shape (9 query heads, 3 KV heads, head size 64, blocks of 16
tokens, blocks shuffled in a cache of several requests): decode steps (one new token per
request over its cached context) and prefill steps (whole prompts). The torch backend gathers
each request's blocks into padded K/V and runs SDPA; the cpu backend reads the blocks in place
(`tandem_kernels.cpu.paged_attention`). Both outputs are checked against each other, then each
is timed over `--iters` calls (the cache written once); prints ms a call and GFLOP/s (QK^T and
PV over the visible keys), and the cache bytes read per ms for decode (it is bound by memory
bandwidth there), and writes JSON.

    python -m benchmarks.cpu_attention --out benchmarks/results/cpu_attention.json
    python -m benchmarks.cpu_attention --dtypes float32 --layers 30 --iters 60  # as the engine
    python -m benchmarks.cpu_attention --dtypes float32 --layers 30 --kv-layout block

`--kv-layout layer` (the default) stores the cache as the CPU engine does (layer-major:
`tandem.worker.cpu_memory.layer_major_kv_cache`), `block` block-major (as before it).
"""

from __future__ import annotations

# tandem first: it sets the OpenMP defaults (tandem/runtime_env.py) before torch loads.
import tandem  # noqa: F401

# isort: split
import argparse
import datetime as dt
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from tandem.layers.attention import AttentionMetadata, get_attention_backend
from tandem.worker.cpu_memory import huge_page_empty, layer_major_kv_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
# (name, requests, new tokens each, context tokens each, including the new ones)
SHAPES = [
    ("decode 64 x 200", 64, 1, 200),
    ("decode 64 x 256", 64, 1, 256),
    ("prefill 16 x 128", 16, 128, 128),
    ("chunk 2 x 512 over 1536", 2, 512, 2048),
]


def metadata(query_len: int, seq_len: int, tables: list[list[int]]) -> AttentionMetadata:
    """One step of `len(tables)` requests, each computing its last `query_len` tokens."""
    n = len(tables)
    starts = [i * query_len for i in range(n + 1)]
    slots = [
        t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for t in tables
        for p in range(seq_len - query_len, seq_len)
    ]
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        num_reqs=n,
        max_query_len=query_len,
        max_seq_len=seq_len,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([seq_len] * n, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[seq_len] * n,
        is_decode_only=query_len == 1,
        num_decodes=n if query_len == 1 else 0,
    )


def run_shape(
    num_reqs: int,
    query_len: int,
    seq_len: int,
    dtype: torch.dtype,
    iters: int,
    layers: int = 1,
    kv_layout: str = "layer",
) -> dict[str, Any]:
    """One shape's timings; with `layers` > 1 the cache is the engine's `[num_blocks, layers,
    2, ...]` on huge pages, stored layer-major (`kv_layout` "layer", as the CPU engine) or
    block-major ("block"), and call i reads layer i % layers (at 30 layers, from DRAM)."""
    per_req = -(-seq_len // BLOCK_SIZE)
    ids = list(range(num_reqs * per_req + 1))
    random.Random(0).shuffle(ids)
    tables = [ids[i * per_req : (i + 1) * per_req] for i in range(num_reqs)]
    gen = torch.Generator().manual_seed(0)
    shape = (len(ids), layers, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    full = (
        layer_major_kv_cache(shape, dtype)
        if kv_layout == "layer"
        else huge_page_empty(shape, dtype)
    )
    full.copy_(torch.randn(shape, generator=gen))
    views = [full[:, i] for i in range(layers)]
    cache = views[0]
    md = metadata(query_len, seq_len, tables)
    t = num_reqs * query_len
    q = torch.randn(t, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    scale = HEAD_SIZE**-0.5
    flops = (
        4
        * NUM_HEADS
        * HEAD_SIZE
        * num_reqs
        * sum(seq_len - query_len + j + 1 for j in range(query_len))
    )
    row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
    outs = {}
    for name in ("torch", "cpu"):
        backend = get_attention_backend(name)
        outs[name] = backend.forward(q, k, v, cache, md, scale)
        for _ in range(2):
            backend.forward(q, k, v, cache, md, scale)
        t0 = time.perf_counter()
        for i in range(iters):
            backend.forward(q, k, v, views[i % layers], md, scale)
        ms = (time.perf_counter() - t0) / iters * 1e3
        row[f"{name}_ms"] = ms
        row[f"{name}_gflops"] = flops / ms / 1e6
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(outs["cpu"].float(), outs["torch"].float(), rtol=tol, atol=tol)
    if query_len == 1:  # decode reads every cached K/V row of the step once
        read = num_reqs * seq_len * 2 * NUM_KV_HEADS * HEAD_SIZE * cache.element_size()
        row["cpu_cache_gb_per_s"] = read / row["cpu_ms"] / 1e6
    row["speedup"] = row["torch_ms"] / row["cpu_ms"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--layers", type=int, default=1, help="layers in the cache, read in turn (30: from DRAM)"
    )
    p.add_argument(
        "--kv-layout",
        choices=("layer", "block"),
        default="layer",
        help="cache memory layer-major (the CPU engine's) or block-major",
    )
    p.add_argument("--out", default="", help="JSON path (default: benchmarks/results/...)")
    ns = p.parse_args()
    from tandem_kernels import cpu

    if not cpu.available():
        raise SystemExit("the tandem CPU extension did not build")
    rows = []
    for dname in ns.dtypes.split(","):
        dtype = getattr(torch, dname)
        for label, r, ql, sl in SHAPES:
            row = {"shape": label, **run_shape(r, ql, sl, dtype, ns.iters, ns.layers, ns.kv_layout)}
            rows.append(row)
            extra = (
                f"  cache read {row['cpu_cache_gb_per_s']:.1f} GB/s"
                if "cpu_cache_gb_per_s" in row
                else ""
            )
            print(
                f"{label:26s} {row['dtype']:9s} torch {row['torch_ms']:8.3f} ms  "
                f"cpu {row['cpu_ms']:7.3f} ms ({row['cpu_gflops']:5.1f} GFLOP/s)  "
                f"x{row['speedup']:.1f}{extra}"
            )
    result = {
        "benchmark": "cpu_attention",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "heads": [NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE],
        "block_size": BLOCK_SIZE,
        "layers": ns.layers,
        "kv_layout": ns.kv_layout,
        "rows": rows,
    }
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = Path(ns.out or Path(__file__).parent / "results" / f"cpu_attention_{stamp}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
