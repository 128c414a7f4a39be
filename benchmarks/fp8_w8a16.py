"""Small-batch FP8 linear layers on the GPU: the W8A16 Triton kernel's tuned configs against
the scaled-GEMM path (activation quantization + `torch._scaled_mm`, per tensor and per token)
and against the bf16 GEMM, at the 8B model's four shapes and each batch bucket the FP8 layers
tune at load. L2 is flushed before every timed call (decode reads each weight from HBM).

    python -m benchmarks.fp8_w8a16 --out fp8_w8a16.json

Prints, per shape and batch: microseconds of bf16, the scaled path, the best W8A16 config, and
the weight bytes read per second by the path the layer picks.
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


def main() -> None:
    from tandem_kernels import fp8, fp8_w8a16

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ns = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: dict[str, Any] = {}
    for name, (n, k) in SHAPES_8B.items():
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        bf16_copies = [w] + [w.clone() for _ in range(-(-(256 << 20) // (2 * n * k)) - 1)]
        for strategy in ("tensor", "token"):
            if strategy == "tensor":
                wq, ws = fp8.quantize_per_tensor(w)

                def base(x: torch.Tensor, wq: torch.Tensor, ws=ws) -> torch.Tensor:
                    xq, xs = fp8.dynamic_quant_per_tensor(x)
                    return fp8.fp8_scaled_mm(xq, wq, xs, ws, None, x.dtype)
            else:
                wq, ws = fp8.quantize_per_row(w)

                def base(x: torch.Tensor, wq: torch.Tensor, ws=ws) -> torch.Tensor:
                    xq, xs = fp8.dynamic_quant_per_token(x)
                    return fp8.fp8_scaled_mm(xq, wq, xs, ws, None, torch.bfloat16)

            fp8_w8a16.tune_w8a16(wq, ws, torch.bfloat16, f"bench/{strategy}", base)
            record = fp8_w8a16.tuning_log[-1]
            for b in fp8_w8a16.M_BUCKETS:
                x = torch.randn(b, k, device=dev, generator=gen).to(torch.bfloat16)
                entry = record["us"][str(b)]  # type: ignore[index]
                if strategy == "tensor":
                    entry["bf16_us"] = fp8_w8a16._time(
                        [lambda x=x, w=w: F.linear(x, w) for w in bf16_copies]
                    )
                picked = entry["best_us"] if entry["use"] == "w8a16" else entry["baseline"]
                if picked:
                    entry["picked_weight_tb_s"] = n * k / (picked * 1e-6) / 1e12
                print(
                    f"{name:8s} {strategy:6s} M={b:4d} bf16 {entry.get('bf16_us') or 0:7.1f} us "
                    f"scaled {entry['baseline'] or 0:7.1f} us  w8a16 {entry['best_us'] or 0:7.1f}"
                    f" us ({entry['best']})  -> {entry['use']}",
                    flush=True,
                )
                rows[f"{name}/{strategy}/M={b}"] = entry
    result = {
        "benchmark": "fp8_w8a16",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "rows": rows,
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
