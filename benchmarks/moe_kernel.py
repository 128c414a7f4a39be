"""The fused MoE kernel's rate by tokens, beside dense bf16 GEMMs doing the same work.

For each layer shape (Qwen3-30B-A3B, Mixtral-8x7B) and token count T, with uniformly random
routing: the kernel's TFLOP/s (2 * T * k * 3 * H * I flops), the weight bytes of the experts
it touched per ms (GB/s, what bounds decode), and two dense references: one bf16 GEMM per
expert on its rows (the same flops as separate matmuls), and the same rows through one
expert's weights as two dense GEMMs (`dense_rows`: `[T * k, H] @ [H, 2I]`, then `[T * k, I] @
[I, H]`, the rate those shapes reach with no routing, padding or sum); and the 8192^3 bf16
ceiling and the device copy bandwidth measured in the same run, burst and held
(`measure_ceilings`: the held rates, what a long run gets, are the ones the shares use).
Configs are tuned first (as at engine start-up).

Each call is timed twice: eagerly (`ms`: with the host's launches and the routing's small
torch ops) and replayed from a CUDA graph as the engine's decode runs it (`graph_ms`: the
kernels' own rate). The graph holds `GRAPH_CALLS` calls, each on its own routing (as the
layers of a forward: the experts of one call are mostly not in L2 from the one before), and
its GB/s count the experts each call touched. Calls vouch every expert is local
(`all_experts_local=True`, as the layer without expert parallel does: no zero fill).

Where the grouped path serves a token count (a `MoEConfig` was tuned for its bucket), the two
forms of GEMM 1 are timed side by side (`forms`, eager): the fastest unfused and the fastest
SiLU-epilogue config of the tuner's timings for that bucket (weights through pointers), the
fastest with the weights through TMA (`b_tma`), and the tuned pick with the zero fill of GEMM
2's output (`zero_fill`, what it cost before the keyword). `--breakdown` adds each call's
device time by kernel (torch.profiler).

    python -m benchmarks.moe_kernel --tokens 1 8 64 512 4096 16384 --out moe.json

`--weights fp8` runs the experts as weight-only FP8 (e4m3, a scale per expert and row, as
`--quantization fp8` holds them), `--weights fp8-block` with a scale per expert and 128 x 128
tile (as block-scaled checkpoints store them): their GB/s count one byte a weight.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.gpu_throughput import device_ms, measure_ceilings

if TYPE_CHECKING:
    from tandem_kernels.fused_moe import FusedMoEConfig

GRAPH_CALLS = 8

SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


# FP8 experts' scales by their w13's address (`--weights fp8`, `fp8-block`): `_scales(w13)`
# gives the keywords every fused_moe call of those weights takes (with the block size).
_FP8_SCALES: dict[int, dict[str, Any]] = {}
BLOCK = (128, 128)


def _scales(w13: torch.Tensor) -> dict[str, Any]:
    return _FP8_SCALES.get(w13.data_ptr(), {})


def _routing(
    tokens: int, hidden: int, num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(tokens, num_experts, device="cuda")
    weights, ids = scores.topk(top_k, dim=-1)
    return x, weights, ids.to(torch.int32)


def _graph_ms(
    w13: torch.Tensor, w2: torch.Tensor, routings: list[tuple[torch.Tensor, ...]], iters: int
) -> float:
    """Device ms per call: one call per routing captured in a CUDA graph, replayed."""
    from tandem_kernels.fused_moe import fused_moe

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x, weights, ids in routings:
            fused_moe(x, w13, w2, weights, ids, all_experts_local=True, **_scales(w13))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, weights, ids in routings:
            fused_moe(x, w13, w2, weights, ids, all_experts_local=True, **_scales(w13))
    graph.replay()
    return device_ms(graph.replay, iters) / iters / len(routings)


def _measure(
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, tokens: int, iters: int
) -> dict[str, Any]:
    from tandem_kernels.fused_moe import fused_moe

    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    routings = [_routing(tokens, hidden, num_experts, top_k) for _ in range(GRAPH_CALLS)]
    x, weights, ids = routings[0]
    fused_moe(x, w13, w2, weights, ids, all_experts_local=True, **_scales(w13))
    ms = device_ms(
        lambda: fused_moe(x, w13, w2, weights, ids, all_experts_local=True, **_scales(w13)), iters
    )
    ms /= iters
    graph_ms = _graph_ms(w13, w2, routings, iters)
    flops = 2 * tokens * top_k * 3 * hidden * inter
    expert_bytes = 3 * hidden * inter * w13.element_size()
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * expert_bytes
    graph_bytes = sum(int(torch.unique(r[2]).numel()) for r in routings) / len(routings)
    graph_bytes *= expert_bytes
    # Dense reference: one bf16 GEMM per touched expert over its rows (the same flops; FP8
    # experts' dequantized weights).
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts).tolist()
    xs = [torch.randn(c, hidden, device="cuda", dtype=torch.bfloat16) for c in counts]
    dense_w13, dense_w2 = w13, w2
    scales = _scales(w13)
    if scales.get("weight_block_size"):
        from tandem_kernels.moe_ref import dequantize_expert_blocks

        dense_w13 = dequantize_expert_blocks(w13, scales["w13_scale"], BLOCK, torch.bfloat16)
        dense_w2 = dequantize_expert_blocks(w2, scales["w2_scale"], BLOCK, torch.bfloat16)
    elif scales:
        from tandem_kernels.moe_ref import dequantize_expert_rows

        dense_w13 = dequantize_expert_rows(w13, scales["w13_scale"], torch.bfloat16)
        dense_w2 = dequantize_expert_rows(w2, scales["w2_scale"], torch.bfloat16)

    def dense() -> None:
        for e, xe in enumerate(xs):
            if xe.shape[0]:
                h = torch.nn.functional.linear(xe, dense_w13[e])
                torch.nn.functional.linear(h[:, :inter], dense_w2[e])

    dense()
    dense_ms = device_ms(dense, iters) / iters
    rows = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(tokens * top_k, inter, device="cuda", dtype=torch.bfloat16)

    def dense_rows() -> None:
        torch.nn.functional.linear(rows, dense_w13[0])
        torch.nn.functional.linear(act, dense_w2[0])

    dense_rows()
    dense_rows_ms = device_ms(dense_rows, iters) / iters
    return {
        "ms": ms,
        "tflops": flops / (ms / 1e3) / 1e12,
        "weight_GBps": weight_bytes / (ms / 1e3) / 1e9,
        "experts_touched": touched,
        "graph_ms": graph_ms,
        "graph_tflops": flops / (graph_ms / 1e3) / 1e12,
        "graph_weight_GBps": graph_bytes / (graph_ms / 1e3) / 1e9,
        "dense_per_expert_ms": dense_ms,
        "dense_per_expert_tflops": flops / (dense_ms / 1e3) / 1e12,
        "dense_rows_ms": dense_rows_ms,
        "dense_rows_tflops": flops / (dense_rows_ms / 1e3) / 1e12,
    }


def _forms(
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    tokens: int,
    iters: int,
    tuned: FusedMoEConfig | None,
) -> dict[str, Any]:
    """Eager ms and TFLOP/s of the fastest unfused and SiLU-epilogue configs the tuner timed
    for this token count's bucket, of the torch grouped-GEMM path where it was timed, and of
    the tuned pick with the zero fill; {} where the bucket is on the decode path or has no
    tuning entry."""
    from tandem_kernels.fused_moe import (
        GroupedMMConfig,
        MoEConfig,
        config_from_name,
        config_name,
        fused_moe,
        token_bucket,
        tuning_log,
    )

    if not isinstance(tuned, MoEConfig | GroupedMMConfig):
        return {}
    num_experts, two_inter, hidden = w13.shape
    key: list[object] = [num_experts, two_inter, hidden, top_k, str(w13.dtype)]
    if _scales(w13).get("weight_block_size"):
        key.append(f"block:{BLOCK[0]}x{BLOCK[1]}")
    bucket = token_bucket(tokens)
    entry = next((e for e in tuning_log if e["key"] == key and e["num_tokens"] == bucket), None)
    if entry is None:
        return {}
    ms_of: dict[str, float] = entry["ms"]
    timed = {n: config_from_name(n) for n in ms_of}
    x, weights, ids = _routing(tokens, hidden, num_experts, top_k)
    flops = 2 * tokens * top_k * 3 * hidden * (two_inter // 2)

    def rate(config: FusedMoEConfig, all_experts_local: bool) -> dict[str, Any]:
        def run() -> None:
            fused_moe(
                x,
                w13,
                w2,
                weights,
                ids,
                config,
                all_experts_local=all_experts_local,
                **_scales(w13),
            )

        run()
        ms = device_ms(run, iters) / iters
        return {"config": config_name(config), "ms": ms, "tflops": flops / (ms / 1e3) / 1e12}

    forms: dict[str, Any] = {}
    for form, silu in (("unfused", False), ("silu_epilogue", True)):
        names = [
            n
            for n, c in timed.items()
            if isinstance(c, MoEConfig) and c.silu_in_epilogue == silu and not c.b_tma
        ]
        if names:
            best = min(names, key=ms_of.__getitem__)
            forms[form] = rate(timed[best], all_experts_local=True)
    tma = [n for n, c in timed.items() if isinstance(c, MoEConfig) and c.b_tma]
    if tma:
        forms["b_tma"] = rate(timed[min(tma, key=ms_of.__getitem__)], all_experts_local=True)
    if any(isinstance(c, GroupedMMConfig) for c in timed.values()):
        forms["grouped_mm"] = rate(GroupedMMConfig(), all_experts_local=True)
    forms["zero_fill"] = rate(tuned, all_experts_local=False)
    return forms


def _breakdown(
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, tokens: int, calls: int = 10
) -> list[dict[str, Any]]:
    """Device microseconds a call by kernel (torch.profiler over `calls` eager calls of the
    tuned config), costliest first: where a call's time goes (alignment, GEMMs, SiLU, sum)."""
    from torch.profiler import ProfilerActivity, profile

    from tandem_kernels.fused_moe import fused_moe

    num_experts, _, hidden = w13.shape
    x, weights, ids = _routing(tokens, hidden, num_experts, top_k)
    fused_moe(x, w13, w2, weights, ids, all_experts_local=True, **_scales(w13))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fused_moe(x, w13, w2, weights, ids, all_experts_local=True, **_scales(w13))
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0)
        if t > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"kernel": evt.key[:100], "us": t / calls, "launches": evt.count / calls})
    return sorted(rows, key=lambda r: -r["us"])


