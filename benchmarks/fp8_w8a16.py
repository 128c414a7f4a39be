"""Small-batch FP8 linear layers on the GPU, against the weight-read bound: at the 8B model's
four shapes and M = 1, 2, 4, 8, 16, the microseconds, weight bytes read per second and share
of the device's held copy bandwidth of

    bf16        F.linear on the bf16 weight (2 bytes a weight)
    scaled      dynamic activation quantization + `torch._scaled_mm`, per tensor and per
                token (the FP8 layer's own path)
    old         the W8A16 candidates before split-K (unsplit tensor-core tiles, and the first
                GEMV form's tiles run as unsplit GEMVs), best of them
    new         `fp8_w8a16.candidates(bucket)`, what the tuner picks from at load: best of
                all, and the best GEMV, split tensor-core and unsplit tensor-core config

and, on down_proj's shape at M = 1, 2, 4 with the best new config: the SiLU-and-mul kernel
then the GEMM, against the GEMM computing the SiLU-and-mul as it reads (`gated`).

Each timed as the tuner times it (`fp8_w8a16.time_in_graph`): back to back in a CUDA graph over
weight copies that overflow L2, so every weight comes from HBM as in decode. Every candidate's
time is kept in the JSON. About two minutes on an H200.

    python -m benchmarks.fp8_w8a16 --out fp8_w8a16.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

import torch
import torch.nn.functional as F

SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
BATCHES = (1, 2, 4, 8, 16)


def _old_candidates(b: int) -> list[Any]:
    """The candidate list as it stood before split-K (commit 92c1de8), in today's Config."""
    from tandem_kernels.fp8_w8a16 import Config

    dot = [
        (16, 16, 256, 4, 4),
        (16, 32, 256, 4, 4),
        (16, 32, 512, 4, 3),
        (16, 64, 256, 4, 4),
        (16, 16, 512, 4, 3),
        (16, 64, 128, 4, 4),
        (16, 32, 128, 2, 8),
        (16, 32, 1024, 8, 3),
    ]
    gemv = [(b, 8, 512, 4, 1), (b, 16, 512, 4, 1), (b, 16, 1024, 8, 1), (b, 4, 1024, 4, 1)]
    tiles = (gemv if b <= 4 else []) + dot
    return [Config(bm, bn, bk, 1, w, s) for bm, bn, bk, w, s in tiles]


def _family(config: Any) -> str:
    if config.block_m < 16:
        return "gemv"
    return "dot_split" if config.split_k > 1 else "dot"


def _rate(us: float | None, weight_bytes: int, copy_gbs: float) -> dict[str, float | None]:
    if us is None:
        return {"us": None, "weight_gbs": None, "pct_of_copy": None}
    gbs = weight_bytes / (us * 1e-6) / 1e9
    return {"us": us, "weight_gbs": gbs, "pct_of_copy": 100.0 * gbs / copy_gbs}


def _best(
    configs: list[Any], timed: dict[Any, float | None], weight_bytes: int, copy_gbs: float
) -> dict[str, Any]:
    ok = [c for c in configs if timed[c] is not None]
    if not ok:
        return {"config": None, **_rate(None, weight_bytes, copy_gbs)}
    c = min(ok, key=lambda c: timed[c])
    return {"config": c.name, **_rate(timed[c], weight_bytes, copy_gbs)}


