"""Prefill attention kernels against torch SDPA on dense K/V (GPU, bf16, the 8B shape).

For each shape (requests x new tokens, over cached context tokens) it times, each checked
against SDPA first:
- `sdpa`: SDPA on dense K/V (causal; with a cached context, a bottom-right mask);
- `old`: the all-paged kernel (`paged_prefill_attention`), its default and each tile config;
- `cascade`: the cascade (`cascade_prefill_attention`): the default the engine runs, then the
  dense part through torch's FlashAttention-2 (`flash`) and through our Triton kernel with each
  tile config (`triton:BMxBNxWxS`), then (with a cached context) the paged part's configs
  (`ctx:BQxBNxWxS`, BQ query rows x 4 heads per tile) after the fastest dense part.
Causal FLOPs (QK^T and PV over the visible keys) over the median time give TFLOP/s.

Variants (`--variants`, after the shapes): an FP8 KV cache (`fp8:`, e4m3, per-tensor scales)
and sliding windows (`winW:`, W keys per row), where the engine once had to take the all-paged
kernel: the all-paged kernel (`old`, default and each tile config; its output is the reference
here) against the cascade (default, then each dense tile config). A window's FLOPs count the
keys inside each row's window only.

Bounded: each candidate is timed for about 0.1 s (`do_bench` rep); past `--budget-s` seconds
the remaining candidates are skipped (recorded as "skipped"); the JSON is rewritten after each
shape, so a run killed by `timeout` still leaves the shapes it finished. A candidate that
fails (a config the device cannot run, a wrong result) is recorded with its error.

`make_paged_batch` and `causal_flops` are shared with `benchmarks.attention_kernels` (the
issue-30 table of every backend).

    timeout 290 python -m benchmarks.prefill_attention --out prefill_attention.json  # H200, < 4 min
    timeout 290 python -m benchmarks.prefill_attention --shapes '' --out variants.json  # variants
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem_kernels.cascade_attention import cascade_prefill_attention, flash_dense_supported
from tandem_kernels.paged_attention import FP8_KV_DTYPE, paged_prefill_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
# (requests, new tokens each, cached context tokens each)
SHAPES = [(8, 1024, 0), (4, 1024, 3072), (16, 512, 0), (2, 4096, 0), (1, 32768, 0)]
# (kind, requests, new tokens each, cached context tokens each): kind "fp8" (an FP8 cache) or
# "winW" (a sliding window of W), the cases the cascade newly covers.
VARIANTS = [("fp8", 8, 1024, 0), ("fp8", 4, 1024, 3072), ("fp8", 1, 32768, 0),
            ("win1024", 8, 1024, 0), ("win1024", 4, 1024, 3072), ("win4096", 1, 32768, 0),
            ("win4096", 2, 4096, 8192)]  # fmt: skip
FP8_SCALES = (0.02, 0.02)
# (block_q, block_n, warps, stages); block_q counts query rows (x4 heads = the tile's rows).
CONFIGS = [(16, 64, 4, 3), (32, 32, 4, 3), (32, 64, 8, 3), (32, 64, 4, 2), (32, 128, 8, 2),
           (64, 64, 8, 2), (16, 32, 4, 4)]  # fmt: skip
# The cascade's Triton dense part: (block_m, block_n, warps, stages).
DENSE_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                 (128, 64, 8, 4), (128, 32, 4, 4)]  # fmt: skip
# The cascade's paged context part: (block_q, block_n, warps, stages).
CONTEXT_CONFIGS = [(32, 64, 8, 3), (32, 128, 8, 3), (16, 64, 4, 3), (32, 64, 4, 2),
                   (64, 64, 8, 2)]  # fmt: skip


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

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K and V as a step's `forward` receives them: two
        `[num_reqs * new, Hkv, D]` tensors (what the cascade's dense part reads)."""
        k, v = self.dense_kv()
        num_kv_heads, head_size = k.shape[1], k.shape[3]

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[:, :, self.ctx :].transpose(1, 2).reshape(-1, num_kv_heads, head_size)

        return rows(k), rows(v)

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


def window_flops(
    num_reqs: int,
    new: int,
    ctx: int,
    window: int,
    num_heads: int = NUM_HEADS,
    head_size: int = HEAD_SIZE,
) -> float:
    """`causal_flops` with a sliding window: the row at position p sees min(p + 1, W) keys."""
    pos = torch.arange(ctx, ctx + new, dtype=torch.float64)
    visible = num_reqs * float(torch.clamp(pos + 1, max=window).sum())
    return 4 * visible * num_heads * head_size


