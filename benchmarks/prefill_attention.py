"""The paged prefill attention kernel against torch SDPA on dense K/V (GPU, bf16).

For each shape (requests x new tokens, over cached context tokens), checks the kernel
against SDPA, then times SDPA, the kernel's default config and each tile config. Causal
FLOPs (QK^T and PV over the visible keys) over the median time give TFLOP/s.

`make_paged_batch` and `causal_flops` are shared with `benchmarks.attention_kernels` (the
issue-30 table of every backend).

    python -m benchmarks.prefill_attention --out prefill_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from tandem_kernels.paged_attention import paged_prefill_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
# (requests, new tokens each, cached context tokens each)
SHAPES = [(16, 512, 0), (8, 1024, 0), (2, 4096, 0), (4, 1024, 3072)]
# (block_q, block_n, warps, stages); block_q counts query rows (x4 heads = the tile's rows).
CONFIGS = [(16, 64, 4, 3), (32, 32, 4, 3), (32, 64, 8, 3), (32, 64, 4, 2), (32, 128, 8, 2),
           (64, 64, 8, 2), (16, 32, 4, 4)]  # fmt: skip


@dataclass(frozen=True)
class PagedBatch:
    """`num_reqs` requests of `new` query rows each over `ctx` cached tokens (seq_len = ctx +
    new), K/V in a paged cache `[num_blocks, 2, block, Hkv, D]` whose blocks are dealt to the
    requests in a shuffled order (as in a pool after churn)."""

    query: torch.Tensor  # [num_reqs * new, H, D]
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, blocks per request] int32
    num_reqs: int
    new: int
    ctx: int

    @property
    def seq_len(self) -> int:
        return self.ctx + self.new

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gathered through the block table: two `[R, Hkv, seq_len, D]` tensors."""
        kv = self.kv_cache[self.block_table.long()]  # [R, blocks, 2, bs, Hkv, D]
        num_kv_heads, head_size = kv.shape[-2], kv.shape[-1]
        kv = kv.permute(0, 2, 4, 1, 3, 5).reshape(self.num_reqs, 2, num_kv_heads, -1, head_size)
        return kv[:, 0, :, : self.seq_len].contiguous(), kv[:, 1, :, : self.seq_len].contiguous()

    def dense_query(self) -> torch.Tensor:
        """The query as `[R, H, new, D]` (a view)."""
        heads, head_size = self.query.shape[1:]
        return self.query.view(self.num_reqs, self.new, heads, head_size).transpose(1, 2)


def make_paged_batch(
    num_reqs: int,
    new: int,
    ctx: int,
    dev: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_size: int = HEAD_SIZE,
    block_size: int = BLOCK_SIZE,
    seed: int = 0,
) -> PagedBatch:
    """Random query and cache of the given shape on `dev` (see `PagedBatch`)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    seq = ctx + new
    blocks_per_req = -(-seq // block_size)
    num_blocks = num_reqs * blocks_per_req
    cache = torch.randn(
        (num_blocks, 2, block_size, num_kv_heads, head_size), generator=gen, device=dev, dtype=dtype
    )
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    return PagedBatch(
        query=torch.randn(
            (num_reqs * new, num_heads, head_size), generator=gen, device=dev, dtype=dtype
        ),
        kv_cache=cache,
        query_start_loc=torch.arange(0, (num_reqs + 1) * new, new, dtype=torch.int32, device=dev),
        seq_lens=torch.full((num_reqs,), seq, dtype=torch.int32, device=dev),
        block_table=perm.view(num_reqs, blocks_per_req).to(torch.int32),
        num_reqs=num_reqs,
        new=new,
        ctx=ctx,
    )


def causal_flops(
    num_reqs: int, new: int, ctx: int, num_heads: int = NUM_HEADS, head_size: int = HEAD_SIZE
) -> float:
    """FLOPs of QK^T and PV over the visible keys only: row j of the new tokens sees ctx + j + 1
    keys (a bottom-right aligned causal mask)."""
    visible = num_reqs * (new * ctx + new * (new + 1) / 2)
    return 4 * visible * num_heads * head_size


def run_shape(num_reqs: int, new: int, ctx: int, dev: torch.device) -> dict[str, Any]:
    import triton

    batch = make_paged_batch(num_reqs, new, ctx, dev)
    query, cache, qsl = batch.query, batch.kv_cache, batch.query_start_loc
    seq_lens, block_table, scale = batch.seq_lens, batch.block_table, batch.scale
    seq = batch.seq_len
    k_dense, v_dense = batch.dense_kv()
    q_dense = batch.dense_query()
    # Row j of the new tokens sees keys 0 .. ctx + j: a bottom-right aligned causal mask.
    mask = torch.ones(new, seq, dtype=torch.bool, device=dev).tril(diagonal=ctx)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_dense,
            k_dense,
            v_dense,
            scale=scale,
            is_causal=ctx == 0,
            attn_mask=None if ctx == 0 else mask,
            enable_gqa=True,
        )

    ref = sdpa().transpose(1, 2).reshape(num_reqs * new, NUM_HEADS, HEAD_SIZE)
    flops = causal_flops(num_reqs, new, ctx)
    res: dict[str, Any] = {"num_reqs": num_reqs, "new_tokens": new, "context": ctx}
    ms = triton.testing.do_bench(sdpa, return_mode="median")
    res["sdpa_tflops"] = flops / ms / 1e9
    out = paged_prefill_attention(query, cache, qsl, seq_lens, block_table, scale)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    ms = triton.testing.do_bench(
        lambda: paged_prefill_attention(query, cache, qsl, seq_lens, block_table, scale),
        return_mode="median",
    )
    res["default_tflops"] = flops / ms / 1e9
    rates: dict[str, float] = {}
    for bq, bn, warps, stages in CONFIGS:
        name = f"{bq}x{bn}x{warps}x{stages}"

        def call(bq: int = bq, bn: int = bn, w: int = warps, st: int = stages) -> torch.Tensor:
            return paged_prefill_attention(
                query, cache, qsl, seq_lens, block_table, scale, block_q=bq, block_n=bn,
                num_warps=w, num_stages=st,
            )  # fmt: skip

        try:
            torch.testing.assert_close(call(), ref, atol=2e-2, rtol=2e-2)
            ms = triton.testing.do_bench(call, return_mode="median")
        except Exception as exc:  # a config the device cannot run, or a wrong result
            rates[name] = float("nan")
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        rates[name] = flops / ms / 1e9
    res["tflops"] = rates
    best = max((k for k in rates if rates[k] == rates[k]), key=lambda k: rates[k])
    res["best"] = best
    print(
        f"{num_reqs} x {new} new over {ctx} cached: SDPA {res['sdpa_tflops']:.0f} TFLOP/s, "
        f"default {res['default_tflops']:.0f}, best {best} {rates[best]:.0f}; "
        + " ".join(f"{k} {v:.0f}" for k, v in rates.items()),
        flush=True,
    )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ns = ap.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    print("configs: " + " ".join(f"{c[0]}x{c[1]}x{c[2]}x{c[3]}" for c in CONFIGS))
    result = {
        "benchmark": "prefill_attention",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": [run_shape(r, n, c, dev) for r, n, c in SHAPES],
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