def _scaled_tensor(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    from tandem_kernels import fp8

    xq, xs = fp8.dynamic_quant_per_tensor(x)
    return fp8.fp8_scaled_mm(xq, wq, xs, ws, None, x.dtype)


def _scaled_token(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    from tandem_kernels import fp8

    xq, xs = fp8.dynamic_quant_per_token(x)
    return fp8.fp8_scaled_mm(xq, wq, xs, ws, None, torch.bfloat16)


def bench_shape(n: int, k: int, copy_gbs: float, gen: torch.Generator) -> dict[int, dict[str, Any]]:
    """Every path at every batch of `BATCHES` on one `[n, k]` weight."""
    from tandem_kernels import fp8, fp8_w8a16

    dev = torch.device("cuda")
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    bf16_copies = [w] + [w.clone() for _ in range(-(-(256 << 20) // (2 * n * k)) - 1)]
    wq_t, ws_t = fp8.quantize_per_tensor(w)
    wq_c, ws_c = fp8.quantize_per_row(w)
    copies_t = fp8_w8a16.weight_copies(wq_t)
    copies_c = fp8_w8a16.weight_copies(wq_c)
    locks = fp8_w8a16.w8a16_locks(n, dev)
    fp8_bytes, bf16_bytes = n * k, 2 * n * k
    out: dict[int, dict[str, Any]] = {}
    for m in BATCHES:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        entry: dict[str, Any] = {"n": n, "k": k, "m": m}
        runs = {
            "bf16": ([lambda x=x, w=w: F.linear(x, w) for w in bf16_copies], bf16_bytes),
            "scaled_tensor": (
                [lambda x=x, w=w: _scaled_tensor(x, w, ws_t) for w in copies_t],
                fp8_bytes,
            ),
            "scaled_token": (
                [lambda x=x, w=w: _scaled_token(x, w, ws_c) for w in copies_c],
                fp8_bytes,
            ),
        }
        for key, (calls, weight_bytes) in runs.items():
            entry[key] = _rate(fp8_w8a16.time_in_graph(calls), weight_bytes, copy_gbs)
        new = list(fp8_w8a16.candidates(m))
        old = _old_candidates(m)
        timed = {
            c: fp8_w8a16.time_config(x, copies_t, ws_t, c, locks) for c in dict.fromkeys(new + old)
        }
        entry["candidates_us"] = {c.name: t for c, t in timed.items()}
        entry["old"] = _best(old, timed, fp8_bytes, copy_gbs)
        entry["new"] = _best(new, timed, fp8_bytes, copy_gbs)
        for family in ("gemv", "dot_split", "dot"):
            family_configs = [c for c in new if _family(c) == family]
            entry[f"new_{family}"] = _best(family_configs, timed, fp8_bytes, copy_gbs)
        out[m] = entry
    return out


def _silu_then_gemm(
    gate_up: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, c: Any, locks: torch.Tensor
) -> torch.Tensor:
    from tandem_kernels.activation import silu_and_mul
    from tandem_kernels.fp8_w8a16 import w8a16_gemm

    return w8a16_gemm(silu_and_mul(gate_up), w, ws, c, locks)


def bench_gated(
    n: int, k: int, configs: dict[int, str], gen: torch.Generator
) -> dict[int, dict[str, Any]]:
    """down_proj's input: the SiLU-and-mul kernel then the W8A16 GEMM, against the GEMM
    computing it as it reads `gate_up` (`gated`), with `configs[m]` (a config's name)."""
    from tandem_kernels import fp8, fp8_w8a16

    dev = torch.device("cuda")
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    wq, ws = fp8.quantize_per_tensor(w)
    copies = fp8_w8a16.weight_copies(wq)
    locks = fp8_w8a16.w8a16_locks(n, dev)
    by_name = {c.name: c for b in fp8_w8a16.M_BUCKETS for c in fp8_w8a16.candidates(b)}
    out: dict[int, dict[str, Any]] = {}
    for m, name in configs.items():
        c = by_name[name]
        gate_up = torch.randn(m, 2 * k, device=dev, generator=gen).to(torch.bfloat16)
        unfused = fp8_w8a16.time_in_graph(
            [lambda w=w, x=gate_up, c=c: _silu_then_gemm(x, w, ws, c, locks) for w in copies]
        )
        gated = fp8_w8a16.time_in_graph(
            [
                lambda w=w, x=gate_up, c=c: fp8_w8a16.w8a16_gemm(x, w, ws, c, locks, gated=True)
                for w in copies
            ]
        )
        out[m] = {"config": name, "silu_then_gemm_us": unfused, "gated_us": gated}
    return out


def _show(entry: dict[str, Any], key: str) -> str:
    r = entry[key]
    if r["us"] is None:
        return f"{key} -"
    cfg = f" ({r['config']})" if "config" in r else ""
    return f"{key} {r['us']:6.1f} us {r['pct_of_copy']:3.0f}%{cfg}"


def main() -> None:
    from benchmarks.gpu_throughput import measure_ceilings

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ap.add_argument("--sustain-s", type=float, default=0.5, help="the copy ceiling's held time")
    ns = ap.parse_args()
    ceilings = measure_ceilings(ns.sustain_s)
    copy_gbs = ceilings["copy_bandwidth_gbs"]
    print(f"held copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: dict[str, Any] = {}
    for name, (n, k) in SHAPES_8B.items():
        for m, entry in bench_shape(n, k, copy_gbs, gen).items():
            rows[f"{name}/M={m}"] = entry
            print(
                f"{name:7s} M={m:2d} | "
                + " | ".join(_show(entry, key) for key in ("bf16", "scaled_tensor", "old", "new"))
                + f" | new {entry['new']['weight_gbs'] or 0:5.0f} GB/s",
                flush=True,
            )
        torch.cuda.empty_cache()
    n, k = SHAPES_8B["down"]
    picks = {m: rows[f"down/M={m}"]["new"]["config"] for m in (1, 2, 4)}
    gated = bench_gated(n, k, {m: c for m, c in picks.items() if c}, gen)
    for m, g in gated.items():
        print(
            f"down    M={m:2d} | SiLU-and-mul + GEMM {g['silu_then_gemm_us'] or 0:6.1f} us | "
            f"gated GEMM {g['gated_us'] or 0:6.1f} us ({g['config']})",
            flush=True,
        )
    result = {
        "benchmark": "fp8_w8a16",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "ceilings": ceilings,
        "rows": rows,
        "down_gated": gated,
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