class _Timer:
    """Checks and times candidates until the budget is spent."""

    def __init__(self, flops: float, ref: torch.Tensor, deadline: float) -> None:
        self.flops, self.ref, self.deadline = flops, ref, deadline

    def __call__(self, name: str, call: Callable[[], torch.Tensor]) -> float | str:
        import triton.testing

        if time.monotonic() > self.deadline:
            return "skipped"
        try:
            torch.testing.assert_close(call(), self.ref, atol=2e-2, rtol=2e-2)
            ms = triton.testing.do_bench(call, warmup=20, rep=100, return_mode="median")
        except Exception as exc:  # a config the device cannot run, or a wrong result
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return f"{type(exc).__name__}: {str(exc)[:160]}"
        return self.flops / ms / 1e9


def _best(rates: dict[str, float | str]) -> str | None:
    numbers = {k: v for k, v in rates.items() if isinstance(v, float) and v == v}
    return max(numbers, key=lambda k: numbers[k]) if numbers else None


def _cfg(config: tuple[int, int, int, int]) -> str:
    return "x".join(map(str, config))


def run_shape(
    num_reqs: int, new: int, ctx: int, dev: torch.device, deadline: float
) -> dict[str, Any]:
    batch = make_paged_batch(num_reqs, new, ctx, dev)
    query, cache, qsl = batch.query, batch.kv_cache, batch.query_start_loc
    seq_lens, block_table, scale = batch.seq_lens, batch.block_table, batch.scale
    seq = batch.seq_len
    k_dense, v_dense = batch.dense_kv()
    q_dense = batch.dense_query()
    k_new, v_new = batch.new_kv()
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
    timer = _Timer(causal_flops(num_reqs, new, ctx), ref, deadline)
    res: dict[str, Any] = {"num_reqs": num_reqs, "new_tokens": new, "context": ctx}
    res["sdpa_tflops"] = timer("sdpa", lambda: sdpa().transpose(1, 2).reshape(ref.shape))

    def old(config: tuple[int, int, int, int] | None) -> Callable[[], torch.Tensor]:
        knobs = {} if config is None else dict(
            block_q=config[0], block_n=config[1], num_warps=config[2], num_stages=config[3]
        )  # fmt: skip
        return lambda: paged_prefill_attention(
            query, cache, qsl, seq_lens, block_table, scale, **knobs
        )

    old_rates = {"default": timer("old default", old(None))}
    for config in CONFIGS:
        old_rates[_cfg(config)] = timer(f"old {_cfg(config)}", old(config))
    res["old_tflops"] = old_rates
    res["old_best"] = _best(old_rates)

    def cascade(
        impl: str | None,
        dense: tuple[int, int, int, int] | None = None,
        context: tuple[int, int, int, int] | None = None,
    ) -> Callable[[], torch.Tensor]:
        return lambda: cascade_prefill_attention(
            query, k_new, v_new, cache, qsl, seq_lens, block_table, scale, max_query_len=new,
            dense_impl=impl, dense_config=dense, context_config=context,
        )  # fmt: skip

    rates: dict[str, float | str] = {"default": timer("cascade default", cascade(None))}
    impls: dict[str, tuple[str, tuple[int, int, int, int] | None]] = {}
    if flash_dense_supported(query, NUM_KV_HEADS):
        rates["flash"] = timer("cascade flash", cascade("flash"))
        impls["flash"] = ("flash", None)
    for config in DENSE_CONFIGS:
        name = f"triton:{_cfg(config)}"
        rates[name] = timer(f"cascade {name}", cascade("triton", config))
        impls[name] = ("triton", config)
    best_dense = _best({k: v for k, v in rates.items() if k in impls})
    if ctx > 0 and best_dense is not None:
        impl, dense = impls[best_dense]
        for config in CONTEXT_CONFIGS:
            name = f"{best_dense}+ctx:{_cfg(config)}"
            rates[name] = timer(f"cascade {name}", cascade(impl, dense, config))
    res["cascade_tflops"] = rates
    res["cascade_best"] = _best(rates)

    def show(rate: float | str | None) -> str:
        return f"{rate:.0f}" if isinstance(rate, float) else str(rate)

    old_best = old_rates.get(res["old_best"] or "")
    cascade_best = rates.get(res["cascade_best"] or "")
    print(
        f"{num_reqs} x {new} new over {ctx} cached: SDPA {show(res['sdpa_tflops'])} TFLOP/s; "
        f"old default {show(old_rates['default'])}, best {res['old_best']} {show(old_best)}; "
        f"cascade default {show(rates['default'])}, best {res['cascade_best']} "
        f"{show(cascade_best)}\n  old: "
        + " ".join(f"{k} {show(v)}" for k, v in old_rates.items())
        + "\n  cascade: "
        + " ".join(f"{k} {show(v)}" for k, v in rates.items()),
        flush=True,
    )
    return res


