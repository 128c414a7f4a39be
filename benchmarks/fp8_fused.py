"""FP8 activation quantization fused into the op before the linear (tandem_kernels.fp8_fused)
against the unfused pair (the bf16 op, then tandem_kernels.fp8's quantizer), on one GPU, at
the llama-3.1-8b sizes: residual-add + RMSNorm over hidden 4096 (before qkv and gate_up) and
SiLU-and-mul over intermediate 14336 (before down; 7168 per rank under TP 2), bf16 in.

Per op and token count M: the bf16 op alone (what an unquantized model runs), unfused and
fused with per-token scales (ptpc_fp8) and per-tensor dynamic scales (fp8: the fused norm and
activation take two passes). Each variant is captured in a CUDA graph of `--calls` calls and
timed over replays (as the engine runs them), so launch overheads count as they do there.

    python -m benchmarks.fp8_fused --out benchmarks/results/fp8_fused_h200_<date>.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_throughput import device_ms
from tandem_kernels import fp8 as fp8_ops
from tandem_kernels.activation import silu_and_mul
from tandem_kernels.fp8_fused import rms_norm_fp8, silu_and_mul_fp8
from tandem_kernels.rms_norm import fused_add_rms_norm

HIDDEN = 4096
INTERMEDIATE = [14336, 7168]
TOKENS = [1, 8, 32, 128, 256, 1024, 4096, 8192]


def graph_us(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Microseconds per call of `fn`, `calls` of them captured in one CUDA graph, timed over
    `replays` replays after three warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return device_ms(graph.replay, replays) * 1e3 / replays / calls


def norm_variants(m: int) -> dict[str, Callable[[], object]]:
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def unfused(quant: Callable[[torch.Tensor], object]) -> Callable[[], object]:
        return lambda: quant(fused_add_rms_norm(x, residual, weight, 1e-5)[0])

    return {
        "bf16": lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
        "unfused_token": unfused(fp8_ops.dynamic_quant_per_token),
        "fused_token": lambda: rms_norm_fp8(x, residual, weight, 1e-5, "token"),
        "unfused_tensor": unfused(fp8_ops.dynamic_quant_per_tensor),
        "fused_tensor": lambda: rms_norm_fp8(x, residual, weight, 1e-5, "tensor"),
    }


def act_variants(m: int, inter: int) -> dict[str, Callable[[], object]]:
    x = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    return {
        "bf16": lambda: silu_and_mul(x),
        "unfused_token": lambda: fp8_ops.dynamic_quant_per_token(silu_and_mul(x)),
        "fused_token": lambda: silu_and_mul_fp8(x, "token"),
        "unfused_tensor": lambda: fp8_ops.dynamic_quant_per_tensor(silu_and_mul(x)),
        "fused_tensor": lambda: silu_and_mul_fp8(x, "tensor"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--calls", type=int, default=20, help="calls captured per graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default="")
    ns = p.parse_args()
    result: dict[str, Any] = {
        "benchmark": "fp8_fused",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "us_per_call": {},
        "fused_speedup": {},
    }
    cases: list[tuple[str, Callable[[int], dict[str, Callable[[], object]]]]] = [
        (f"add_rms_norm/H={HIDDEN}", norm_variants),
        *((f"silu_and_mul/I={i}", lambda m, i=i: act_variants(m, i)) for i in INTERMEDIATE),
    ]
    for m in ns.tokens:
        for name, make in cases:
            times = {v: graph_us(fn, ns.calls, ns.replays) for v, fn in make(m).items()}
            key = f"{name}/M={m}"
            result["us_per_call"][key] = times
            result["fused_speedup"][key] = {
                s: times[f"unfused_{s}"] / times[f"fused_{s}"] for s in ("token", "tensor")
            }
            print(
                f"{key:28s} " + ", ".join(f"{v} {t:.1f}" for v, t in times.items()) + " us",
                flush=True,
            )
            torch.cuda.empty_cache()
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
