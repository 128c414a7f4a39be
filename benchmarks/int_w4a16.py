"""Integer-weight linear layers (GPTQ / AWQ / compressed-tensors kept quantized) on the GPU,
against bf16 and the weight-read bound: at the 8B model's four shapes and M = 1, 8, 32 (by
default; prefill sizes with `--batches`), the microseconds, bytes read per second, share of
the device's held copy bandwidth and TFLOP/s of

    bf16      F.linear on the bf16 weight (2 bytes a weight)
    int       tandem_kernels.int_w4a16 (4 bits in groups of 128 by default: half a byte a
              weight, plus a bf16 scale and zero point per group): the best of
              `int_w4a16.candidates(bucket)`, what the tuner picks from at load, and the
              untuned default config; every candidate's time is kept in the JSON

Bytes a call reads: the weight as each path holds it (int: packed values, scales, zero
points). Each timed as the tuner times it (`fp8_w8a16.time_in_graph`): back to back in a CUDA
graph over weight copies that overflow L2, so every weight comes from HBM as in decode.

    python -m benchmarks.int_w4a16 --out int_w4a16.json [--bits 8 --group-size -1]
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
BATCHES = (1, 8, 32)


def _rate(
    us: float | None, weight_bytes: int, copy_gbs: float, flops: float = 0.0
) -> dict[str, float | None]:
    if us is None:
        return {"us": None, "gbs": None, "pct_of_copy": None, "tflops": None}
    gbs = weight_bytes / (us * 1e-6) / 1e9
    tflops = flops / (us * 1e-6) / 1e12
    return {"us": us, "gbs": gbs, "pct_of_copy": 100.0 * gbs / copy_gbs, "tflops": tflops}


def bench_shape(
    n: int,
    k: int,
    bits: int,
    group_size: int,
    batches: tuple[int, ...],
    copy_gbs: float,
    gen: torch.Generator,
) -> dict[int, dict[str, Any]]:
    """bf16 and the integer kernel's candidates at every batch of `batches` on one `[n, k]`
    weight."""
    from tandem_kernels import fp8_w8a16, int_w4a16

    dev = torch.device("cuda")
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    bf16_copies = fp8_w8a16.weight_copies(w)
    groups = 1 if group_size == -1 else k // group_size
    q = torch.randint(0, 1 << bits, (n, k), device=dev, generator=gen)
    qweight = int_w4a16.pack_int_weight(q, bits)
    del q
    # The layer's layout: [G, N] contiguous, passed transposed.
    scale = (0.001 * torch.rand(groups, n, device=dev, generator=gen)).to(torch.bfloat16).t()
    zero = torch.full((groups, n), 1 << (bits - 1), device=dev, dtype=torch.bfloat16).t()
    copies = fp8_w8a16.weight_copies(qweight)
    locks = int_w4a16.w4a16_locks(n, dev)
    bf16_bytes = 2 * n * k
    int_bytes = qweight.numel() + 2 * 2 * n * groups
    out: dict[int, dict[str, Any]] = {}
    for m in batches:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        entry: dict[str, Any] = {"n": n, "k": k, "m": m, "bits": bits, "group_size": group_size}
        calls = [lambda x=x, w=w: F.linear(x, w) for w in bf16_copies]
        flops = 2.0 * m * n * k
        entry["bf16"] = _rate(fp8_w8a16.time_in_graph(calls), bf16_bytes, copy_gbs, flops)
        configs = int_w4a16.candidates(int_w4a16.bucket(m), k, group_size)
        timed = {
            c: fp8_w8a16.time_in_graph(
                [
                    lambda x=x, w=qw, c=c: int_w4a16.w4a16_gemm(
                        x, w, scale, zero, bits, group_size, c, locks
                    )
                    for qw in copies
                ]
            )
            for c in configs
        }
        entry["candidates_us"] = {c.name: t for c, t in timed.items()}
        ok = {c: t for c, t in timed.items() if t is not None}
        best = min(ok, key=ok.__getitem__) if ok else None
        entry["int"] = {
            "config": best.name if best else None,
            **_rate(ok.get(best) if best else None, int_bytes, copy_gbs, flops),
        }
        default = int_w4a16.default_config(m, k, group_size)
        entry["int_default"] = {
            "config": default.name,
            **_rate(timed.get(default), int_bytes, copy_gbs, flops),
        }
        bf16_us, int_us = entry["bf16"]["us"], entry["int"]["us"]
        entry["speedup_vs_bf16"] = bf16_us / int_us if bf16_us and int_us else None
        out[m] = entry
    return out


def _show(entry: dict[str, Any], key: str) -> str:
    r = entry[key]
    if r["us"] is None:
        return f"{key} -"
    cfg = f" ({r['config']})" if "config" in r else ""
    return (
        f"{key} {r['us']:7.1f} us {r['gbs']:5.0f} GB/s {r['pct_of_copy']:3.0f}% "
        f"{r['tflops']:5.0f} TFLOP/s{cfg}"
    )


def main() -> None:
    from benchmarks.gpu_throughput import measure_ceilings

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--sustain-s", type=float, default=0.5, help="the copy ceiling's held time")
    ns = ap.parse_args()
    batches = tuple(int(b) for b in ns.batches.split(","))
    ceilings = measure_ceilings(ns.sustain_s)
    copy_gbs = ceilings["copy_bandwidth_gbs"]
    print(f"held copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: dict[str, Any] = {}
    for name, (n, k) in SHAPES_8B.items():
        for m, entry in bench_shape(n, k, ns.bits, ns.group_size, batches, copy_gbs, gen).items():
            rows[f"{name}/M={m}"] = entry
            speedup = entry["speedup_vs_bf16"]
            print(
                f"{name:7s} M={m:4d} | "
                + " | ".join(_show(entry, key) for key in ("bf16", "int", "int_default"))
                + (f" | x{speedup:.2f} vs bf16" if speedup else ""),
                flush=True,
            )
        torch.cuda.empty_cache()
    result = {
        "benchmark": "int_w4a16",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bits": ns.bits,
        "group_size": ns.group_size,
        "ceilings": ceilings,
        "rows": rows,
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