def main() -> None:
    from tandem_kernels.fused_moe import config_name, token_bucket, tune_fused_moe, tuning_log

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096, 16384])
    p.add_argument("--shapes", nargs="+", default=sorted(SHAPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--sustain-s", type=float, default=1.0, help="the ceilings' held time")
    p.add_argument(
        "--weights",
        choices=("bf16", "fp8", "fp8-block"),
        default="bf16",
        help="fp8: experts in e4m3 with a scale per expert and row (bf16 activations); "
        "fp8-block: a scale per expert and 128 x 128 tile, as Qwen3-30B-A3B-FP8 stores them",
    )
    p.add_argument(
        "--breakdown", action="store_true", help="device time a call by kernel (torch.profiler)"
    )
    ns = p.parse_args()
    ceilings = measure_ceilings(ns.sustain_s)
    result: dict[str, Any] = {
        "benchmark": "moe_kernel",
        "device": torch.cuda.get_device_name(),
        "weights": ns.weights,
        "ceilings": ceilings,
        "ceiling_8192_tflops": ceilings["bf16_matmul_tflops"],
        "copy_GBps": ceilings["copy_bandwidth_gbs"],
        "shapes": {},
    }
    print(
        f"held ceiling {result['ceiling_8192_tflops']:.0f} TFLOP/s "
        f"(burst {ceilings['burst']['bf16_matmul_tflops']:.0f}), "
        f"fp8 {ceilings['fp8_matmul_tflops']:.0f}, copy {result['copy_GBps']:.0f} GB/s "
        f"(burst {ceilings['burst']['copy_bandwidth_gbs']:.0f})",
        flush=True,
    )
    for name in ns.shapes:
        num_experts, top_k, hidden, inter = SHAPES[name]
        w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
        if ns.weights == "fp8":
            from tandem_kernels.fp8 import quantize_expert_rows

            (w13, s13), (w2, s2) = quantize_expert_rows(w13), quantize_expert_rows(w2)
            _FP8_SCALES[w13.data_ptr()] = {"w13_scale": s13, "w2_scale": s2}
        elif ns.weights == "fp8-block":
            from tandem_kernels.fp8 import quantize_expert_blocks

            (w13, s13), (w2, s2) = (
                quantize_expert_blocks(w13, BLOCK),
                quantize_expert_blocks(w2, BLOCK),
            )
            _FP8_SCALES[w13.data_ptr()] = {
                "w13_scale": s13,
                "w2_scale": s2,
                "weight_block_size": BLOCK,
            }
        tuned = tune_fused_moe(w13, w2, top_k, max_tokens=max(ns.tokens), **_scales(w13))
        rows: dict[str, Any] = {}
        for tokens in ns.tokens:
            r = _measure(w13, w2, top_k, tokens, ns.iters)
            chosen = tuned.get(token_bucket(tokens))
            r["config"] = "untuned" if chosen is None else config_name(chosen)
            rows[str(tokens)] = r
            copy = result["copy_GBps"]
            print(
                f"{name} T={tokens} [{r['config']}]: eager {r['ms']:.3f} ms, "
                f"{r['tflops']:.0f} TFLOP/s "
                f"({100 * r['tflops'] / result['ceiling_8192_tflops']:.0f}% of held), "
                f"{r['weight_GBps']:.0f} GB/s of weights "
                f"({100 * r['weight_GBps'] / copy:.0f}% of copy); "
                f"graph {r['graph_ms']:.3f} ms, {r['graph_weight_GBps']:.0f} GB/s "
                f"({100 * r['graph_weight_GBps'] / copy:.0f}% of copy), "
                f"{r['graph_tflops']:.0f} TFLOP/s; "
                f"dense per-expert {r['dense_per_expert_tflops']:.0f} TFLOP/s, "
                f"dense same rows {r['dense_rows_tflops']:.0f} TFLOP/s",
                flush=True,
            )
            if ns.breakdown:
                r["breakdown"] = _breakdown(w13, w2, top_k, tokens)
                total = sum(b["us"] for b in r["breakdown"])
                print(f"  {name} T={tokens} device {total:.1f} us a call by kernel:", flush=True)
                for b in r["breakdown"][:12]:
                    print(f"    {b['us']:8.1f} us  x{b['launches']:.0f}  {b['kernel']}")
            forms = _forms(w13, w2, top_k, tokens, ns.iters, chosen)
            if forms:
                r["forms"] = forms
                ceiling = result["ceiling_8192_tflops"]
                print(
                    f"  {name} T={tokens} forms (eager): "
                    + "; ".join(
                        f"{form} [{f['config']}] {f['ms']:.3f} ms, {f['tflops']:.0f} TFLOP/s "
                        f"({100 * f['tflops'] / ceiling:.0f}%)"
                        for form, f in forms.items()
                    ),
                    flush=True,
                )
        result["shapes"][name] = rows
    result["tuning"] = tuning_log
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
