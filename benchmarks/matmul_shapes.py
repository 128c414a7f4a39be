"""bf16 matmul rate of a model's four per-layer projections at several token counts.

Tells how the step's token budget (prefill chunks of M tokens) and the decode batch move the
projections' efficiency against the 8192^3 ceiling measured in the same run. Shapes of the
llama-3.1-8b config by default: qkv (4096 -> 6144), o (4096 -> 4096), gate_up
(4096 -> 2 x 14336), down (14336 -> 4096).

    python -m benchmarks.matmul_shapes --tokens 1024 8192 16384 --out matmul.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_throughput import device_ms


def _rate(m: int, n: int, k: int, iters: int) -> float:
    """TFLOP/s of x[m, k] @ w[n, k]^T (F.linear, as the model runs it)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    ms = device_ms(lambda: torch.nn.functional.linear(x, w), iters)
    return 2 * m * n * k * iters / (ms / 1e3) / 1e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 8192, 16384])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--qkv", type=int, default=6144)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="")
    ns = p.parse_args()
    h = ns.hidden
    shapes = {
        "qkv": (ns.qkv, h),
        "o": (h, h),
        "gate_up": (2 * ns.intermediate, h),
        "down": (h, ns.intermediate),
    }
    result: dict[str, Any] = {
        "benchmark": "matmul_shapes",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "ceiling_8192_tflops": _rate(8192, 8192, 8192, ns.iters),
        "tflops": {},
    }
    print(f"8192^3: {result['ceiling_8192_tflops']:.0f} TFLOP/s", flush=True)
    for m in ns.tokens:
        rates = {name: _rate(m, n, k, ns.iters) for name, (n, k) in shapes.items()}
        flops = {name: 2 * m * n * k for name, (n, k) in shapes.items()}
        layer = sum(flops.values()) / sum(flops[s] / rates[s] for s in shapes)
        result["tflops"][str(m)] = {**rates, "layer": layer}
        print(
            f"M={m}: "
            + ", ".join(f"{s} {r:.0f}" for s, r in rates.items())
            + f"; layer {layer:.0f}",
            flush=True,
        )
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
