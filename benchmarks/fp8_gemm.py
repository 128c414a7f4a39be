"""FP8 (e4m3) GEMMs through `torch._scaled_mm` against bf16 `F.linear`, on one GPU.

1. The ceilings: 8192^3 in bf16 and in e4m3 (per-tensor scales), burst (ten calls after
   three warm-ups) and held (back to back for `--sustain-s`, timed over the second half).
2. The llama-3.1-8b projections (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672,
   down 14336 -> 4096) at decode batch sizes and prefill token counts: bf16; e4m3 per-tensor;
   e4m3 rowwise (per-token x per-channel); each e4m3 variant with its dynamic activation
   quantization included (what a layer pays per call: tandem_kernels.fp8's Triton
   quantizers); and the weight-only 128x128 block-scaled Triton GEMM.

    python -m benchmarks.fp8_gemm --out benchmarks/results/fp8_gemm_h200_<date>.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu_throughput import device_ms
from tandem_kernels import fp8 as fp8_ops
from tandem_kernels.fp8_block_gemm import fp8_block_gemm

SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
DECODE_M = [1, 8, 32, 64, 128, 256]
PREFILL_M = [1024, 2048, 8192]


def burst_and_held_ms(fn: Callable[[], object], sustain_s: float) -> tuple[float, float]:
    """ms per call: ten calls after three warm-ups; and held for `sustain_s` (second half)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    burst = device_ms(fn, 10) / 10
    iters = max(int(sustain_s / 2 / (burst / 1e3)), 10)
    device_ms(fn, iters)
    return burst, device_ms(fn, iters) / iters


def ceilings(sustain_s: float) -> dict[str, Any]:
    n = 8192
    flops = 2 * n**3
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    aq, a_s = fp8_ops.quantize_per_tensor(a)
    bq, b_s = fp8_ops.quantize_per_tensor(b)
    out: dict[str, Any] = {}
    for name, fn in (
        ("bf16", lambda: F.linear(a, b)),
        ("e4m3", lambda: fp8_ops.fp8_scaled_mm(aq, bq, a_s, b_s)),
    ):
        burst, held = burst_and_held_ms(fn, sustain_s)
        out[name] = {"burst_tflops": flops / burst / 1e9, "held_tflops": flops / held / 1e9}
        print(
            f"8192^3 {name}: burst {flops / burst / 1e9:.0f}, held {flops / held / 1e9:.0f} TFLOP/s"
        )
    return out


def shape_rates(m: int, n: int, k: int, iters: int) -> dict[str, float]:
    """TFLOP/s of x[m, k] @ w[n, k]^T in each variant."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq_t, ws_t = fp8_ops.quantize_per_tensor(w)
    wq_c, ws_c = fp8_ops.quantize_per_row(w)
    xq_t, xs_t = fp8_ops.quantize_per_tensor(x)
    xq_c, xs_c = fp8_ops.quantize_per_row(x)
    wq_b, tiles = fp8_ops.quantize_per_block(w, (128, 128))
    ws_b = tiles.repeat_interleave(128, 0)[:n].contiguous()
    variants: dict[str, Callable[[], object]] = {
        "bf16": lambda: F.linear(x, w),
        "e4m3_tensor": lambda: fp8_ops.fp8_scaled_mm(xq_t, wq_t, xs_t, ws_t),
        "e4m3_rowwise": lambda: fp8_ops.fp8_scaled_mm(xq_c, wq_c, xs_c, ws_c),
        "e4m3_tensor+quant": lambda: _with_quant(fp8_ops.dynamic_quant_per_tensor, x, wq_t, ws_t),
        "e4m3_rowwise+quant": lambda: _with_quant(fp8_ops.dynamic_quant_per_token, x, wq_c, ws_c),
        # Block-scaled checkpoints: W8A16 through the Triton kernel.
        "e4m3_block128_w8a16": lambda: fp8_block_gemm(x, wq_b, ws_b, 128),
    }
    flops = 2 * m * n * k
    rates = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn()
        ms = device_ms(fn, iters) / iters
        rates[name] = flops / ms / 1e9
    return rates


def _with_quant(
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
) -> torch.Tensor:
    """What an FP8 layer runs per call: quantize the activations, then the scaled GEMM."""
    xq, xs = quantize(x)
    return fp8_ops.fp8_scaled_mm(xq, wq, xs, ws)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sustain-s", type=float, default=2.0)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--tokens", type=int, nargs="+", default=DECODE_M + PREFILL_M)
    p.add_argument("--out", default="")
    ns = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result: dict[str, Any] = {
        "benchmark": "fp8_gemm",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "ceilings_8192": ceilings(ns.sustain_s),
        "tflops": {},
        "speedup_vs_bf16": {},
    }
    for m in ns.tokens:
        for name, (n, k) in SHAPES_8B.items():
            rates = shape_rates(m, n, k, ns.iters)
            result["tflops"][f"{name}/M={m}"] = rates
            result["speedup_vs_bf16"][f"{name}/M={m}"] = {
                v: r / rates["bf16"] for v, r in rates.items() if v != "bf16"
            }
            print(
                f"{name:8s} M={m:5d}: "
                + ", ".join(f"{v} {r:.0f}" for v, r in rates.items())
                + " TFLOP/s",
                flush=True,
            )
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