def run_variant(
    kind: str, num_reqs: int, new: int, ctx: int, dev: torch.device, deadline: float
) -> dict[str, Any]:
    """One FP8 or sliding-window shape: the all-paged kernel (its default's output the
    reference) against the cascade (default, then each dense tile config)."""
    batch = make_paged_batch(num_reqs, new, ctx, dev)
    query, qsl = batch.query, batch.query_start_loc
    seq_lens, block_table, scale = batch.seq_lens, batch.block_table, batch.scale
    k_new, v_new = batch.new_kv()
    extra: dict[str, Any] = {}
    cache = batch.kv_cache
    if kind == "fp8":
        ks, vs = FP8_SCALES
        k8 = (cache[:, 0].float() / ks).clamp(-448, 448)
        v8 = (cache[:, 1].float() / vs).clamp(-448, 448)
        cache = torch.stack([k8, v8], dim=1).to(FP8_KV_DTYPE)
        extra = {"k_scale": ks, "v_scale": vs}
        flops = causal_flops(num_reqs, new, ctx)
    else:
        window = int(kind.removeprefix("win"))
        extra = {"sliding_window": window}
        flops = window_flops(num_reqs, new, ctx, window)

    def old(config: tuple[int, int, int, int] | None) -> Callable[[], torch.Tensor]:
        knobs = {} if config is None else dict(
            block_q=config[0], block_n=config[1], num_warps=config[2], num_stages=config[3]
        )  # fmt: skip
        return lambda: paged_prefill_attention(
            query, cache, qsl, seq_lens, block_table, scale, **knobs, **extra
        )

    def cascade(dense: tuple[int, int, int, int] | None) -> Callable[[], torch.Tensor]:
        return lambda: cascade_prefill_attention(
            query, k_new, v_new, cache, qsl, seq_lens, block_table, scale, max_query_len=new,
            dense_impl="triton", dense_config=dense, **extra,
        )  # fmt: skip

    timer = _Timer(flops, old(None)(), deadline)
    res: dict[str, Any] = {"kind": kind, "num_reqs": num_reqs, "new_tokens": new, "context": ctx}
    old_rates = {"default": timer("old default", old(None))}
    for config in CONFIGS:
        old_rates[_cfg(config)] = timer(f"old {_cfg(config)}", old(config))
    rates: dict[str, float | str] = {"default": timer("cascade default", cascade(None))}
    for config in DENSE_CONFIGS:
        rates[f"triton:{_cfg(config)}"] = timer(f"cascade {_cfg(config)}", cascade(config))
    res.update(old_tflops=old_rates, old_best=_best(old_rates))
    res.update(cascade_tflops=rates, cascade_best=_best(rates))

    def show(rate: float | str | None) -> str:
        return f"{rate:.0f}" if isinstance(rate, float) else str(rate)

    print(
        f"{kind}: {num_reqs} x {new} new over {ctx} cached: old default "
        f"{show(old_rates['default'])}, best {res['old_best']} "
        f"{show(old_rates.get(res['old_best'] or ''))}; cascade default "
        f"{show(rates['default'])}, best {res['cascade_best']} "
        f"{show(rates.get(res['cascade_best'] or ''))} TFLOP/s",
        flush=True,
    )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ap.add_argument("--budget-s", type=float, default=180.0, help="skip candidates after this")
    ap.add_argument(
        "--shapes",
        default=",".join(f"{r}x{n}+{c}" for r, n, c in SHAPES),
        help="REQSxNEW+CACHED list",
    )
    ap.add_argument(
        "--variants",
        default=",".join(f"{k}:{r}x{n}+{c}" for k, r, n, c in VARIANTS),
        help="KIND:REQSxNEW+CACHED list, KIND fp8 or winW ('' for none)",
    )
    ns = ap.parse_args(argv)
    deadline = time.monotonic() + ns.budget_s
    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = []
    for item in filter(None, ns.shapes.split(",")):
        reqs, rest = item.split("x")
        new, _, ctx = rest.partition("+")
        shapes.append((int(reqs), int(new), int(ctx or 0)))
    result: dict[str, Any] = {
        "benchmark": "prefill_attention",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": [],
        "variants": [],
    }

    def save() -> None:
        if ns.out:
            with open(ns.out, "w") as f:
                json.dump(result, f, indent=1)

    for num_reqs, new, ctx in shapes:
        result["shapes"].append(run_shape(num_reqs, new, ctx, dev, deadline))
        save()
    for item in filter(None, ns.variants.split(",")):
        kind, _, spec = item.partition(":")
        reqs, rest = spec.split("x")
        new, _, ctx = rest.partition("+")
        result["variants"].append(
            run_variant(kind, int(reqs), int(new), int(ctx or 0), dev, deadline)
        )
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
