"""Every Triton kernel against its pure-torch reference, on the CPU through Triton's interpreter.

The interpreter is chosen when triton is imported (its own `tl.*` helpers are jit functions),
so the cases run in one child process started with TRITON_INTERPRET=1; the rest of the suite,
GPU tests included, keeps compiled kernels. Each case is reported as its own test here. Run
one case by hand: `PYTHONPATH=. python tests/unit/test_kernels_interp.py 'rms_norm[float16]'`.
Small shapes only; fp32 and fp16 (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import threading
import traceback
import unittest.mock
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch

from tests.uninitialized import nan_filled_empty

if TYPE_CHECKING:
    from tandem.layers.attention.backend import AttentionMetadata

_ROOT = Path(__file__).resolve().parents[2]
_RESULTS_MARK = "@@interp-results@@"
_CASES: dict[str, Callable[[], None]] = {}


def _case(*variants: dict[str, object]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register `case_<name>` once per keyword set, as `<name>[value,...]`."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        base = fn.__name__.removeprefix("case_")
        if not variants:
            _CASES[base] = fn
        for kwargs in variants:
            label = ",".join(str(v).removeprefix("torch.") for v in kwargs.values())
            _CASES[f"{base}[{label}]"] = functools.partial(fn, **kwargs)
        return fn

    return register


def _kernels() -> SimpleNamespace:
    """The kernel modules (imported in the child, where TRITON_INTERPRET=1 is set)."""
    import tandem.layers.attention.triton_backend
    import tandem_kernels.activation
    import tandem_kernels.bitmask
    import tandem_kernels.cascade_attention
    import tandem_kernels.fused_moe
    import tandem_kernels.moe_ref
    import tandem_kernels.padding
    import tandem_kernels.paged_attention
    import tandem_kernels.reshape_and_cache
    import tandem_kernels.rms_norm
    import tandem_kernels.rotary
    import tandem_kernels.rotary_and_cache

    return SimpleNamespace(
        activation=tandem_kernels.activation,
        bitmask=tandem_kernels.bitmask,
        cascade=tandem_kernels.cascade_attention,
        fused_moe=tandem_kernels.fused_moe,
        moe_ref=tandem_kernels.moe_ref,
        padding=tandem_kernels.padding,
        paged_attention=tandem_kernels.paged_attention,
        reshape_and_cache=tandem_kernels.reshape_and_cache,
        rms_norm=tandem_kernels.rms_norm,
        rotary=tandem_kernels.rotary,
        rotary_and_cache=tandem_kernels.rotary_and_cache,
        triton_backend=tandem.layers.attention.triton_backend,
    )


DTYPES = [torch.float32, torch.float16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def _layer_view(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Layer 1 of a 3-layer cache `[num_blocks, 3, 2, bs, Hkv, D]`: a non-contiguous view."""
    full = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_size, dtype=dtype)
    view = full[:, 1]
    assert not view.is_contiguous()
    return view


def _block_table(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Each request gets distinct, shuffled block ids; unused entries hold a valid block (0)."""
    per_req = [math.ceil(n / block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    assert sum(per_req) <= num_blocks
    table = torch.zeros(len(seq_lens), max(per_req) + 2, dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[used : used + n]
        used += n
    return table


def _batch(query_lens: list[int]) -> torch.Tensor:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32)


# --- reshape_and_cache ---------------------------------------------------------------------


@_case(*({"dtype": d} for d in DTYPES))
def case_zero_rows_from(dtype: torch.dtype) -> None:
    """A graph's padding rows (from a count read on the device) zeroed, NaN and inf among
    them; the rows before untouched, to the bit. Rows of 3-D `[T, H, D]` (an attention
    output) and a width past one block."""
    k = _kernels()
    gen = torch.Generator().manual_seed(3)
    for shape, start in (((9, 3, 8), 5), ((6, 5000), 2), ((4, 2, 8), 4), ((4, 2, 8), 0)):
        out = torch.randn(*shape, generator=gen).to(dtype)
        out[start:].view(-1)[::3] = float("nan")
        out[start:].view(-1)[1::3] = float("inf")
        before = out[:start].clone()
        k.padding.zero_rows_from(out, torch.tensor([start], dtype=torch.int32))
        assert torch.equal(out[:start], before), shape
        assert not out[start:].any(), shape
        expected = torch.randn(*shape, generator=gen).to(dtype)
        kept = expected[:start].clone()
        k.padding.zero_rows_from_ref(expected, torch.tensor([start]))
        assert torch.equal(expected[:start], kept) and not expected[start:].any()


@_case(*({"dtype": d} for d in DTYPES))
def case_reshape_and_cache(dtype: torch.dtype) -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, head_size, num_blocks = 16, 2, 32, 8
    cache = _layer_view(num_blocks, block_size, num_kv_heads, head_size, dtype)
    expected = cache.clone()
    num_tokens = 21
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].long()
    slots[[3, 11]] = -1  # padded rows
    # key/value as views into a fused qkv tensor (row stride != Hkv * D).
    qkv = torch.randn(num_tokens + 2, 4 * num_kv_heads, head_size, dtype=dtype, generator=gen)
    key = qkv[:, 2 * num_kv_heads : 3 * num_kv_heads]
    value = qkv[:, 3 * num_kv_heads :]
    k.reshape_and_cache.reshape_and_cache(key, value, cache, slots)
    k.reshape_and_cache.reshape_and_cache_ref(key, value, expected, slots)
    assert torch.equal(cache, expected)
    # Something was written, and the padded rows were not.
    written = slots[slots >= 0]
    assert torch.equal(
        cache[written // block_size, 0, written % block_size], key[:num_tokens][slots >= 0]
    )


@_case(*({"dtype": d} for d in DTYPES))
def case_reshape_and_cache_fp8(dtype: torch.dtype) -> None:
    """An FP8 cache is written as `x / scale` in e4m3: the kernel against its reference, to
    the bit but where the interpreter's fp32 -> e4m3 conversion errs: it rounds ties away
    from zero (one e4m3 step off) and drops the carry of a value that rounds up to a power of
    two (writes half of it). The GPU converts in hardware; tests/gpu checks every bit there."""
    k = _kernels()
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, head_size, num_blocks = 16, 2, 32, 8
    cache = _layer_view(num_blocks, block_size, num_kv_heads, head_size, torch.float32)
    cache = cache.to(torch.float8_e4m3fn)
    expected = cache.clone()
    num_tokens = 21
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].long()
    slots[5] = -1
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype) * 3
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-9])  # saturates, and underflows
    k_scale, v_scale = 0.05, 0.01
    k.reshape_and_cache.reshape_and_cache(key, value, cache, slots, k_scale, v_scale)
    k.reshape_and_cache.reshape_and_cache_ref(key, value, expected, slots, k_scale, v_scale)
    got, want = cache.float(), expected.float()
    differ = got != want
    one_step = (got - want).abs() <= want.abs() * 2**-3
    assert (one_step | (got * 2 == want))[differ].all()  # only the interpreter's errors
    assert differ.float().mean() < 0.02
    written = slots[slots >= 0]
    stored = expected[written // block_size, 0, written % block_size].float() * k_scale
    exact = key[:num_tokens][slots >= 0].float()
    assert stored[0, 0, 0] == 448 * k_scale and stored[0, 0, 1] == -448 * k_scale
    fine = exact.abs() < 400 * k_scale
    assert ((stored - exact).abs()[fine] <= exact.abs()[fine] * 2**-4 + k_scale * 2**-9).all()


@_case(*({"dtype": d} for d in DTYPES))
def case_fp8_dynamic_activation_quant(dtype: torch.dtype) -> None:
    """Per-token (plain, and with FBGEMM's amax cap `scale_ub`) and per-tensor dynamic e4m3
    quantization of activations against the torch quantizers: the same scales bit for bit;
    the values but for the interpreter's e4m3 rounding errors (see
    `case_reshape_and_cache_fp8`; tests/gpu checks every bit)."""
    from tandem_kernels import fp8

    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(13, 3000, generator=gen) * torch.linspace(0.01, 20, 13)[:, None]
    x = wide.to(dtype)[:, 100:2700]  # a row-strided view, K past one 2048-wide block
    x[4] = 0  # an all-zero row: the floor scale, zeros
    ub = 30.0  # under the larger rows' amax (up to ~80): those saturate at +-448
    capped = fp8.quantize_per_row(x, ub)
    top = capped[1].max().item()  # the capped rows' scale, ub / 448 in fp32
    assert top == pytest.approx(ub / fp8.FP8_MAX, rel=1e-6) and (capped[1] == top).sum() > 2
    assert (capped[0].float().abs() == fp8.FP8_MAX).sum() > 3
    for kernel, ref in (
        (fp8.dynamic_quant_per_token, fp8.quantize_per_row),
        (lambda t: fp8.dynamic_quant_per_token(t, ub), lambda t: fp8.quantize_per_row(t, ub)),
        (fp8.dynamic_quant_per_tensor, fp8.quantize_per_tensor),
    ):
        (q, scale), (q_ref, scale_ref) = kernel(x), ref(x)
        assert scale.shape == scale_ref.shape and torch.equal(scale, scale_ref), kernel
        got, want = q.float(), q_ref.float()
        differ = got != want
        # One e4m3 step off (2^-9 among the subnormals), or the dropped carry.
        one_step = (got - want).abs() <= torch.clamp(want.abs() * 2**-3, min=2**-9)
        assert (one_step | (got * 2 == want))[differ].all(), kernel
        assert differ.float().mean() < 0.05, (kernel, differ.float().mean())
    empty = fp8.dynamic_quant_per_token(x[:0])
    assert empty[0].shape == (0, 2600) and empty[1].shape == (0, 1)


@_case(*({"dtype": d, "group": g} for d in DTYPES for g in (128, 100, 64)))
def case_fp8_token_group_quant(dtype: torch.dtype, group: int) -> None:
    """Per-token-group dynamic e4m3 quantization of activations (`[T, K]` -> scales `[T,
    ceil(K / group)]`) against its torch reference: the scales bit for bit, the values but
    for the interpreter's e4m3 rounding errors, and each group's values bit for bit those of
    the per-token kernel on that group's columns alone (the same e4m3 cast). K = 300: group
    128 leaves a ragged last group of 44 columns, 100 divides K (not a power of two); an
    all-zero group and an all-zero row take the floor scale and quantize to zeros."""
    from tandem_kernels import fp8

    gen = torch.Generator().manual_seed(19)
    wide = torch.randn(7, 320, generator=gen) * torch.linspace(0.01, 20, 7)[:, None]
    wide[:, 150:180] *= 50  # groups of one row at very different magnitudes
    x = wide.to(dtype)[:, 10:310]  # a row-strided view, K = 300
    x[2, group : 2 * group] = 0  # an all-zero group
    x[5] = 0  # an all-zero row
    groups = -(-300 // group)
    q, scale = fp8.dynamic_quant_per_token_group(x, group)
    q_ref, scale_ref = fp8.quantize_per_token_group(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 300)
    assert scale.shape == scale_ref.shape == (7, groups) and scale.is_contiguous()
    assert torch.equal(scale, scale_ref)
    assert scale[2, 1] == fp8.MIN_SCALE and (scale[5] == fp8.MIN_SCALE).all()
    assert not q[2, group : 2 * group].float().any() and not q[5].float().any()
    _assert_e4m3_close(q, q_ref, group)
    bits = functools.partial(torch.Tensor.view, dtype=torch.uint8)
    for g in range(groups):  # each group alone: the per-token kernel's, the per-row reference's
        cols = slice(g * group, (g + 1) * group)
        q_token, scale_token = fp8.dynamic_quant_per_token(x[:, cols])
        q_row, scale_row = fp8.quantize_per_row(x[:, cols])
        assert torch.equal(bits(q[:, cols]), bits(q_token)), g
        assert torch.equal(scale[:, g : g + 1], scale_token), g
        assert torch.equal(bits(q_ref[:, cols]), bits(q_row)), g
        assert torch.equal(scale_ref[:, g : g + 1], scale_row), g
    empty = fp8.dynamic_quant_per_token_group(x[:0], group)
    assert empty[0].shape == (0, 300) and empty[1].shape == (0, groups)


def _assert_e4m3_close(
    got: torch.Tensor,
    want: torch.Tensor,
    what: object,
    unit: torch.Tensor | float = 1.0,
    slack: float = 0.0,
) -> None:
    """Dequantized e4m3 values (`unit`: their scale, broadcast) equal but for e4m3 rounding:
    one step (2^-3 relative, 2^-9 among the subnormals), or the interpreter's dropped carry
    (half the value; see `case_fp8_dynamic_activation_quant`). `slack`: the relative error of
    the values before they were quantized (0: the same values, so few may differ)."""
    got, want = got.float(), want.float()
    differ = got != want
    floor = torch.as_tensor(unit, dtype=torch.float32) * 2**-9 * (1 + slack + 2**-10)
    close = (got - want).abs() <= torch.maximum(want.abs() * (2**-3 + slack), floor)
    dropped = (got * 2 - want).abs() <= want.abs() * slack * 2
    assert (close | dropped)[differ].all(), what
    if not slack:
        assert differ.float().mean() < 0.06, (what, differ.float().mean())


_FP8_STRATEGIES = (("token", None), ("tensor", None), ("static", 0.013))


@_case(*({"dtype": d} for d in DTYPES))
def case_rms_norm_fp8(dtype: torch.dtype) -> None:
    """RMSNorm (with and without the residual add) writing e4m3 per token, per tensor (two
    passes) and by a static scale: the scales bit for bit those of the unfused Triton norm's
    output quantized by torch, the values within e4m3 rounding of it and of the pure-torch
    reference; the residual sum exact; inputs untouched."""
    from tandem_kernels import fp8_fused

    k = _kernels()
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(9, 120, generator=gen) * torch.linspace(0.1, 30, 9)[:, None]
    x = wide.to(dtype)[:, :96]  # hidden 96 (not a power of two), row stride 120
    residual = torch.randn(9, 96, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    before = (x.clone(), residual.clone())
    for res in (None, residual):
        if res is None:
            unfused = k.rms_norm.rms_norm(x, weight, 1e-6)
        else:
            unfused = k.rms_norm.fused_add_rms_norm(x, res, weight, 1e-6)[0]
        for strategy, value in _FP8_STRATEGIES:
            scale = None if value is None else torch.tensor(value)
            what = (strategy, res is None)
            q, s, res_out = fp8_fused.rms_norm_fp8(x, res, weight, 1e-6, strategy, scale)
            q_unf, s_unf = fp8_fused.quantize_activation_ref(unfused, strategy, scale)
            q_ref, s_ref, res_ref = fp8_fused.rms_norm_fp8_ref(
                x, res, weight, 1e-6, strategy, scale
            )
            assert q.dtype == torch.float8_e4m3fn and q.shape == (9, 96), what
            assert s.shape == s_ref.shape and torch.equal(s, s_unf), what
            torch.testing.assert_close(s, s_ref, **_tol(dtype))
            _assert_e4m3_close(q, q_unf, what)
            # Against the pure-torch chain: within e4m3 rounding of a value within the norm's
            # tolerance.
            slack = 1e-5 if dtype == torch.float32 else 3e-3
            _assert_e4m3_close(q.float() * s, q_ref.float() * s_ref, what, s, slack)
            if res is None:
                assert res_out is None and res_ref is None
            else:
                assert torch.equal(res_out, res_ref), what
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
    empty = fp8_fused.rms_norm_fp8(x[:0], residual[:0], weight, 1e-6, "tensor")
    assert empty[0].shape == (0, 96) and empty[1].shape == () and empty[2].shape == (0, 96)


@_case(*({"dtype": d} for d in DTYPES))
def case_silu_and_mul_fp8(dtype: torch.dtype) -> None:
    """SiLU-and-mul writing e4m3 (I = 1100: past one column block, masked tail): the scales
    bit for bit those of the unfused Triton kernel's output quantized by torch, the values
    within e4m3 rounding of it and of the pure-torch reference. Per token group too (group
    128: a ragged last group of 76 columns; a group whose gates are zero quantizes to zeros
    by the floor scale), its values bit for bit the group quantizer's on the unfused output."""
    from tandem_kernels import fp8, fp8_fused

    k = _kernels()
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(6, 2 * 1100, generator=gen) * torch.linspace(1, 4, 6)[:, None]).to(dtype)
    x[2] = 0  # an all-zero row: the floor scale, zeros
    unfused = k.activation.silu_and_mul(x)
    for strategy, value in _FP8_STRATEGIES:
        scale = None if value is None else torch.tensor(value)
        q, s = fp8_fused.silu_and_mul_fp8(x, strategy, scale)
        q_unf, s_unf = fp8_fused.quantize_activation_ref(unfused, strategy, scale)
        q_ref, s_ref = fp8_fused.silu_and_mul_fp8_ref(x, strategy, scale)
        assert q.shape == (6, 1100) and s.shape == s_ref.shape, strategy
        assert torch.equal(s, s_unf), strategy
        torch.testing.assert_close(s, s_ref, **_tol(dtype))
        _assert_e4m3_close(q, q_unf, strategy)
        slack = 1e-5 if dtype == torch.float32 else 2e-3
        _assert_e4m3_close(q.float() * s, q_ref.float() * s_ref, strategy, s, slack)
        assert not q[2].float().any()
    x[4, 128:256] = 0  # silu(0) * up: a zero group
    unfused = k.activation.silu_and_mul(x)
    q, s = fp8_fused.silu_and_mul_fp8(x, "group", group=128)
    q_unf, s_unf = fp8_fused.quantize_activation_ref(unfused, "group", group=128)
    q_ref, s_ref = fp8_fused.silu_and_mul_fp8_ref(x, "group", group=128)
    q_kernel, s_kernel = fp8.dynamic_quant_per_token_group(unfused, 128)
    assert q.shape == (6, 1100) and s.shape == s_ref.shape == (6, 9) and s.is_contiguous()
    assert torch.equal(s, s_unf) and torch.equal(s, s_kernel)
    assert torch.equal(q.view(torch.uint8), q_kernel.view(torch.uint8))
    torch.testing.assert_close(s, s_ref, **_tol(dtype))
    _assert_e4m3_close(q, q_unf, "group")
    slack = 1e-5 if dtype == torch.float32 else 2e-3
    unit = s.repeat_interleave(128, 1)[:, :1100]
    _assert_e4m3_close(
        q.float() * unit,
        q_ref.float() * s_ref.repeat_interleave(128, 1)[:, :1100],
        "group",
        unit,
        slack,
    )
    assert s[4, 1] == fp8.MIN_SCALE and not q[4, 128:256].float().any()
    assert not q[2].float().any() and (s[2] == fp8.MIN_SCALE).all()
    empty = fp8_fused.silu_and_mul_fp8(x[:0], "token")
    assert empty[0].shape == (0, 1100) and empty[1].shape == (0, 1)
    empty = fp8_fused.silu_and_mul_fp8(x[:0], "group", group=128)
    assert empty[0].shape == (0, 1100) and empty[1].shape == (0, 9)


@_case()
def case_fp8_block_gemm() -> None:
    """The weight-only block-scaled FP8 GEMM against its reference: fp32 activations, tiles
    of 16 x 32, K not a multiple of the tile (a partial last block), M of one and of many."""
    from tandem_kernels import fp8, fp8_block_gemm

    gen = torch.Generator().manual_seed(10)
    for m, n, k in ((1, 48, 96), (37, 80, 80)):
        w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
        wq, tiles = fp8.quantize_per_block(w, (16, 32))
        scale = tiles.repeat_interleave(16, 0)[:n]
        x = torch.randn(m, k, generator=gen)
        out = fp8_block_gemm.fp8_block_gemm(x, wq, scale, 32)
        ref = fp8_block_gemm.fp8_block_gemm_ref(x, wq, scale, 32)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert (ref - x @ w.t()).norm() / (x @ w.t()).norm() < 0.05  # e4m3 weights


@_case()
def case_fp8_w8a16_gemm() -> None:
    """The small-batch W8A16 GEMM against its reference, in its tensor-core and GEMV forms,
    unsplit and split along K: fp32 activations, per-tensor and per-channel weight scales, K
    not a multiple of BLOCK_K (a partial last tile), N not a multiple of BLOCK_N, M of one, of
    a part of a tile and of several tiles."""
    from tandem_kernels import fp8, fp8_w8a16

    cfg = fp8_w8a16.Config
    gen = torch.Generator().manual_seed(11)
    for m, n, k in ((1, 48, 96), (5, 80, 272), (37, 64, 64)):
        w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
        for wq, scale in (fp8.quantize_per_tensor(w), fp8.quantize_per_row(w)):
            x = torch.randn(m, k, generator=gen)
            configs = [None, cfg(16, 32, 64, 1, 4, 2), cfg(32, 16, 256, 1, 4, 2)]
            if m <= 16:  # split-K needs one block of rows
                configs += [cfg(16, 16, 32, 3, 4, 2)]
            if m <= 5:  # the GEMV form (slow under the interpreter: few rows only)
                configs += [cfg(1, 8, 64, 1, 4, 1), cfg(2, 16, 128, 2, 4, 1)]
                configs += [cfg(8, 4, 32, 4, 4, 1)]
            for config in configs:
                if config and config.block_m < m:
                    continue
                out = fp8_w8a16.w8a16_gemm(x, wq, scale, config)
                ref = fp8_w8a16.w8a16_gemm_ref(x, wq, scale)
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            assert (ref - x @ w.t()).norm() / (x @ w.t()).norm() < 0.05  # e4m3 weights
    assert fp8_w8a16.w8a16_gemm(x[:0], wq, scale).shape == (0, 64)


@_case(*({"dtype": d} for d in (torch.float32, torch.float16, torch.bfloat16)))
def case_fp8_w8a16_candidates(dtype: torch.dtype) -> None:
    """Every config `tune_w8a16` may pick for 1..8 rows (the GEMV form for each bucket, the
    split-K `W x^T`, split-K and unsplit `x W^T` tensor-core tiles) against the reference,
    each at a batch of its bucket, M = 1..8 all met, both weight-scale schemes taking turns;
    K = 1120: splits of whole BLOCK_K chunks end unevenly and some are empty. One lock buffer
    serves every call (as a layer's does) and is all zeros after each. bf16: the GEMV form
    only (the interpreter's bf16 dot is wrong)."""
    from tandem_kernels import fp8, fp8_w8a16

    gen = torch.Generator().manual_seed(12)
    n, k = 24, 1120
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    schemes = (fp8.quantize_per_tensor(w), fp8.quantize_per_row(w))
    locks = fp8_w8a16.w8a16_locks(n, "cpu")
    batch_of = {1: [1], 2: [2], 4: [3, 4], 8: [5, 6, 7, 8]}
    seen_m: set[int] = set()
    calls = 0
    dot_rows = iter(range(10**6))
    for b, batches in batch_of.items():
        for i, config in enumerate(fp8_w8a16.candidates(b)):
            gemv = config.block_m < 16
            if not gemv and (dtype == torch.bfloat16 or b != 8):
                continue  # the tensor-core candidates repeat in every bucket: once, at 1..8
            m = batches[i % len(batches)] if gemv else 1 + next(dot_rows) % 8
            wq, scale = schemes[calls % 2]
            x = torch.randn(m, k, generator=gen).to(dtype)
            out = fp8_w8a16.w8a16_gemm(x, wq, scale, config, locks)
            ref = fp8_w8a16.w8a16_gemm_ref(x, wq, scale)
            tol = 1e-4 if dtype == torch.float32 else 1.6e-2 if dtype == torch.bfloat16 else 2e-3
            torch.testing.assert_close(
                out, ref, atol=tol, rtol=tol, msg=lambda e, c=config: f"{c}: {e}"
            )
            assert not locks.any(), config
            seen_m.add(m)
            calls += 1
    assert seen_m == set(range(1, 9)), seen_m
    split = fp8_w8a16.Config(1, 8, 512, 4, 4, 1)
    x = torch.randn(1, k, generator=gen).to(dtype)
    first = fp8_w8a16.w8a16_gemm(x, schemes[1][0], schemes[1][1], split, locks)
    again = fp8_w8a16.w8a16_gemm(x, schemes[1][0], schemes[1][1], split, locks)
    assert torch.equal(first, again)  # the slices are summed in one order
    with pytest.raises(AssertionError, match="locks"):
        fp8_w8a16.w8a16_gemm(x, schemes[1][0], schemes[1][1], split, locks[:2])


@_case(*({"dtype": d} for d in (torch.float32, torch.float16, torch.bfloat16)))
def case_w16a16_candidates(dtype: torch.dtype) -> None:
    """16-bit weights through the same kernels (W16A16: the weight in x's dtype, a unit
    scale): every config the tuner may pick for 1..8 rows against `F.linear` in fp32, K =
    1120 (uneven and empty K slices), one lock buffer all zeros after each call. bf16: the
    GEMV form only (the interpreter's bf16 dot is wrong). A weight of another dtype than x's
    is refused."""
    from tandem_kernels import fp8_w8a16

    gen = torch.Generator().manual_seed(13)
    n, k = 24, 1120
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    scale = fp8_w8a16.unit_scale("cpu")
    locks = fp8_w8a16.w8a16_locks(n, "cpu")
    seen_gemv = seen_dot = 0
    for b, m in ((1, 1), (2, 2), (4, 3), (8, 7)):
        for config in fp8_w8a16.candidates(b):
            gemv = config.block_m < 16
            if not gemv and (dtype == torch.bfloat16 or b != 8):
                continue
            x = torch.randn(m, k, generator=gen).to(dtype)
            out = fp8_w8a16.w8a16_gemm(x, w, scale, config, locks)
            ref = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
            tol = 1e-4 if dtype == torch.float32 else 1.6e-2 if dtype == torch.bfloat16 else 2e-3
            torch.testing.assert_close(
                out, ref, atol=tol, rtol=tol, msg=lambda e, c=config: f"{c}: {e}"
            )
            assert not locks.any(), config
            seen_gemv += gemv
            seen_dot += not gemv
    assert seen_gemv > 20 and (seen_dot > 5 or dtype == torch.bfloat16), (seen_gemv, seen_dot)
    other = torch.float16 if dtype != torch.float16 else torch.bfloat16
    with pytest.raises(AssertionError):
        fp8_w8a16.w8a16_gemm(torch.randn(1, k).to(other), w, scale)


@_case(*({"dtype": d} for d in (torch.float32, torch.bfloat16)))
def case_fp8_w8a16_early_weight(dtype: torch.dtype) -> None:
    """The GEMV form reading its first weight chunk ahead of the wait, as it does when
    launched with PDL (`early_weight`), and the loop that loads a chunk ahead
    (`Config.prefetch`) give the same bits as the plain loop: every GEMV candidate of 1..4
    rows, gated and not, at K = 1120 (uneven and empty slices) and K = 2048 (whole chunks:
    the loads unmasked along K)."""
    from tandem_kernels import fp8, fp8_w8a16

    gen = torch.Generator().manual_seed(14)
    n = 24
    locks = fp8_w8a16.w8a16_locks(n, "cpu")
    for k in (1120, 2048):
        wq, scale = fp8.quantize_per_row(torch.randn(n, k, generator=gen))
        for b in (1, 2, 4):
            for config in (c for c in fp8_w8a16.candidates(b) if c.block_m < 16):
                for gated in (False, True) if b <= fp8_w8a16.GATED_MAX_M else (False,):
                    x = torch.randn(b, 2 * k if gated else k, generator=gen).to(dtype)
                    plain = fp8_w8a16.w8a16_gemm(
                        x, wq, scale, config, locks, gated=gated, early_weight=False
                    )
                    early = fp8_w8a16.w8a16_gemm(
                        x, wq, scale, config, locks, gated=gated, early_weight=True
                    )
                    assert torch.equal(plain, early), (k, config, gated)
                    if config.prefetch:  # the loop a chunk ahead sums in the same order
                        twin = config._replace(prefetch=False)
                        unfetched = fp8_w8a16.w8a16_gemm(x, wq, scale, twin, locks, gated=gated)
                        assert torch.equal(unfetched, early), (k, config, gated)
                    if dtype == torch.float32:  # (the plain loop's bf16 error: other cases)
                        ref = fp8_w8a16.w8a16_gemm_ref(x, wq, scale, gated=gated)
                        torch.testing.assert_close(early, ref, atol=1e-4, rtol=1e-4)
                    assert not locks.any(), config


@_case(*({"dtype": d} for d in (torch.float32, torch.float16, torch.bfloat16)))
def case_fp8_w8a16_gated(dtype: torch.dtype) -> None:
    """The W8A16 GEMM computing its input's SiLU-and-mul as it reads it (`gated`): the same
    bits as the SiLU-and-mul kernel followed by the GEMM, in the GEMV form split and not and
    the split tensor-core forms, `x W^T` and `W x^T` (not in bf16: the interpreter's bf16
    dot), and close to the
    reference; a gated call checks x holds gate | up."""
    from tandem_kernels import fp8, fp8_w8a16
    from tandem_kernels.activation import silu_and_mul

    cfg = fp8_w8a16.Config
    gen = torch.Generator().manual_seed(13)
    n, k = 24, 1120
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    wq, scale = fp8.quantize_per_row(w)
    locks = fp8_w8a16.w8a16_locks(n, "cpu")
    configs = [(1, cfg(1, 16, 512, 1, 4, 1)), (3, cfg(4, 8, 256, 4, 4, 1))]
    if dtype != torch.bfloat16:
        configs += [(2, cfg(16, 16, 256, 2, 4, 3)), (4, cfg(16, 64, 128, 4, 4, 3, True))]
    for m, config in configs:
        gate_up = (torch.randn(m, 2 * k, generator=gen) * 2).to(dtype)
        gated = fp8_w8a16.w8a16_gemm(gate_up, wq, scale, config, locks, gated=True)
        unfused = fp8_w8a16.w8a16_gemm(silu_and_mul(gate_up), wq, scale, config, locks)
        assert torch.equal(gated, unfused), config
        ref = fp8_w8a16.w8a16_gemm_ref(gate_up, wq, scale, gated=True)
        rel = ((gated.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < (1e-5 if dtype == torch.float32 else 2e-2), (config, rel)
    with pytest.raises(AssertionError):
        fp8_w8a16.w8a16_gemm(gate_up[:, :k], wq, scale, configs[0][1], locks, gated=True)


# --- integer weights (W4A16) ------------------------------------------------------------------


def _int_weight(
    n: int, k: int, bits: int, group_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random `(qweight, scale, zero)` in tandem_kernels.int_w4a16's layout: values over the
    whole range, zero points anywhere in it (the top one included), positive scales."""
    from tandem_kernels import int_w4a16

    groups = 1 if group_size == -1 else -(-k // group_size)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zero = torch.randint(0, (1 << bits) + 1, (n, groups), generator=gen).to(torch.float32)
    scale = 0.002 + 0.02 * torch.rand(n, groups, generator=gen)
    return int_w4a16.pack_int_weight(q, bits), scale, zero


@_case(
    *(
        {"bits": b, "dtype": d}
        for b in (4, 8)
        for d in (torch.float32, torch.float16, torch.bfloat16)
    )
)
def case_int_w4a16_gemm(bits: int, dtype: torch.dtype) -> None:
    """The integer-weight GEMM against its reference in its GEMV and tensor-core forms,
    unsplit and split along K: M of one, of a part of a tile and of several tiles; N not a
    multiple of BLOCK_N; K not a multiple of BLOCK_K (one group, and a last group shorter
    than the others); group sizes 32, 64, 128 and one group; scales `[G, N]` passed
    transposed (the layer's layout) and zero points up to 2^bits; and the dense form (the
    weight dequantized whole, then torch's product). bf16: the GEMV form only (the
    interpreter's bf16 dot is wrong, and its casts to bf16 truncate)."""
    from tandem_kernels import int_w4a16

    cfg = int_w4a16.Config
    gen = torch.Generator().manual_seed(21)
    tol = 1e-4 if dtype == torch.float32 else 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    shapes = ((1, 48, 256, 64), (3, 40, 192, -1), (5, 24, 320, 128), (2, 16, 128, 32))
    shapes += ((20, 48, 256, 128), (37, 40, 192, -1))
    calls = 0
    for m, n, k, group_size in shapes:
        qweight, scale, zero = _int_weight(n, k, bits, group_size, gen)
        scale_t = scale.t().contiguous().to(dtype if dtype != torch.float32 else torch.float32)
        x = torch.randn(m, k, generator=gen).to(dtype)
        ref = int_w4a16.w4a16_gemm_ref(x, qweight, scale_t.t(), zero, bits, group_size)
        configs = [None, cfg(16, 32, 64, 1, 4, 2), cfg(32, 16, 32, 1, 4, 2)]
        configs += [int_w4a16.dense_config(k, group_size)]
        if m <= 16:
            configs += [cfg(16, 16, 32, 3, 4, 2)]
        if m <= 5:
            configs += [cfg(1, 16, 64, 1, 4, 1), cfg(4, 16, 32, 3, 4, 1), cfg(8, 32, 128, 2, 4, 1)]
        for config in configs:
            if config is not None and (
                (0 < config.block_m < m)
                or not int_w4a16.fits(config, k, group_size)
                or (dtype == torch.bfloat16 and (config.block_m >= 16 or config.block_m == 0))
            ):
                continue
            if config is None and dtype == torch.bfloat16 and m > 8:
                continue
            locks = int_w4a16.w4a16_locks(n, "cpu")
            out = int_w4a16.w4a16_gemm(
                x, qweight, scale_t.t(), zero, bits, group_size, config, locks
            )
            assert out.dtype == dtype and out.shape == (m, n)
            expected = ref
            if config is not None and config.block_m == 0:
                expected = int_w4a16.w4a16_dense_ref(
                    x, qweight, scale_t.t(), zero, bits, group_size
                )
            torch.testing.assert_close(
                out, expected, atol=tol, rtol=tol, msg=lambda e, c=config: f"{c}: {e}"
            )
            assert not locks.any(), config
            calls += 1
        assert ref.abs().max() > 0.1
    assert calls == (10 if dtype == torch.bfloat16 else 30), calls
    assert int_w4a16.w4a16_gemm(x[:0], qweight, scale, zero, bits, group_size).shape == (0, n)
    qweight, scale, zero = _int_weight(16, 128, bits, 32, gen)
    x = torch.randn(1, 128, generator=gen).to(dtype)
    assert not int_w4a16.fits(cfg(1, 16, 64, 1, 4, 1), 128, 32)
    with pytest.raises(AssertionError, match="Config"):  # a chunk across two groups
        int_w4a16.w4a16_gemm(x, qweight, scale, zero, bits, 32, cfg(1, 16, 64, 1, 4, 1))


@_case(*({"dtype": d} for d in (torch.float32, torch.float16)))
def case_int_w4a16_candidates(dtype: torch.dtype) -> None:
    """Every config `tune_w4a16` may time, bucket by bucket, at 4 bits in groups of 128 and
    at 8 bits in one group, against the reference, each at a batch of its bucket (a part of
    it in turn); K = 640: split-K slices of whole chunks end unevenly and some are empty. One
    lock buffer serves every call and is all zeros after each."""
    from tandem_kernels import int_w4a16

    gen = torch.Generator().manual_seed(22)
    n, k = 40, 640
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    seen = set()
    for bits, group_size in ((4, 128), (8, -1)):
        qweight, scale, zero = _int_weight(n, k, bits, group_size, gen)
        scale = scale.to(dtype)
        locks = int_w4a16.w4a16_locks(n, "cpu")
        for b in int_w4a16.M_BUCKETS:
            for i, config in enumerate(int_w4a16.candidates(b, k, group_size)):
                m = b if i % 2 == 0 else max(1, b // 2 + 1)
                x = torch.randn(m, k, generator=gen).to(dtype)
                out = int_w4a16.w4a16_gemm(x, qweight, scale, zero, bits, group_size, config, locks)
                ref = int_w4a16.w4a16_gemm_ref(x, qweight, scale, zero, bits, group_size)
                if config.block_m == 0:
                    ref = int_w4a16.w4a16_dense_ref(x, qweight, scale, zero, bits, group_size)
                torch.testing.assert_close(
                    out, ref, atol=tol, rtol=tol, msg=lambda e, c=config: f"{c}: {e}"
                )
                assert not locks.any(), config
                seen.add(config)
    assert len(seen) >= 20, len(seen)


def _gptq_stored(
    n: int, k: int, group: int, gen: torch.Generator
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection as a 4-bit GPTQ checkpoint stores it (`qweight`, `qzeros` one below,
    `scales` fp16), and its weight `[N, K]` float32."""
    from tests.int_checkpoints import pack_int32

    groups = k // group
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(1, 16, (groups, n), generator=gen)
    scales = (0.004 + 0.02 * torch.rand(groups, n, generator=gen)).to(torch.float16)
    g = torch.arange(k) // group
    dense = ((q - zeros[g]).float() * scales[g].float()).t().contiguous()
    stored = {"qweight": pack_int32(q, 4, dim=0), "qzeros": pack_int32(zeros - 1, 4, dim=1)}
    return {**stored, "scales": scales}, dense


@_case(*({"dtype": d} for d in (torch.float32, torch.float16)))
def case_int_weight_linear_layers(dtype: torch.dtype) -> None:
    """GPTQ projections kept quantized (the CUDA form: converted by the config's
    `map_checkpoint`, loaded by each layer's own `weight_loader`, packed after loading, the
    product through int_w4a16) give `F.linear` of their dequantized weights: gate_up
    (merged, its parts loaded out of order), qkv (its q, k, v parts) and down (row
    parallel), at TP = 1 and at both ranks of TP = 2 (column ranks: their rows of every
    part; row ranks: partial sums of their K columns and groups that add up to the whole),
    for a GEMV batch and a tensor-core one."""
    import dataclasses

    import torch.nn.functional as F

    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from tandem.layers.quantization.int_linear import IntWeightLinearMethod
    from tandem.layers.quantization.int_weight_only import GPTQConfig
    from tandem.models.interface import ModelContext
    from tests.parallel_groups import fake_parallel_state

    gen = torch.Generator().manual_seed(23)
    hidden, inter, group, head = 64, 128, 32, 16
    kept = GPTQConfig(4, group).for_device(torch.device("cuda"))
    assert kept.keep_quantized
    stored, dense = {}, {}
    for name, (n, k) in {
        "gate": (inter, hidden), "up": (inter, hidden), "q": (4 * head, hidden),
        "k": (2 * head, hidden), "v": (2 * head, hidden), "down": (hidden, inter),
    }.items():  # fmt: skip
        stored[name], dense[name] = _gptq_stored(n, k, group, gen)

    def load(layer: torch.nn.Module, parts: list[tuple[str, object]]) -> None:
        params = dict(layer.named_parameters())
        for name, shard_id in parts:
            tensors = [(f"p.{suffix}", t) for suffix, t in stored[name].items()]
            for full_name, tensor in kept.map_checkpoint(tensors):
                param = params[full_name.removeprefix("p.")]
                args = () if shard_id is None else (shard_id,)
                param.weight_loader(param, tensor, *args)
        layer.quant_method.process_weights_after_loading(layer)

    backend = get_attention_backend("torch")
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    for tp in (1, 2):
        xs = {m: torch.randn(m, hidden, generator=gen).to(dtype) for m in (3, 20)}
        xs_down = {m: torch.randn(m, inter, generator=gen).to(dtype) for m in (3, 20)}
        down_sum = {m: torch.zeros(m, hidden) for m in (3, 20)}
        for rank in range(tp):
            state = fake_parallel_state(rank, tp)
            ctx = dataclasses.replace(
                ModelContext(dtype, torch.device("cpu"), backend, state), quant_config=kept
            )
            gate_up = MergedColumnParallelLinear(hidden, [inter, inter], False, ctx, prefix="mlp")
            qkv = QKVParallelLinear(hidden, head, 4, 2, False, ctx, prefix="attn")
            down = RowParallelLinear(inter, hidden, False, ctx, prefix="down")
            for layer in (gate_up, qkv, down):
                assert isinstance(layer.quant_method, IntWeightLinearMethod)
            load(gate_up, [("up", 1), ("gate", 0)])
            load(qkv, [("q", "q"), ("v", "v"), ("k", "k")])
            load(down, [("down", None)])
            assert gate_up.weight.shape == (2 * inter // tp, hidden // 2)
            assert gate_up.weight_scale.shape == (hidden // group, 2 * inter // tp)  # [G, N]

            def rows(name: str, parts: int = tp, rank: int = rank) -> torch.Tensor:
                return dense[name].chunk(parts)[rank]

            expected = {
                gate_up: torch.cat([rows("gate"), rows("up")]),
                qkv: torch.cat([rows("q"), rows("k"), rows("v")]),
            }
            for m, x in xs.items():
                for layer, weight in expected.items():
                    out = layer(x)
                    ref = F.linear(x.float(), weight).to(dtype)
                    assert out.dtype == dtype and out.shape == ref.shape
                    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
                part = inter // tp
                x_rank = xs_down[m][:, rank * part : (rank + 1) * part]
                down_sum[m] += down.quant_method.apply(down, x_rank).float()
        for m, x_down in xs_down.items():  # the row-parallel ranks' all-reduce
            ref = F.linear(x_down.float(), dense["down"])
            torch.testing.assert_close(down_sum[m], ref, atol=2 * tol, rtol=2 * tol)


@_case(*({"fmt": f} for f in ("gptq_runs", "awq", "ct", "gptq")))
def case_int_weight_tiny_llama(fmt: str) -> None:
    """A tiny Llama stored in `fmt`, kept quantized (the CUDA form: every dense GEMM through
    int_w4a16) against the same checkpoint dequantized at load (the CPU form): the same
    logits for a prefill of three prompts and a decode step. AWQ and compressed-tensors
    leave layer 1's down_proj 16-bit through their lists, which keeps the default method.
    gptq: `desc_act`, each layer gathering its input in its act order (`input_perm`)."""
    import dataclasses
    import tempfile

    from tandem.layers.attention import get_attention_backend
    from tandem.layers.quantization import UnquantizedLinearMethod, resolve_quant_config
    from tandem.layers.quantization.int_linear import IntWeightLinearMethod
    from tandem.loader import build_model, load_hf_config
    from tandem.models.interface import ModelContext
    from tests.conftest import write_tiny_model
    from tests.int_checkpoints import quantized_folder
    from tests.parity.test_model_forward import PagedRun, random_prompts

    cpu = torch.device("cpu")
    plain_layer = None if fmt.startswith("gptq") else "layers.1.mlp.down_proj"
    with tempfile.TemporaryDirectory() as tmp:
        src = write_tiny_model(Path(tmp) / "src", "llama")
        quant, _ = quantized_folder(src, Path(tmp), fmt, group=32, unquantized=plain_layer)
        hf = load_hf_config(quant)
        ctx = ModelContext.single(torch.float32, cpu, get_attention_backend("torch"))
        models = []
        for device in ("cpu", "cuda"):
            config = resolve_quant_config("auto", hf, torch.device(device))
            models.append(build_model(quant, dataclasses.replace(ctx, quant_config=config)))
    dequantized, kept = models
    layers = kept.model.layers
    assert isinstance(layers[0].mlp.down_proj.quant_method, IntWeightLinearMethod)
    assert isinstance(layers[1].self_attn.qkv_proj.quant_method, IntWeightLinearMethod)
    assert type(layers[1].mlp.down_proj.quant_method) is (
        IntWeightLinearMethod if plain_layer is None else UnquantizedLinearMethod
    )
    assert layers[0].mlp.gate_up_proj.weight.dtype == torch.uint8
    for layer in (
        layers[0].mlp.gate_up_proj,
        layers[1].self_attn.qkv_proj,
        layers[1].self_attn.o_proj,
    ):
        assert (layer.input_perm is not None) == (fmt == "gptq")
    assert type(dequantized.model.layers[0].mlp.down_proj.quant_method) is UnquantizedLinearMethod
    prompts = random_prompts(512, [3, 17, 9], seed=41)
    runs = [PagedRun(model, [len(p) + 1 for p in prompts], seed=42) for model in models]
    prefill = [run.step(prompts, [0] * len(prompts)) for run in runs]
    for ours, ref in zip(prefill[1], prefill[0], strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    next_tokens = [[int(logits[-1].argmax())] for logits in prefill[0]]
    starts = [len(p) for p in prompts]
    decode = [run.step(next_tokens, starts) for run in runs]
    for ours, ref in zip(decode[1], decode[0], strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def _fp8_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, scales: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 layer view (K and V with their scales) and the same values dequantized to fp32."""
    full = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_size)
    full[:, :, 0] /= scales[0]
    full[:, :, 1] /= scales[1]
    cache = full.to(torch.float8_e4m3fn)[:, 1]
    deq = cache.float()
    deq[:, 0] *= scales[0]
    deq[:, 1] *= scales[1]
    return cache, deq


@_case(*({"dtype": d} for d in DTYPES))
def case_attention_over_fp8_cache(dtype: torch.dtype) -> None:
    """Prefill (with a prefix), mixed and decode (split and not) over an FP8 cache against the
    reference over the same cache dequantized."""
    k = _kernels()
    pa = k.paged_attention
    gen = torch.Generator().manual_seed(8)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 4, 2, 32, 16, 24
    ks, vs = 0.02, 0.5
    cache, deq = _fp8_cache(num_blocks, block_size, num_kv_heads, head_size, (ks, vs))
    deq = deq.to(dtype)
    seq_lens, query_lens = [40, 1, 51], [19, 1, 3]
    block_table = _block_table(seq_lens, block_size, num_blocks, gen)
    qsl, lens = _batch(query_lens), torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), num_heads, head_size, dtype=dtype, generator=gen)
    scale = head_size**-0.5
    ref = pa.paged_attention_ref(query, deq, qsl, lens, block_table, scale)
    scaled = pa.paged_attention_ref(query, cache, qsl, lens, block_table, scale, ks, vs)
    torch.testing.assert_close(scaled, ref, **_tol(dtype))  # the reference's own dequantize
    for block_q, block_n in ((None, None), (1, 16)):
        out = pa.paged_prefill_attention(
            query, cache, qsl, lens, block_table, scale, block_q=block_q, block_n=block_n,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        torch.testing.assert_close(out, ref, **_tol(dtype))
    dq = torch.randn(3, num_heads, head_size, dtype=dtype, generator=gen)
    ones = torch.arange(4, dtype=torch.int32)
    dref = pa.paged_attention_ref(dq, deq, ones, lens, block_table, scale)
    for splits in (1, 3):
        out = pa.paged_decode_attention(
            dq, cache, lens, block_table, scale, max_seq_len=51, num_splits=splits, block_n=16,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        torch.testing.assert_close(out, dref, **_tol(dtype))


# --- prefill / mixed attention ---------------------------------------------------------------


def _run_prefill(
    dtype: torch.dtype,
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    seed: int,
) -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 16, 24
    cache = _layer_view(num_blocks, block_size, num_kv_heads, head_size, dtype)
    block_table = _block_table(seq_lens, block_size, num_blocks, gen)
    qsl = _batch(query_lens)
    num_tokens = int(qsl[-1])
    # query as a view into a wider tensor, plus two padded rows at the end.
    wide = torch.randn(num_tokens + 2, num_heads + 3, head_size, dtype=dtype, generator=gen)
    query = wide[:, 1 : 1 + num_heads]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_size**-0.5
    ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, block_table, scale)
    # Default tiles (mostly the masked diagonal loop at these lengths), then small tiles so
    # that the unmasked loop over keys before each query tile runs too.
    for block_q, block_n in ((None, None), (1, 16)):
        out = k.paged_attention.paged_prefill_attention(
            query, cache, qsl, lens, block_table, scale, block_q=block_q, block_n=block_n
        )
        torch.testing.assert_close(out[:num_tokens], ref[:num_tokens], **_tol(dtype))


@_case(*({"dtype": d} for d in DTYPES))
def case_prefill_with_prefix_shuffled_blocks(dtype: torch.dtype) -> None:
    # Request 0: 21 cached tokens + 19 new; request 1: fresh prompt; request 2: 48 cached + 3.
    _run_prefill(dtype, [40, 17, 51], [19, 17, 3], 4, 2, 64, seed=1)


@_case(*({"dtype": d} for d in DTYPES))
def case_mixed_prefill_and_decode(dtype: torch.dtype) -> None:
    # Decodes (query length 1) next to a chunked prefill and a fresh prompt; GQA 8:2, head 32.
    _run_prefill(dtype, [33, 70, 1, 26], [1, 30, 1, 26], 8, 2, 32, seed=2)


@_case()
def case_prefill_mha_and_odd_group() -> None:
    # num_heads == num_kv_heads, then 3 query heads per KV head (padded group).
    _run_prefill(torch.float32, [20, 35], [20, 12], 2, 2, 32, seed=3)
    _run_prefill(torch.float32, [20, 35], [20, 12], 6, 2, 32, seed=4)
    # Head size 48: padded to 64 inside the kernel.
    _run_prefill(torch.float32, [20, 35], [20, 12], 4, 2, 48, seed=5)


# --- decode attention ---------------------------------------------------------------------


@_case(
    *(
        {"dtype": d, "num_splits": n, "heads_first": h}
        for d in DTYPES
        for n in (1, 3, 8)
        for h in (False, True)
    )
)
def case_decode_splits(dtype: torch.dtype, num_splits: int, heads_first: bool) -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 32, 16
    seq_lens = [90, 1, 47]
    cache = _layer_view(24, block_size, num_kv_heads, head_size, dtype)
    block_table = _block_table(seq_lens, block_size, 24, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(3, num_heads, head_size, dtype=dtype, generator=gen)
    scale = 0.3
    out = k.paged_attention.paged_decode_attention(
        query,
        cache,
        lens,
        block_table,
        scale,
        max_seq_len=90,
        num_splits=num_splits,
        block_n=16,
        heads_first=heads_first,
    )
    qsl = torch.arange(4, dtype=torch.int32)
    ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, block_table, scale)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    # The single entry takes the decode path for max_query_len == 1 and agrees.
    again = k.paged_attention.paged_attention(
        query, cache, qsl, lens, block_table, scale, max_query_len=1, max_seq_len=90
    )
    torch.testing.assert_close(again, ref, **_tol(dtype))


@_case({"dtype": torch.float32, "num_splits": 64}, {"dtype": torch.float16, "num_splits": 37})
def case_decode_many_splits_long_and_short_contexts(dtype: torch.dtype, num_splits: int) -> None:
    """Many partitions (up to the merge kernel's width): the long context is cut into dozens of
    one-tile pieces, the short ones leave most partitions empty, and all merge exactly."""
    k = _kernels()
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_size, block_size = 2, 1, 16, 16
    seq_lens = [1100, 40, 1]
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 4
    cache = _layer_view(num_blocks, block_size, num_kv_heads, head_size, dtype)
    block_table = _block_table(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_size, dtype=dtype, generator=gen)
    out = k.paged_attention.paged_decode_attention(
        query,
        cache,
        lens,
        block_table,
        0.25,
        max_seq_len=131072,
        num_splits=num_splits,
        block_n=16,
    )
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, block_table, 0.25)
    torch.testing.assert_close(out, ref, **_tol(dtype))


@_case({"num_splits": 5}, {"num_splits": 37})
def case_decode_merge_in_the_last_program(num_splits: int) -> None:
    """The last program of each (request, KV head) merges the partitions (three query heads a
    KV head, padded to four; several chunks of partitions at 37) as the second kernel does,
    and leaves the lock buffer all zeros for the next call."""
    k = _kernels()
    pa = k.paged_attention
    gen = torch.Generator().manual_seed(12)
    num_heads, num_kv_heads, head_size, block_size = 6, 2, 16, 16
    seq_lens = [700, 33, 1]
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 2
    cache = _layer_view(num_blocks, block_size, num_kv_heads, head_size, torch.float32)
    block_table = _block_table(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    ref = pa.paged_attention_ref(query, cache, qsl, lens, block_table, 0.3)
    outs = {}
    for merge_last in (True, False):
        outs[merge_last] = pa.paged_decode_attention(
            query, cache, lens, block_table, 0.3, max_seq_len=700, num_splits=num_splits,
            block_n=16, merge_last=merge_last,
        )  # fmt: skip
        torch.testing.assert_close(outs[merge_last], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-6, rtol=1e-6)
    locks = pa._merge_lock_buffers[query.device][-1]
    assert locks.numel() >= len(seq_lens) * num_kv_heads
    assert not locks.any(), "a lock was left counted"


@_case()
def case_decode_refuses_more_splits_than_the_merge_reads() -> None:
    k = _kernels()
    pa = k.paged_attention
    cache = _layer_view(4, 16, 1, 16, torch.float32)
    lens = torch.tensor([40], dtype=torch.int32)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    query = torch.randn(1, 1, 16)
    try:
        pa.paged_decode_attention(
            query, cache, lens, table, 0.25, max_seq_len=40, num_splits=pa.MAX_NUM_SPLITS + 1
        )
    except AssertionError:
        return
    raise AssertionError("num_splits past MAX_NUM_SPLITS was accepted")


@_case()
def case_decode_padded_requests_give_zeros() -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(6)
    cache = _layer_view(8, 16, 1, 32, torch.float32)
    block_table = _block_table([20, 5], 16, 8, gen)
    lens = torch.tensor([20, 0], dtype=torch.int32)  # request 1 is CUDA-graph padding
    query = torch.randn(2, 2, 32, generator=gen)
    for splits, merge_last in ((1, False), (2, False), (2, True)):
        out = k.paged_attention.paged_decode_attention(
            query, cache, lens, block_table, 0.2, max_seq_len=20, num_splits=splits, block_n=16,
            merge_last=merge_last,
        )  # fmt: skip
        assert torch.isfinite(out).all()
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = k.paged_attention.paged_attention_ref(
            query[:1], cache, torch.tensor([0, 1], dtype=torch.int32), lens[:1], block_table, 0.2
        )
        torch.testing.assert_close(out[:1], ref, atol=1e-5, rtol=1e-5)


# --- sliding window ---------------------------------------------------------------------


def _null_left_of_window(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    window: int,
    block_size: int,
) -> None:
    """Block-table entries wholly left of each request's first query's window -> block 0,
    filled with NaN (as a KV manager frees them for the null block): reading one shows."""
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        block_table[r, : max(seq_len - q_len - window + 1, 0) // block_size] = 0
    cache[0] = float("nan")


def _sliding_scene(
    dtype: torch.dtype, seq_lens: list[int], heads: int, kv_heads: int, head_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache (block size 16) whose block 0 no request holds, its block table, the query."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / 16) for n in seq_lens) + 3
    cache = _layer_view(num_blocks, 16, kv_heads, head_size, dtype)
    table = _block_table(seq_lens, 16, num_blocks - 1, gen) + 1
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(sum(seq_lens), heads, head_size, dtype=dtype, generator=gen)
    return cache, table, lens, query


@_case(
    *({"dtype": torch.float32, "window": w} for w in (1, 16, 45, 1000)),
    *({"dtype": torch.float16, "window": w} for w in (7, 45)),
)
def case_sliding_prefill(dtype: torch.dtype, window: int) -> None:
    # Windows smaller than a block, a block, across blocks, larger than every context; a fresh
    # prompt, chunks over a cached prefix crossing blocks, a decode in a mixed step.
    pa = _kernels().paged_attention
    seq_lens, query_lens = [70, 33, 100, 51], [40, 33, 1, 19]
    cache, table, lens, query = _sliding_scene(dtype, seq_lens, 4, 2, 32, seed=21)
    qsl = _batch(query_lens)
    n = int(qsl[-1])
    query = query[:n]
    scale = 32**-0.5
    ref = pa.paged_attention_ref(query, cache, qsl, lens, table, scale, sliding_window=window)
    full = pa.paged_attention_ref(query, cache, qsl, lens, table, scale)
    assert (window >= 100) == torch.allclose(ref, full), "the window must matter when short"
    _null_left_of_window(cache, table, seq_lens, query_lens, window, 16)
    # Default tiles, then tiles small enough (8 rows x 16 keys) that the band, the unmasked
    # middle and the diagonal loops all run.
    for block_q, block_n in ((None, None), (1, 16)):
        out = pa.paged_prefill_attention(
            query,
            cache,
            qsl,
            lens,
            table,
            scale,
            block_q=block_q,
            block_n=block_n,
            sliding_window=window,
        )
        torch.testing.assert_close(out, ref, **_tol(dtype))


@_case(
    *(
        {"dtype": d, "window": w, "num_splits": s}
        for d, w, s in [
            (torch.float32, 1, 1),
            (torch.float32, 20, 3),
            (torch.float16, 20, 1),
            (torch.float32, 37, 8),
            (torch.float16, 64, 3),
            (torch.float32, 500, 3),
        ]
    )
)
def case_sliding_decode(dtype: torch.dtype, window: int, num_splits: int) -> None:
    # Split-K over the window only: the first tile of the window is masked below its start.
    pa = _kernels().paged_attention
    seq_lens = [90, 1, 47, 200]
    cache, table, lens, query = _sliding_scene(dtype, seq_lens, 4, 2, 32, seed=22)
    query = query[: len(seq_lens)]
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    ref = pa.paged_attention_ref(query, cache, qsl, lens, table, 0.3, sliding_window=window)
    _null_left_of_window(cache, table, seq_lens, [1] * len(seq_lens), window, 16)
    for block_n in (16, 32):
        out = pa.paged_decode_attention(
            query,
            cache,
            lens,
            table,
            0.3,
            max_seq_len=200,
            num_splits=num_splits,
            block_n=block_n,
            sliding_window=window,
        )
        torch.testing.assert_close(out, ref, **_tol(dtype))


@_case(*({"dtype": d} for d in DTYPES))
def case_triton_backend_sliding_mixed_step(dtype: torch.dtype) -> None:
    # The backend hands the layer's window to both kernels of a mixed step.
    from tandem.layers.attention.backend import AttentionMetadata

    k = _kernels()
    pa = k.paged_attention
    seq_lens, query_lens, window = [60, 35, 80], [1, 1, 30], 24
    cache, table, lens, query = _sliding_scene(dtype, seq_lens, 4, 1, 16, seed=23)
    qsl = _batch(query_lens)
    n = int(qsl[-1])
    query = query[:n]
    key = torch.randn(n, 1, 16, dtype=dtype)
    value = torch.randn(n, 1, 16, dtype=dtype)
    slots = torch.cat(
        [
            (table[r].long()[torch.arange(s - q, s) // 16] * 16 + torch.arange(s - q, s) % 16)
            for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True))
        ]
    )
    md = AttentionMetadata(
        num_actual_tokens=n,
        num_reqs=3,
        max_query_len=30,
        max_seq_len=80,
        query_start_loc=qsl,
        seq_lens=lens,
        block_table=table,
        slot_mapping=slots,
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens,
        num_decodes=2,
    )
    _null_left_of_window(cache, table, seq_lens, query_lens, window, 16)
    backend = k.triton_backend.TritonAttentionBackend()
    out = backend.forward(query, key, value, cache, md, 0.25, sliding_window=window)
    ref = pa.paged_attention_ref(query, cache, qsl, lens, table, 0.25, sliding_window=window)
    torch.testing.assert_close(out, ref, **_tol(dtype))


def test_decode_num_splits() -> None:
    from tandem_kernels.paged_attention import (
        MAX_NUM_SPLITS,
        MIN_TOKENS_PER_SPLIT,
        decode_num_splits,
    )

    # Enough (request, KV head) programs already: no split.
    assert decode_num_splits(64, 8, 1024, 132) == 1
    # One long request: as many splits as the length allows.
    assert decode_num_splits(1, 8, 4096, 132) == 4096 // MIN_TOKENS_PER_SPLIT
    # Short contexts never split.
    assert decode_num_splits(2, 8, 100, 132) == 1
    # Bounded, and never below 1.
    assert decode_num_splits(1, 1, 10**6, 132) == 64
    assert decode_num_splits(0, 8, 0, 132) == 1
    # Long contexts (graphs are captured with max_model_len, up to 128k): the GPU is filled at
    # two programs per SM, within the merge kernel's width.
    assert decode_num_splits(1, 8, 131072, 132) == 33
    assert decode_num_splits(4, 8, 32768, 132) == 9
    assert decode_num_splits(1, 2, 131072, 132) == MAX_NUM_SPLITS
    # Once the programs cover three quarters of the SMs, one split at any length (batch 16 of
    # the 8B's 8 KV heads: 128 programs on 132 SMs; batch 12, 96 programs: still split).
    assert decode_num_splits(16, 8, 131072, 132) == 1
    assert decode_num_splits(32, 8, 8192, 132) == 1
    assert decode_num_splits(13, 8, 8192, 132) == 1
    assert decode_num_splits(12, 8, 8192, 132) == 3
    assert decode_num_splits(8, 8, 8192, 132) == 5


# --- grammar bitmask --------------------------------------------------------------------


@_case(*({"dtype": d} for d in DTYPES))
def case_token_bitmask(dtype: torch.dtype) -> None:
    from tandem.layers.sampler_bitmask import apply_token_bitmask

    k = _kernels()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1100, generator=gen).to(dtype)  # two blocks, a partial word
    words = torch.randint(-(2**31), 2**31 - 1, (3, 35), generator=gen, dtype=torch.int64)
    bitmask = words.to(torch.int32)
    bitmask[1] = 0  # nothing allowed
    bitmask[2] = -1  # everything allowed
    rows = torch.tensor([4, 0, 2])
    expected = apply_token_bitmask(logits, bitmask, rows)
    out = k.bitmask.apply_token_bitmask_(logits.clone(), bitmask, rows)
    assert torch.equal(out, expected)
    full = k.bitmask.apply_token_bitmask_(logits[:3].clone(), bitmask)
    assert torch.equal(full, apply_token_bitmask(logits[:3], bitmask))


# --- rms_norm ---------------------------------------------------------------------------


@_case(*({"dtype": d} for d in DTYPES))
def case_rms_norm(dtype: torch.dtype) -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(5, 120, dtype=dtype, generator=gen)
    x = wide[:, :96]  # hidden 96 (not a power of two), row stride 120
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    out = k.rms_norm.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, k.rms_norm.rms_norm_ref(x, weight, 1e-6), **_tol(dtype))
    residual = torch.randn(5, 96, dtype=dtype, generator=gen)
    before = (x.clone(), residual.clone())
    out, new_residual = k.rms_norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = k.rms_norm.fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


# --- rotary -------------------------------------------------------------------------------


def _cos_sin(max_pos: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return freqs.cos(), freqs.sin()


@_case(*({"dtype": d} for d in DTYPES))
def case_rotary(dtype: torch.dtype) -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(8)
    num_tokens, num_heads, num_kv_heads, head_size = 7, 4, 2, 32
    cos, sin = _cos_sin(64, head_size)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    # q and k as views into one fused qkv tensor.
    qkv = torch.randn(
        num_tokens, num_heads + 2 * num_kv_heads, head_size, dtype=dtype, generator=gen
    )
    q, kk = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    q_before = q.clone()
    ref_q, ref_k = k.rotary.rotary_embedding_ref(positions, q, kk, cos, sin)
    out_q, out_k = k.rotary.rotary_embedding(positions, q, kk, cos, sin, inplace=False)
    assert torch.equal(q, q_before)
    torch.testing.assert_close(out_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(out_k, ref_k, **_tol(dtype))
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    k.rotary.rotary_embedding(positions, q, kk, cos, sin, inplace=True)
    torch.testing.assert_close(q, ref_q, **_tol(dtype))
    torch.testing.assert_close(kk, ref_k, **_tol(dtype))
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)  # V untouched
    # Rotation happened (position 0 is the identity).
    moved = positions > 0
    assert not torch.allclose(ref_q[moved], q_before[moved], atol=1e-2)
    torch.testing.assert_close(ref_q[~moved], q_before[~moved])


@_case()
def case_rotary_partial() -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(9)
    cos, sin = _cos_sin(32, 16)  # rotary_dim 16 of head 32
    positions = torch.tensor([0, 5, 31])
    q = torch.randn(3, 2, 32, generator=gen)
    kk = torch.randn(3, 1, 32, generator=gen)
    ref_q, ref_k = k.rotary.rotary_embedding_ref(positions, q, kk, cos, sin)
    out_q, out_k = k.rotary.rotary_embedding(positions, q, kk, cos, sin, inplace=False)
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    assert torch.equal(out_q[..., 16:], q[..., 16:])


# --- rotary and the K/V cache write in one kernel ------------------------------------------


def _rotary_and_cache_scene(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, rotary_dim: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """A fused projection of 9 rows (a strided view of a wider tensor, head 32), positions
    past 0 (every row rotates), 7 slots (rows 7 and 8 past the step's tokens, as a graph's
    padding) with one negative, and cos/sin of `rotary_dim`."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * 32
    qkv = torch.randn(9, width + 5, generator=gen).to(dtype)[:, 3 : 3 + width]
    positions = torch.randint(1, 64, (9,), generator=gen)
    slots = torch.randperm(4 * 8, generator=gen)[:7]
    slots[2] = -1
    cos, sin = _cos_sin(64, rotary_dim)
    return qkv, positions, slots, cos, sin


@_case(
    *(
        {"dtype": d, "num_heads": h, "num_kv_heads": kvh, "rotary_dim": r}
        for d in DTYPES
        for h, kvh, r in ((4, 2, 32), (2, 2, 16))
    ),
    {"dtype": torch.bfloat16, "num_heads": 4, "num_kv_heads": 2, "rotary_dim": 32},
)
def case_rotary_and_cache(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, rotary_dim: int
) -> None:
    """The fused kernel against the two it replaces (`rotary_embedding`, then
    `reshape_and_cache` of the rotated key) to the bit, and against its reference: query and
    key, V a view of the projection, the cache (a layer's strided view) written at the slots
    of the step's rows only, K rotated there. GQA and MHA, full and partial rotary (head 32)."""
    from tandem.layers.attention.backend import split_qkv

    k = _kernels()
    qkv, positions, slots, cos, sin = _rotary_and_cache_scene(
        dtype, num_heads, num_kv_heads, rotary_dim, seed=41
    )
    args = (num_heads, num_kv_heads, 32)
    cache = _layer_view(4, 8, num_kv_heads, 32, dtype)
    two_kernels, expected = cache.clone(), cache.clone()
    query, key, value = k.rotary_and_cache.rotary_and_cache(
        positions, qkv, cos, sin, cache, slots, *args
    )
    q, kk, v = split_qkv(qkv, *args)
    q_two, k_two = k.rotary.rotary_embedding(positions, q, kk, cos, sin, inplace=False)
    k.reshape_and_cache.reshape_and_cache(k_two, v, two_kernels, slots)
    assert torch.equal(query, q_two) and torch.equal(key, k_two)
    assert torch.equal(cache, two_kernels)
    assert torch.equal(value, v) and value.data_ptr() == v.data_ptr()  # a view, no copy
    ref = k.rotary_and_cache.rotary_and_cache_ref(positions, qkv, cos, sin, expected, slots, *args)
    # bf16: the interpreter's rounding to it may differ from torch's by a step.
    tol = _tol(dtype) if dtype != torch.bfloat16 else {"atol": 2e-2, "rtol": 1e-2}
    for got, want in zip((query, key, value, cache), (*ref, expected), strict=True):
        torch.testing.assert_close(got, want, **tol)
    # K went into the cache rotated (every position here turns it), V as it came; rows 7 and
    # 8 (past the slots) and the negative slot wrote nothing.
    keep = slots >= 0
    written = slots[keep]
    blocks, offs = written // 8, written % 8
    assert torch.equal(cache[blocks, 0, offs], key[:7][keep])
    assert not torch.allclose(cache[blocks, 0, offs], kk[:7][keep], atol=1e-2)
    assert torch.equal(cache[blocks, 1, offs], v[:7][keep])
    untouched = torch.ones(4, 8, dtype=torch.bool)
    untouched[blocks, offs] = False
    assert torch.equal(cache.transpose(1, 2)[untouched], expected.transpose(1, 2)[untouched])
    if rotary_dim < 32:
        assert torch.equal(query[..., rotary_dim:], q[..., rotary_dim:])
        assert torch.equal(cache[blocks, 0, offs, :, rotary_dim:], kk[:7][keep][..., rotary_dim:])
    empty = k.rotary_and_cache.rotary_and_cache(
        positions[:0], qkv[:0], cos, sin, cache, slots[:0], *args
    )
    assert [t.shape for t in empty] == [(0, num_heads, 32)] + [(0, num_kv_heads, 32)] * 2


@_case(*({"dtype": d} for d in (torch.float16, torch.bfloat16)))
def case_rotary_and_cache_fp8(dtype: torch.dtype) -> None:
    """An FP8 cache: the fused kernel writes what `reshape_and_cache` writes of the rotated
    key, to the bit (both through the interpreter's e4m3 conversion), and the reference's
    bits but where that conversion errs (see `case_reshape_and_cache_fp8`)."""
    from tandem.layers.attention.backend import split_qkv

    k = _kernels()
    qkv, positions, slots, cos, sin = _rotary_and_cache_scene(dtype, 4, 2, 32, seed=42)
    qkv[0, 4 * 32 : 4 * 32 + 2] = torch.tensor([1e4, -1e4], dtype=dtype)  # K saturates
    args, scales = (4, 2, 32), (0.05, 0.01)
    cache = _layer_view(4, 8, 2, 32, torch.float32).to(torch.float8_e4m3fn)
    two_kernels, expected = cache.clone(), cache.clone()
    query, key, _ = k.rotary_and_cache.rotary_and_cache(
        positions, qkv, cos, sin, cache, slots, *args, *scales
    )
    q, kk, v = split_qkv(qkv, *args)
    q_two, k_two = k.rotary.rotary_embedding(positions, q, kk, cos, sin, inplace=False)
    k.reshape_and_cache.reshape_and_cache(k_two, v, two_kernels, slots, *scales)
    assert torch.equal(query, q_two) and torch.equal(key, k_two)
    assert torch.equal(cache.view(torch.uint8), two_kernels.view(torch.uint8))
    k.rotary_and_cache.rotary_and_cache_ref(
        positions, qkv, cos, sin, expected, slots, *args, *scales
    )
    got, want = cache.float(), expected.float()
    differ = got != want
    one_step = (got - want).abs() <= want.abs() * 2**-3
    assert (one_step | (got * 2 == want))[differ].all()  # only the interpreter's errors
    assert differ.float().mean() < 0.02
    written = slots[slots >= 0]
    stored = cache[written // 8, 0, written % 8].float() * scales[0]
    assert (stored.abs().amax(dim=(1, 2)) > 0).all() and stored.abs().max() == 448 * scales[0]


# --- activation -----------------------------------------------------------------------------


@_case(*({"dtype": d} for d in DTYPES))
def case_silu_and_mul(dtype: torch.dtype) -> None:
    k = _kernels()
    gen = torch.Generator().manual_seed(10)
    x = (3 * torch.randn(6, 2 * 1100, generator=gen)).to(dtype)  # two column blocks of 1024
    out = k.activation.silu_and_mul(x)
    assert out.shape == (6, 1100)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(out, k.activation.silu_and_mul_ref(x), **tol)
    # A scale a row (the MoE's routed weights) rounds as the unscaled kernel, then a multiply.
    scale = torch.rand(6, generator=gen) + 0.1
    scaled = k.activation.silu_and_mul(x, row_scale=scale)
    assert torch.equal(scaled, out * scale.to(dtype).unsqueeze(1))
    ref = k.activation.silu_and_mul_ref(x, row_scale=scale)
    torch.testing.assert_close(scaled, ref, **tol)


# --- the Triton attention backend -------------------------------------------------------------


def _metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> AttentionMetadata:
    from tandem.layers.attention.backend import AttentionMetadata

    qsl = _batch(query_lens)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        num_reqs=len(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=list(seq_lens),
        is_decode_only=all(n == 1 for n in query_lens),
    )


def _slots(block_table: torch.Tensor, positions: list[list[int]], block_size: int) -> torch.Tensor:
    slots = [
        int(block_table[r, p // block_size]) * block_size + p % block_size
        for r, ps in enumerate(positions)
        for p in ps
    ]
    return torch.tensor(slots, dtype=torch.int64)


@_case(*({"dtype": d} for d in DTYPES))
def case_triton_backend_chunked_prefill_then_decode(dtype: torch.dtype) -> None:
    """Three steps through the backend: chunk 1 of A + all of B; chunk 2 of A + decode of B
    (mixed); decode of both. Each step's output matches full causal attention over the
    sequence so far, and the cache holds every K/V written."""
    k = _kernels()
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 64, 16
    backend = k.triton_backend.TritonAttentionBackend()
    assert backend.name == "triton"
    cache = _layer_view(16, block_size, num_kv_heads, head_size, dtype)
    final_lens = [38, 11]
    block_table = _block_table(final_lens, block_size, 16, gen)
    total = [
        torch.randn(n, 3, num_heads, head_size, dtype=dtype, generator=gen) for n in final_lens
    ]
    # (positions computed so far, positions in this step) per request, per step.
    steps = [([0, 0], [20, 9]), ([20, 9], [17, 1]), ([37, 10], [1, 1])]
    scale = head_size**-0.5
    for done, new in steps:
        seq_lens = [d + n for d, n in zip(done, new, strict=True)]
        rows = [t[d : d + n] for t, d, n in zip(total, done, new, strict=True)]
        step = torch.cat(rows)
        # Two padded rows past num_actual_tokens, as a CUDA-graph batch would have.
        pad = torch.randn(2, 3, num_heads, head_size, dtype=dtype, generator=gen)
        step = torch.cat([step, pad])
        query = step[:, 0]
        key, value = step[:, 1, :num_kv_heads], step[:, 2, :num_kv_heads]
        positions = [list(range(d, d + n)) for d, n in zip(done, new, strict=True)]
        meta = _metadata(new, seq_lens, block_table, _slots(block_table, positions, block_size))
        out = backend.forward(query, key, value, cache, meta, scale)

        n_tok = meta.num_actual_tokens
        assert torch.equal(out[n_tok:], torch.zeros_like(out[n_tok:]))
        # Reference: dense causal attention over each request's whole sequence so far.
        for r, t in enumerate(total):
            lo = sum(new[:r])
            full = t[: seq_lens[r]]
            q = full[:, 0].float()
            kk = full[:, 1, :num_kv_heads].float().repeat_interleave(num_heads // num_kv_heads, 1)
            vv = full[:, 2, :num_kv_heads].float().repeat_interleave(num_heads // num_kv_heads, 1)
            s = torch.einsum("qhd,khd->hqk", q, kk) * scale
            mask = torch.ones(seq_lens[r], seq_lens[r], dtype=torch.bool).tril()
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            ref = torch.einsum("hqk,khd->qhd", p, vv)[done[r] :].to(dtype)
            torch.testing.assert_close(out[lo : lo + new[r]], ref, **_tol(dtype))


@_case(*({"dtype": d} for d in DTYPES))
def case_triton_backend_mixed_step_decodes_first(dtype: torch.dtype) -> None:
    """A mixed step whose first two requests decode (one token each, long contexts) and whose
    third is a prefill chunk: with `num_decodes=2` the decodes go through the decode kernel,
    and the output equals the single prefill-kernel path and the reference."""
    k = _kernels()
    gen = torch.Generator().manual_seed(13)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 32, 16
    query_lens, seq_lens = [1, 1, 20], [300, 41, 57]
    cache = _layer_view(64, block_size, num_kv_heads, head_size, dtype)
    block_table = _block_table(seq_lens, block_size, 64, gen)
    n = sum(query_lens)
    query = torch.randn(n, num_heads, head_size, dtype=dtype, generator=gen)
    key = torch.randn(n, num_kv_heads, head_size, dtype=dtype, generator=gen)
    value = torch.randn(n, num_kv_heads, head_size, dtype=dtype, generator=gen)
    positions = [list(range(s - q, s)) for q, s in zip(query_lens, seq_lens, strict=True)]
    meta = _metadata(query_lens, seq_lens, block_table, _slots(block_table, positions, block_size))
    backend = k.triton_backend.TritonAttentionBackend()
    whole = backend.forward(query, key, value, cache, meta, 0.25)
    meta.num_decodes = 2
    split = backend.forward(query, key, value, cache, meta, 0.25)
    ref = k.paged_attention.paged_attention_ref(
        query, cache, meta.query_start_loc, meta.seq_lens, block_table, 0.25
    )
    torch.testing.assert_close(split, ref, **_tol(dtype))
    torch.testing.assert_close(split, whole, **_tol(dtype))


@_case()
def case_triton_backend_decode_uses_splits() -> None:
    """A long-context decode step through the backend: the heuristic picks several splits."""
    k = _kernels()
    gen = torch.Generator().manual_seed(12)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 32, 16
    seq_lens = [600, 300]
    splits = k.paged_attention.decode_num_splits(2, num_kv_heads, max(seq_lens), 132)
    assert splits == 3
    cache = _layer_view(64, block_size, num_kv_heads, head_size, torch.float32)
    block_table = _block_table(seq_lens, block_size, 64, gen)
    query = torch.randn(2, num_heads, head_size, generator=gen)
    key = torch.randn(2, num_kv_heads, head_size, generator=gen)
    value = torch.randn(2, num_kv_heads, head_size, generator=gen)
    positions = [[n - 1] for n in seq_lens]
    meta = _metadata([1, 1], seq_lens, block_table, _slots(block_table, positions, block_size))
    backend = k.triton_backend.TritonAttentionBackend()
    out = backend.forward(query, key, value, cache, meta, 0.25)
    ref = k.paged_attention.paged_attention_ref(
        query, cache, meta.query_start_loc, meta.seq_lens, block_table, 0.25
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The new K/V went into the cache at the last position.
    blk = block_table[0, 599 // block_size]
    assert torch.equal(cache[blk, 0, 599 % block_size], key[0])
    assert torch.equal(cache[blk, 1, 599 % block_size], value[0])


class _CountingRotary:
    """A rotary embedding that is not `RotaryEmbedding` (the Triton kernel on its tables),
    counting its calls."""

    def __init__(self, cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
        self.cos_cache, self.sin_cache = cos_cache, sin_cache
        self.calls = 0

    def __call__(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from tandem_kernels.rotary import rotary_embedding

        self.calls += 1
        return rotary_embedding(
            positions, query, key, self.cos_cache, self.sin_cache, inplace=False
        )


@_case(
    {"dtype": torch.float32, "window": None, "fp8": False},
    {"dtype": torch.float16, "window": 24, "fp8": False},
    {"dtype": torch.float16, "window": None, "fp8": True},
)
def case_triton_backend_forward_qkv(dtype: torch.dtype, window: int | None, fp8: bool) -> None:
    """The layer's call with the fused projection through the Triton backend (`forward_qkv`:
    `rotary_and_cache`, then the attention) against split, `rotary_embedding` and `forward`,
    to the bit, output and cache: a mixed step (two decodes first, then a chunk after a
    prefix) with two padding rows, a sliding window, an FP8 cache with the layer's scales.
    A rotary embedding of another class goes the unfused way, to the same bits."""
    from tandem.layers.attention.layer import Attention
    from tandem.layers.rotary import RotaryEmbedding

    k = _kernels()
    gen = torch.Generator().manual_seed(43)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 4, 2, 32, 16, 16
    query_lens, seq_lens = [1, 1, 20], [60, 35, 80]
    if fp8:
        cache, _ = _fp8_cache(num_blocks, block_size, num_kv_heads, head_size, (0.02, 0.5))
    else:
        cache = _layer_view(num_blocks, block_size, num_kv_heads, head_size, dtype)
    unfused_cache, fallback_cache = cache.clone(), cache.clone()
    table = _block_table(seq_lens, block_size, num_blocks, gen)
    step_positions = [list(range(s - q, s)) for q, s in zip(query_lens, seq_lens, strict=True)]
    meta = _metadata(query_lens, seq_lens, table, _slots(table, step_positions, block_size))
    meta.num_decodes = 2
    positions = torch.tensor([p for ps in step_positions for p in ps] + [0, 0])
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(len(positions), width, generator=gen).to(dtype)
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    rope = RotaryEmbedding(head_size, 128, rope_parameters, torch.device("cpu"))
    backend = k.triton_backend.TritonAttentionBackend()
    assert backend.fuses_rotary_kv_write
    backend.fuse_rotary_kv = True  # the kernel, whatever TANDEM_ROTARY_KV says
    layer = Attention(num_heads, head_size, num_kv_heads, head_size**-0.5, backend, window)
    layer.k_scale, layer.v_scale = 0.02, 0.5
    out = layer.forward_qkv(positions, qkv, rope, cache, meta)

    q, kk, v = layer.split_qkv(qkv)
    tables = (rope.cos_cache, rope.sin_cache)
    q, kk = k.rotary.rotary_embedding(positions, q, kk, *tables, inplace=False)
    unfused = layer.forward(q, kk, v, unfused_cache, meta)
    assert torch.equal(out, unfused) and not out[-2:].any()
    assert torch.equal(cache.view(torch.uint8), unfused_cache.view(torch.uint8))
    other = _CountingRotary(*tables)
    fallback = layer.forward_qkv(positions, qkv, other, fallback_cache, meta)
    assert other.calls == 1 and torch.equal(fallback, unfused)
    assert torch.equal(fallback_cache.view(torch.uint8), unfused_cache.view(torch.uint8))


# --- cascade prefill attention ---------------------------------------------------------------


def _cascade_scene(
    dtype: torch.dtype,
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """A paged cache holding every position, shuffled blocks; the query (a strided view);
    the step's dense K/V (a strided view too): the cache's rows at the new positions."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 2
    cache = _layer_view(num_blocks, block_size, num_kv_heads, head_size, dtype)
    table = _block_table(seq_lens, block_size, num_blocks, gen)
    qsl = _batch(query_lens)
    n = int(qsl[-1])
    wide = torch.randn(n, num_heads + 2 * num_kv_heads + 1, head_size, dtype=dtype, generator=gen)
    query = wide[:, :num_heads]
    key = wide[:, num_heads : num_heads + num_kv_heads]
    value = wide[:, num_heads + num_kv_heads : num_heads + 2 * num_kv_heads]
    for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(s - q, s)
        blocks, offs = table[r, pos // block_size].long(), pos % block_size
        lo = int(qsl[r])
        key[lo : lo + q] = cache[blocks, 0, offs]
        value[lo : lo + q] = cache[blocks, 1, offs]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return cache, table, qsl, lens, query, key, value


@_case(
    *({"dtype": d, "heads": h, "head_size": hs} for d in DTYPES for h, hs in ((4, 64), (8, 128))),
    {"dtype": torch.float32, "heads": 2, "head_size": 32},
    {"dtype": torch.float32, "heads": 6, "head_size": 48},
)
def case_cascade_prefill(dtype: torch.dtype, heads: int, head_size: int) -> None:
    """The cascade against `paged_attention_ref`: requests with a cached prefix (one chunk of
    21 cached + 19 new, one 48 + 3), a fresh prompt, decodes (one token over 32 and 70) in the
    middle of the batch; GQA 2:1 and 4:1, MHA, a padded group of 3 and head size 48. Small
    tiles so each loop (unmasked, masked tail, diagonal) runs; then the default tiles."""
    k = _kernels()
    seq_lens, query_lens = [40, 33, 17, 51, 70], [19, 1, 17, 3, 1]
    cache, table, qsl, lens, query, key, value = _cascade_scene(
        dtype, seq_lens, query_lens, heads, 2, head_size, seed=31
    )
    scale = head_size**-0.5
    ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, table, scale)
    for dense, ctx in (((16, 16, 4, 1), (2, 16, 4, 1)), (None, None)):
        out = k.cascade.cascade_prefill_attention(
            query, key, value, cache, qsl, lens, table, scale, max_query_len=19,
            dense_config=dense, context_config=ctx,
        )  # fmt: skip
        torch.testing.assert_close(out, ref, **_tol(dtype))


@_case(*({"dtype": d} for d in DTYPES))
def case_cascade_dense_part_and_lse(dtype: torch.dtype) -> None:
    """Part 1 alone: causal self-attention of each request's new tokens and its LSE, against
    torch (the LSE in fp32, natural log, [heads, tokens])."""
    k = _kernels()
    query_lens = [37, 1, 16, 5]
    cache, table, qsl, lens, query, key, value = _cascade_scene(
        dtype, query_lens, query_lens, 4, 2, 32, seed=32
    )
    out, lse = k.cascade.dense_causal_attention(
        query, key, value, qsl, 0.3, max_query_len=37, impl="triton", block_m=16, block_n=16
    )
    ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, table, 0.3)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    assert lse.shape == (4, int(qsl[-1])) and lse.dtype == torch.float32
    for r in range(len(query_lens)):
        lo, hi = int(qsl[r]), int(qsl[r + 1])
        want = k.cascade.causal_lse_ref(query[lo:hi], key[lo:hi], 0.3)
        torch.testing.assert_close(lse[:, lo:hi], want, atol=1e-4, rtol=1e-4)


@_case(*({"dtype": d} for d in DTYPES))
def case_cascade_without_context(dtype: torch.dtype) -> None:
    """`has_context=False` (the step plan knows no request has a cached prefix): fresh prompts
    give the reference's output with the dense part alone; a batch where one request has a
    prefix gives a different output (the context part really is skipped)."""
    k = _kernels()
    scale = 0.3
    for seq_lens, query_lens in (([37, 16, 5], [37, 16, 5]), ([37, 40], [37, 19])):
        cache, table, qsl, lens, query, key, value = _cascade_scene(
            dtype, seq_lens, query_lens, 4, 2, 32, seed=33
        )
        ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, table, scale)
        out = k.cascade.cascade_prefill_attention(
            query, key, value, cache, qsl, lens, table, scale, max_query_len=37,
            dense_config=(16, 16, 4, 1), has_context=False,
        )  # fmt: skip
        if seq_lens == query_lens:
            torch.testing.assert_close(out, ref, **_tol(dtype))
        else:
            prefixed = slice(int(qsl[1]), int(qsl[2]))
            torch.testing.assert_close(out[: int(qsl[1])], ref[: int(qsl[1])], **_tol(dtype))
            assert not torch.allclose(out[prefixed].float(), ref[prefixed].float(), atol=1e-2)


@_case(
    *(
        {"dtype": d, "tma": t, "heads": h, "head_size": hs}
        for d in DTYPES
        for t in (True, False)
        for h, hs in ((8, 32), (4, 64))
    ),
    {"dtype": torch.float32, "tma": False, "heads": 6, "head_size": 48},
)
def case_dense_hopper(dtype: torch.dtype, tma: bool, heads: int, head_size: int) -> None:
    """The Hopper dense kernel against `dense_causal_ref` (output and LSE): requests of 37, 1,
    16, 70, 5 and 33 tokens (past and short of whole tiles, one of a single token), GQA 4:1 and
    2:1 (a group of 3 and head size 48 through pointer loads), K/V as views of a wider
    projection, K/V through TMA descriptors and through pointers. The batch is padded as a
    captured step's is: 3 rows past the last request with large finite K/V (its diagonal
    tile reads them: they must weigh nothing), and the buffer's rows past those NaN (never
    to be read). Tile configs where the diagonal spans one tile, two tiles, and 64 x 64 (the
    default's shape); then through `dense_causal_attention` with its knobs, one of them, and
    none (the default config)."""
    from tandem_kernels import dense_attention_hopper as dh

    k = _kernels()
    query_lens = [37, 1, 16, 70, 5, 33]
    num_kv_heads = 2
    qsl = _batch(query_lens)
    num_real = int(qsl[-1])
    num_tokens = num_real + 3
    gen = torch.Generator().manual_seed(51)
    query = torch.randn(num_tokens, heads, head_size, generator=gen).to(dtype)
    width = heads + 2 * num_kv_heads
    wide = torch.randn(num_tokens + 7, width, head_size, generator=gen).to(dtype)
    wide[num_real:num_tokens] = 300.0
    wide[num_tokens:] = float("nan")
    key = wide[:, heads : heads + num_kv_heads]
    value = wide[:, heads + num_kv_heads :]
    assert not key.is_contiguous()
    assert dh.tma_usable(query, key, value) == (head_size & (head_size - 1) == 0)
    ref_out, ref_lse = k.cascade.dense_causal_ref(query, key, value, qsl, 0.3)
    ref_out, ref_lse = ref_out[:num_real], ref_lse[:, :num_real]
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else _tol(dtype)
    use_tma = tma and head_size & (head_size - 1) == 0
    for config in ((16, 16, 4, 1, 0), (32, 16, 4, 2, 0), (16, 32, 4, 2, 0), (64, 64, 4, 2, 0)):
        out, lse = dh.dense_hopper_attention(
            query, key, value, qsl, 0.3, config=config, tma=use_tma
        )
        torch.testing.assert_close(out[:num_real], ref_out, **tol)
        torch.testing.assert_close(lse[:, :num_real], ref_lse, atol=1e-4, rtol=1e-4)
    for knobs in ({"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 2},
                  {"block_n": 16}, {}):  # fmt: skip
        out, lse = k.cascade.dense_causal_attention(
            query, key, value, qsl, 0.3, max_query_len=70, impl="triton_hopper", **knobs
        )
        torch.testing.assert_close(out[:num_real], ref_out, **tol)
        torch.testing.assert_close(lse[:, :num_real], ref_lse, atol=1e-4, rtol=1e-4)


@_case()
def case_dense_hopper_falls_back() -> None:
    """ "triton_hopper" with a sliding window runs our first dense kernel (the Hopper one takes
    none): the same result as impl "triton", bit for bit; the layer rule swaps it for FP8
    caches and windows, as it does FlashAttention-2."""
    k = _kernels()
    qsl = _batch([20, 9])
    gen = torch.Generator().manual_seed(52)
    query = torch.randn(29, 4, 32, generator=gen)
    key, value = torch.randn(2, 29, 2, 32, generator=gen)
    kwargs = {"max_query_len": 20, "sliding_window": 6, "block_m": 16, "block_n": 16}
    hopper = k.cascade.dense_causal_attention(
        query, key, value, qsl, 0.2, impl="triton_hopper", **kwargs
    )
    triton = k.cascade.dense_causal_attention(query, key, value, qsl, 0.2, impl="triton", **kwargs)
    full = k.cascade.dense_causal_attention(query, key, value, qsl, 0.2, impl="triton_hopper",
                                            max_query_len=20, block_m=16, block_n=16,
                                            num_warps=4, num_stages=1)  # fmt: skip
    assert torch.equal(hopper[0], triton[0]) and torch.equal(hopper[1], triton[1])
    assert not torch.allclose(full[1], triton[1]), "the window must matter"
    assert k.cascade.layer_prefill_path("triton_hopper", True, None) == "triton"
    assert k.cascade.layer_prefill_path("triton_hopper", False, 8) == "triton"
    assert k.cascade.layer_prefill_path("triton_hopper", False, None) == "triton_hopper"


@_case(*({"dtype": d} for d in (torch.float32, torch.float16)))
def case_dense_cudnn_layouts(dtype: torch.dtype) -> None:
    """The "cudnn" dense part's layouts, with cuDNN's call replaced by torch returning what
    cuDNN returns (`[R, H, L, D]` output, `[R, H, L, 1]` natural-log LSE): requests of one
    length go through it, from Q/K/V views of one qkv tensor, and match our kernel's output
    and LSE (without `need_lse`: the same output, cuDNN asked for no LSE, an empty one
    back); unequal lengths, a window, a length off the multiple and a refused shape run our
    kernel, bit for bit."""
    k = _kernels()
    cascade = k.cascade
    calls: list[tuple[int, ...]] = []
    lse_asked: list[bool] = []

    def fake_cudnn(
        q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float, need_lse: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(tuple(q.shape))
        lse_asked.append(need_lse)
        group = q.shape[1] // kk.shape[1]
        kf, vf = (t.float().repeat_interleave(group, 1) for t in (kk, vv))
        scores = q.float() @ kf.transpose(-1, -2) * scale
        causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, -1) @ vf
        return out.to(q.dtype), torch.logsumexp(scores, -1)[..., None]

    def refused(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("cuDNN: no engine for this shape")

    gen = torch.Generator().manual_seed(61)
    original, multiple = cascade._cudnn_sdpa, cascade.CUDNN_LENGTH_MULTIPLE
    try:
        cascade._cudnn_sdpa = fake_cudnn
        cascade.CUDNN_LENGTH_MULTIPLE = 16  # the test's lengths (256 in the engine)
        qkv = torch.randn(48, 4 + 2 * 2, 32, generator=gen).to(dtype)
        query, key, value = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
        qsl = _batch([16, 16, 16])
        out, lse = cascade.dense_causal_attention(
            query, key, value, qsl, 0.3, max_query_len=16, impl="cudnn"
        )
        assert calls == [(3, 4, 16, 32)], calls
        ours, ours_lse = cascade.dense_causal_attention(
            query, key, value, qsl, 0.3, max_query_len=16, impl="triton"
        )
        torch.testing.assert_close(out, ours, **_tol(dtype))
        torch.testing.assert_close(lse, ours_lse, atol=1e-4, rtol=1e-4)
        bare, no_lse = cascade.dense_causal_attention(
            query, key, value, qsl, 0.3, max_query_len=16, impl="cudnn", need_lse=False
        )
        assert torch.equal(bare, out) and no_lse.shape == (4, 0)
        assert lse_asked == [True, False]
        calls.pop()
        for lens, max_len, window in (([20, 9], 20, None), ([16, 16], 16, 5), ([8] * 4, 8, None)):
            qsl = _batch(lens)
            n = sum(lens)
            args = (query[:n], key[:n], value[:n], qsl, 0.3)
            got = cascade.dense_causal_attention(
                *args, max_query_len=max_len, impl="cudnn", sliding_window=window
            )
            want = cascade.dense_causal_attention(
                *args, max_query_len=max_len, impl="triton", sliding_window=window
            )
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), lens
        assert len(calls) == 1
        cascade._cudnn_sdpa = refused
        got = cascade.dense_causal_attention(
            query, key, value, _batch([16, 16, 16]), 0.3, max_query_len=16, impl="cudnn"
        )
        assert torch.equal(got[0], ours) and torch.equal(got[1], ours_lse)
    finally:
        cascade._cudnn_sdpa, cascade.CUDNN_LENGTH_MULTIPLE = original, multiple
    assert cascade.layer_prefill_path("cudnn", True, None) == "triton"
    assert cascade.layer_prefill_path("cudnn", False, 8) == "triton"
    assert cascade.layer_prefill_path("cudnn", False, None) == "cudnn"
    assert not cascade.cudnn_dense_supported(query, key)  # not on this device


@_case(*({"dtype": d} for d in DTYPES))
def case_merge_attn_states(dtype: torch.dtype) -> None:
    """The merge against torch, including rows where one side saw no keys (LSE -inf) and a
    row where neither did (zeros, LSE -inf); the output may alias an input."""
    k = _kernels()
    gen = torch.Generator().manual_seed(33)
    num_tokens, num_heads, head_size = 7, 3, 24
    out_a = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    out_b = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    lse_a = 3 * torch.randn(num_heads, num_tokens, generator=gen)
    lse_b = 3 * torch.randn(num_heads, num_tokens, generator=gen)
    lse_a[0, 1] = lse_b[1, 2] = float("-inf")
    lse_a[2, 4] = lse_b[2, 4] = float("-inf")
    out_b[4, 2] = out_a[4, 2] = 0.0
    ref_out, ref_lse = k.cascade.merge_attn_states_ref(out_a, lse_a, out_b, lse_b)
    out, lse = k.cascade.merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, 0], out_b[1, 0]) and torch.equal(out[2, 1], out_a[2, 1])
    assert lse[2, 4] == float("-inf") and not out[4, 2].any()
    k.cascade.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out_a)
    torch.testing.assert_close(out_a, ref_out, **_tol(dtype))


@_case(*({"dtype": d} for d in DTYPES))
def case_triton_backend_cascade_steps(dtype: torch.dtype) -> None:
    """The backend with the cascade forced on (as on CUDA): a mixed step with two leading
    decodes (split-K kernel) and two prefill chunks (one with a cached prefix), plus two
    padded rows; then the same step without `num_decodes` (decodes through the cascade, as in
    a whole-step CUDA graph). Both match the reference over the cache the backend wrote; so
    does a sliding-window layer (the cascade with the window). Then a step of fresh prompts
    after two decodes: the host lists show no prefix past the decodes
    (`prefill_rows_have_context`), and the backend's dense part alone (no context launch)
    matches the reference."""
    from tandem.layers.attention.backend import prefill_rows_have_context

    k = _kernels()
    seq_lens, query_lens = [50, 23, 60, 30], [1, 1, 20, 30]
    num_heads, num_kv_heads, head_size = 4, 2, 32
    cache, table, qsl, lens, query, key, value = _cascade_scene(
        dtype, seq_lens, query_lens, num_heads, num_kv_heads, head_size, seed=34
    )
    positions = [list(range(s - q, s)) for s, q in zip(seq_lens, query_lens, strict=True)]
    slots = _slots(table, positions, 16)
    # The backend writes the new K/V itself: start from a cache with garbage at those slots.
    flat = cache.permute(0, 2, 1, 3, 4)  # [blocks, bs, 2, Hkv, D]
    flat[slots // 16, slots % 16] = 7.0
    pad = torch.randn(2, num_heads, head_size, dtype=dtype)
    query_p = torch.cat([query, pad])
    key_p = torch.cat([key, pad[:, :num_kv_heads]])
    value_p = torch.cat([value, pad[:, :num_kv_heads]])
    backend = k.triton_backend.TritonAttentionBackend()
    backend.prefill_cascade = True
    scale = head_size**-0.5
    for num_decodes in (2, 0):
        meta = _metadata(query_lens, seq_lens, table, slots)
        meta.num_decodes = num_decodes
        out = backend.forward(query_p, key_p, value_p, cache, meta, scale)
        ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, table, scale)
        torch.testing.assert_close(out[: len(query)], ref, **_tol(dtype))
        assert torch.equal(out[len(query) :], torch.zeros_like(out[len(query) :]))
    window = 8
    meta = _metadata(query_lens, seq_lens, table, slots)
    out = backend.forward(query_p, key_p, value_p, cache, meta, scale, sliding_window=window)
    ref = k.paged_attention.paged_attention_ref(
        query, cache, qsl, lens, table, scale, sliding_window=window
    )
    torch.testing.assert_close(out[: len(query)], ref, **_tol(dtype))
    meta.num_decodes = 2
    assert prefill_rows_have_context(meta)  # the 20-row chunk has 40 cached tokens
    fresh_seq, fresh_q = [50, 23, 20, 30], [1, 1, 20, 30]
    cache, table, qsl, lens, query, key, value = _cascade_scene(
        dtype, fresh_seq, fresh_q, num_heads, num_kv_heads, head_size, seed=35
    )
    positions = [list(range(s - q, s)) for s, q in zip(fresh_seq, fresh_q, strict=True)]
    meta = _metadata(fresh_q, fresh_seq, table, _slots(table, positions, 16))
    meta.num_decodes = 2
    assert not prefill_rows_have_context(meta)
    meta.prefill_has_context = False
    out = backend.forward(query, key, value, cache, meta, scale)
    ref = k.paged_attention.paged_attention_ref(query, cache, qsl, lens, table, scale)
    torch.testing.assert_close(out, ref, **_tol(dtype))


def _new_kv(
    cache: torch.Tensor, table: torch.Tensor, seq_lens: list[int], query_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's K/V rows at each request's new positions, stacked as `forward` gets them."""
    rows = [
        (table[r, pos // 16].long(), pos % 16)
        for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True))
        for pos in [torch.arange(s - q, s)]
    ]
    key = torch.cat([cache[b, 0, o] for b, o in rows])
    value = torch.cat([cache[b, 1, o] for b, o in rows])
    return key, value


# Small tiles (the dense part 16 x 16, the context part 8 rows x 16 keys: every loop runs),
# then the defaults.
_CASCADE_CONFIGS = (((16, 16, 4, 1), (2, 16, 4, 1)), (None, None))


@_case(*({"dtype": d} for d in DTYPES))
def case_cascade_fp8_cache(dtype: torch.dtype) -> None:
    """The cascade over an FP8 cache (the step's K/V written by `reshape_and_cache`, the
    prefix random e4m3) equals the all-paged kernel and the reference over the same cache:
    its dense part reads the K/V rounded as the cache holds them. A chunk over a prefix, a
    fresh prompt, a short chunk over a long prefix and a decode; GQA 2:1, then 3:1 (padded)."""
    k = _kernels()
    pa = k.paged_attention
    gen = torch.Generator().manual_seed(41)
    ks, vs = 0.02, 0.5
    seq_lens, query_lens = [40, 17, 51, 30], [19, 17, 3, 1]
    for num_heads in (4, 6):
        num_kv_heads, head_size = 2, 32
        num_blocks = sum(math.ceil(n / 16) for n in seq_lens) + 2
        cache, _ = _fp8_cache(num_blocks, 16, num_kv_heads, head_size, (ks, vs))
        table = _block_table(seq_lens, 16, num_blocks, gen)
        qsl, lens = _batch(query_lens), torch.tensor(seq_lens, dtype=torch.int32)
        n = int(qsl[-1])
        wide = torch.randn(n, num_heads + 2 * num_kv_heads, head_size, generator=gen).to(dtype)
        query = wide[:, :num_heads]
        key = wide[:, num_heads : num_heads + num_kv_heads]
        value = wide[:, num_heads + num_kv_heads :]
        positions = [list(range(s - q, s)) for s, q in zip(seq_lens, query_lens, strict=True)]
        slots = _slots(table, positions, 16)
        k.reshape_and_cache.reshape_and_cache(key, value, cache, slots, ks, vs)
        scale = head_size**-0.5
        ref = pa.paged_attention_ref(query, cache, qsl, lens, table, scale, ks, vs)
        # The check can fail: over the step's K/V unrounded the answer is another one.
        exact = cache.float()
        exact[:, 0] *= ks
        exact[:, 1] *= vs
        flat = exact.permute(0, 2, 1, 3, 4)  # [blocks, bs, 2, Hkv, D]
        flat[slots // 16, slots % 16, 0] = key.float()
        flat[slots // 16, slots % 16, 1] = value.float()
        unrounded = pa.paged_attention_ref(query.float(), exact, qsl, lens, table, scale)
        assert (unrounded - ref.float()).abs().max() > 0.02
        paged = pa.paged_prefill_attention(
            query, cache, qsl, lens, table, scale, k_scale=ks, v_scale=vs
        )
        for dense, ctx in _CASCADE_CONFIGS:
            out = k.cascade.cascade_prefill_attention(
                query, key, value, cache, qsl, lens, table, scale, max_query_len=19,
                dense_config=dense, context_config=ctx, k_scale=ks, v_scale=vs,
            )  # fmt: skip
            torch.testing.assert_close(out, ref, **_tol(dtype))
            torch.testing.assert_close(out, paged, **_tol(dtype))


@_case(
    *({"dtype": torch.float32, "window": w} for w in (1, 16, 45, 1000)),
    {"dtype": torch.float16, "window": 7},
)
def case_cascade_sliding(dtype: torch.dtype, window: int) -> None:
    """The cascade with a sliding window against the reference and the all-paged kernel:
    windows shorter than a block, one block, shorter than the prefix but spanning the chunk,
    longer than every context; a chunk of 40 over 30 cached, a fresh prompt, a decode over
    99, a chunk of 19 over 32. Blocks left of each first row's window are the null block,
    filled with NaN: reading one shows."""
    k = _kernels()
    pa = k.paged_attention
    seq_lens, query_lens = [70, 33, 100, 51], [40, 33, 1, 19]
    cache, table, lens, query = _sliding_scene(dtype, seq_lens, 4, 2, 32, seed=42)
    qsl = _batch(query_lens)
    query = query[: int(qsl[-1])]
    key, value = _new_kv(cache, table, seq_lens, query_lens)
    scale = 32**-0.5
    ref = pa.paged_attention_ref(query, cache, qsl, lens, table, scale, sliding_window=window)
    full = pa.paged_attention_ref(query, cache, qsl, lens, table, scale)
    assert (window >= 100) == torch.allclose(ref, full), "the window must matter when short"
    _null_left_of_window(cache, table, seq_lens, query_lens, window, 16)
    paged = pa.paged_prefill_attention(query, cache, qsl, lens, table, scale, sliding_window=window)
    for dense, ctx in _CASCADE_CONFIGS:
        out = k.cascade.cascade_prefill_attention(
            query, key, value, cache, qsl, lens, table, scale, max_query_len=40,
            dense_config=dense, context_config=ctx, sliding_window=window,
        )  # fmt: skip
        torch.testing.assert_close(out, ref, **_tol(dtype))
        torch.testing.assert_close(out, paged, **_tol(dtype))
    # Part 1 alone: each row's windowed causal attention over the new tokens, and its LSE.
    out, lse = k.cascade.dense_causal_attention(
        query, key, value, qsl, scale, max_query_len=40, impl="triton", block_m=16,
        block_n=16, sliding_window=window,
    )  # fmt: skip
    for r, q_len in enumerate(query_lens):
        lo = int(qsl[r])
        q, kk = query[lo : lo + q_len].float(), key[lo : lo + q_len].float()
        kk = kk.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        j = torch.arange(q_len)
        seen = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - window)
        want = scores.masked_fill(~seen, -math.inf).logsumexp(-1)
        torch.testing.assert_close(lse[:, lo : lo + q_len], want, atol=1e-3, rtol=1e-3)


@_case(*({"dtype": d} for d in DTYPES))
def case_triton_backend_cascade_fp8_sliding(dtype: torch.dtype) -> None:
    """The backend with the cascade forced on, a sliding-window layer over an FP8 cache: a
    mixed step (two leading decodes, a chunk over a prefix, a fresh prompt), with and
    without `num_decodes`, against the reference over the cache the backend wrote and
    against the all-paged kernel (`TANDEM_PREFILL_CASCADE=0`'s path)."""
    k = _kernels()
    pa = k.paged_attention
    seq_lens, query_lens, window = [50, 23, 60, 30], [1, 1, 20, 30], 24
    num_heads, num_kv_heads, head_size, ks, vs = 4, 2, 32, 0.05, 0.3
    gen = torch.Generator().manual_seed(43)
    num_blocks = sum(math.ceil(n / 16) for n in seq_lens) + 2
    cache, _ = _fp8_cache(num_blocks, 16, num_kv_heads, head_size, (ks, vs))
    table = _block_table(seq_lens, 16, num_blocks, gen)
    positions = [list(range(s - q, s)) for s, q in zip(seq_lens, query_lens, strict=True)]
    slots = _slots(table, positions, 16)
    n = sum(query_lens)
    query = torch.randn(n + 2, num_heads, head_size, generator=gen).to(dtype)  # 2 padded rows
    key = torch.randn(n + 2, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(n + 2, num_kv_heads, head_size, generator=gen).to(dtype)
    qsl, lens = _batch(query_lens), torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_size**-0.5
    cascade = k.triton_backend.TritonAttentionBackend()
    cascade.prefill_cascade = True
    paged = k.triton_backend.TritonAttentionBackend()
    paged.prefill_cascade = False
    extra = {"k_scale": ks, "v_scale": vs, "sliding_window": window}
    for num_decodes in (2, 0):
        meta = _metadata(query_lens, seq_lens, table, slots)
        meta.num_decodes = num_decodes
        out = cascade.forward(query, key, value, cache, meta, scale, **extra)
        ref = pa.paged_attention_ref(query[:n], cache, qsl, lens, table, scale, **extra)
        torch.testing.assert_close(out[:n], ref, **_tol(dtype))
        assert not out[n:].any()
        meta = _metadata(query_lens, seq_lens, table, slots)
        meta.num_decodes = num_decodes
        want = paged.forward(query, key, value, cache, meta, scale, **extra)
        torch.testing.assert_close(out, want, **_tol(dtype))


# --- fused MoE -----------------------------------------------------------------------------


def _moe_problem(
    seed: int, num_tokens: int, top_k: int, dtype: torch.dtype, no_token: int | None = None
) -> tuple[torch.Tensor, ...]:
    """x [T, 40], w13 [5, 48, 40], w2 [5, 40, 24] (odd sizes: masks on every dim), and the
    softmax top-k routing (weights, int32 ids); expert `no_token`, if given, gets no token."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, num_experts = 40, 24, 5
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)).to(dtype)
    w2 = (0.2 * torch.randn(num_experts, hidden, inter, generator=gen)).to(dtype)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    if no_token is not None:
        scores[:, no_token] = -1e9
    topk_weights, topk_ids = scores.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, topk_weights, topk_ids.to(torch.int32)


@_case(
    *(
        {"num_experts": e, "num_tokens": t, "top_k": k, "block_m": m, "programs": p}
        for e, t, k, m, p in [
            (5, 13, 2, 16, 128),
            (128, 100, 8, 16, 128),
            (128, 100, 8, 16, 3),
            (128, 70, 8, 64, 2),
            (8, 300, 2, 128, 2),
        ]
    )
)
def case_moe_align_block_size(
    num_experts: int, num_tokens: int, top_k: int, block_m: int, programs: int
) -> None:
    """The three-launch alignment (`tandem_kernels/moe_align.py`) against its torch reference,
    every output equal: pairs over several chunks (128 experts: 128 pairs a chunk), a program
    taking one chunk or several (`_PROGRAMS` lowered), experts with no pair, ids of another
    rank's experts (>= E) left out, tiles of 16 to 128 rows."""
    from tandem_kernels import moe_align

    saved, moe_align._PROGRAMS = moe_align._PROGRAMS, programs
    gen = torch.Generator().manual_seed(num_experts + num_tokens)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, 1] = -1.0  # expert 1 gets no pair
    topk_ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    topk_ids[::7, -1] = num_experts + 3
    try:
        got = moe_align.moe_align_block_size(topk_ids, block_m, num_experts)
    finally:
        moe_align._PROGRAMS = saved
    want = moe_align.moe_align_block_size_ref(topk_ids, block_m, num_experts)
    for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_post"), got, want, strict=True):
        assert g.dtype == torch.int32 and torch.equal(g, w.to(torch.int32)), name


@_case(
    *(
        {"dtype": d, "block_m": m, "other_rank": o}
        for d, m, o in [
            (torch.float32, 16, False),
            (torch.float16, 16, False),
            (torch.float32, 32, True),
        ]
    )
)
def case_fused_moe(dtype: torch.dtype, block_m: int, other_rank: bool) -> None:
    """Tokens routed to 2 of 5 experts (one expert gets none), odd sizes (masks on every
    dim); `other_rank`: some ids name experts another rank holds (id >= E): they add nothing."""
    k = _kernels()
    num_tokens, hidden, num_experts, top_k = 13, 40, 5, 2
    x, w13, w2, topk_weights, topk_ids = _moe_problem(3, num_tokens, top_k, dtype, no_token=3)
    if other_rank:
        topk_ids[::3, 1] = num_experts
    sorted_ids, expert_ids, num_post = k.fused_moe.moe_align_block_size(
        topk_ids, block_m, num_experts
    )
    # Every pair appears once, in a tile of its own expert.
    real = sorted_ids[sorted_ids < num_tokens * top_k].long()
    mine = (topk_ids.reshape(-1) < num_experts).nonzero().reshape(-1)
    assert torch.equal(real.sort().values, mine)
    positions = (sorted_ids < num_tokens * top_k).nonzero().reshape(-1)
    assert torch.equal(expert_ids[positions // block_m].long(), topk_ids.reshape(-1)[real].long())
    assert int(num_post) % block_m == 0 and int(num_post) <= sorted_ids.shape[0]
    config = k.fused_moe.MoEConfig(block_m, 32, 16, 2, 4, 1)
    out = k.fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, config)
    ref = k.moe_ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(out, ref, **_tol(dtype))


@_case(
    *(
        {"dtype": d, "block_m": m, "block_n": n}
        for d, m, n in [(torch.float32, 16, 16), (torch.float16, 16, 16), (torch.float32, 32, 32)]
    )
)
def case_fused_moe_silu_epilogue(dtype: torch.dtype, block_m: int, block_n: int) -> None:
    """GEMM 1 with SiLU in its epilogue (no gate_up buffer, no separate SiLU pass) against the
    reference and against the unfused form with the same tiles: absent experts' pairs (ids
    >= E) mixed in, padding rows in the tiles, I = 24 not a multiple of block_n (16: a
    partial second tile; 32: one tile wider than I). Buffers start as NaN, so an unmasked
    read of an unwritten row shows."""
    k = _kernels()
    fm = k.fused_moe
    num_tokens, hidden, inter, num_experts, top_k = 13, 40, 24, 5, 2
    x, w13, w2, topk_weights, topk_ids = _moe_problem(5, num_tokens, top_k, dtype, no_token=1)
    topk_ids[::4, 0] = num_experts
    topk_ids[5] = num_experts + 2
    assert inter % block_n != 0
    _, _, num_post = fm.moe_align_block_size(topk_ids, block_m, num_experts)
    assert int(num_post) > int((topk_ids < num_experts).sum()), "no padding rows"
    fused = fm.MoEConfig(block_m, block_n, 16, 2, 4, 1, silu_in_epilogue=True)
    unfused = fused._replace(silu_in_epilogue=False)
    ref = k.moe_ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    assert ref.abs().max() > 0.1 and torch.equal(ref[5], torch.zeros_like(ref[5]))
    with nan_filled_empty():
        expected = fm.fused_moe(x, w13, w2, topk_weights, topk_ids, unfused)
        with unittest.mock.patch.object(fm, "silu_and_mul", side_effect=AssertionError):
            out = fm.fused_moe(x, w13, w2, topk_weights, topk_ids, fused)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    # Gate and up are rounded as the unfused form stores them: the same values, bit for bit
    # (the interpreter's dot is numpy's matmul on tiles of the same shapes in both forms).
    assert torch.equal(out, expected)
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    assert fm.config_name(fused) == f"silu-epilogue:{block_m}x{block_n}x16x2x4x1"
    assert fm.config_name(unfused) == f"{block_m}x{block_n}x16x2x4x1"
    down = fused._replace(down=fm.GemmTiles(32, 8, 1, 4, 1))
    assert fm.config_name(down) == f"silu-epilogue:{block_m}x{block_n}x16x2x4x1/down:32x8x1x4x1"
    for config in (fused, unfused, down, *fm._CANDIDATES, *fm._DECODE_CANDIDATES):
        back = fm.config_from_name(fm.config_name(config))
        assert back == config and type(back) is type(config)


@_case(*({"dtype": d} for d in DTYPES))
def case_fused_moe_fp8_weights(dtype: torch.dtype) -> None:
    """FP8 (e4m3) expert weights with a scale per expert and row (`w13_scale`, `w2_scale`),
    activations in `dtype`, against the reference on the same weights dequantized, through
    the grouped path (unfused, SiLU in the epilogue, GEMM 2's own tiles) and the decode
    path, absent experts mixed in, buffers handed out full of NaN."""
    k = _kernels()
    fm = k.fused_moe
    num_tokens, num_experts, top_k = 13, 5, 2
    x, w13, w2, topk_weights, topk_ids = _moe_problem(13, num_tokens, top_k, dtype)
    topk_ids[3::5, 1] = num_experts
    from tandem_kernels.fp8 import quantize_expert_rows

    q13, s13 = quantize_expert_rows(w13)
    q2, s2 = quantize_expert_rows(w2)
    assert q13.dtype == torch.float8_e4m3fn and s13.shape == (num_experts, 48)
    deq13 = k.moe_ref.dequantize_expert_rows(q13, s13, dtype)
    assert (deq13.float() - w13.float()).abs().max() <= 0.07 * w13.float().abs().max()
    ref = k.moe_ref.fused_moe_ref(x, q13, q2, topk_weights, topk_ids, s13, s2)
    assert ref.abs().max() > 0.1
    unfused = fm.MoEConfig(16, 16, 16, 2, 4, 1)
    configs = (
        unfused,
        unfused._replace(silu_in_epilogue=True),
        unfused._replace(silu_in_epilogue=True, down=fm.GemmTiles(32, 16, 1, 4, 1)),
        fm.DecodeConfig(16, 16, 1, 16, 16, 1, 4),
    )
    # H = 40 and I = 24 bytes a row in e4m3: no TMA (16-byte rows); the GPU test takes it.
    assert not fm.b_tma_usable(q13, q2)
    for config in configs:
        with nan_filled_empty():
            out = fm.fused_moe(
                x, q13, q2, topk_weights, topk_ids, config, w13_scale=s13, w2_scale=s2
            )
        assert out.dtype == dtype and not out.isnan().any(), config
        torch.testing.assert_close(out, ref, **_tol(dtype))
    # W8A8 (`fp8_act`): x and act quantized per token, e4m3 dots; against the same steps
    # one pair at a time (x quantized per row by the activation quantizer the layers use,
    # each pair's gate and up rounded to dtype, SiLU-and-mul, act quantized per row, the
    # routed weight, the sum over the token's pairs).
    from tandem_kernels import fp8

    xq, xs = fp8.dynamic_quant_per_token(x)
    x8 = xq.float() * xs
    deq2 = k.moe_ref.dequantize_expert_rows(q2, s2, torch.float32)
    emulated = torch.zeros(num_tokens, x.shape[1])
    for pair, expert in enumerate(topk_ids.reshape(-1).tolist()):
        if expert >= num_experts:
            continue
        token = pair // top_k
        gate_up = (x8[token] @ deq13[expert].float().T).to(dtype)
        act = k.activation.silu_and_mul_ref(gate_up.unsqueeze(0))
        aq, a_s = fp8.dynamic_quant_per_token(act)
        y = (aq.float() * a_s) @ deq2[expert].T * topk_weights[token, pair % top_k]
        emulated[token] += y[0].to(dtype).float()
    for silu in (False, True):
        config = unfused._replace(silu_in_epilogue=silu, fp8_act=True)
        assert fm.config_from_name(fm.config_name(config)) == config
        assert fm.config_name(config).endswith("+a8")
        with nan_filled_empty():
            out = fm.fused_moe(
                x, q13, q2, topk_weights, topk_ids, config, w13_scale=s13, w2_scale=s2
            )
        assert out.dtype == dtype and not out.isnan().any(), config
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # fp16: act's one rounding apart
        torch.testing.assert_close(out.float(), emulated, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="need FP8 weights"):
        fm.fused_moe(x, w13, w2, topk_weights, topk_ids, unfused._replace(fp8_act=True))


@_case(
    *(
        {"dtype": d, "bn": bn, "bk": bk, "hidden": h, "inter": i}
        for d, bn, bk, h, i in [
            (torch.float32, 16, 16, 40, 24),
            (torch.float16, 16, 16, 40, 24),
            (torch.float32, 8, 32, 40, 24),
            (torch.float32, 32, 16, 48, 32),
            (torch.float16, 32, 16, 48, 32),
        ]
    )
)
def case_fused_moe_block_fp8_weights(
    dtype: torch.dtype, bn: int, bk: int, hidden: int, inter: int
) -> None:
    """FP8 (e4m3) expert weights with a scale per expert and `bn x bk` tile (a block-scaled
    checkpoint's layout, `weight_block_size`), activations in `dtype`, against the reference
    on the same weights dequantized: the grouped path (unfused, SiLU in the epilogue, GEMM
    2's own tiles, BLOCK_K 16 over bk 32: two K steps a tile column), the decode path and
    the untuned default, absent experts mixed in, buffers handed out full of NaN. Tiles cut
    every dim short (H 40, I 24 over 16 or 32), BLOCK_N 16 spans two tile rows of bn 8 and
    half of one of bn 32; (48, 32): e4m3 rows of 16-byte multiples, so the weights also go
    through TMA. A BLOCK_K that does not divide bk is refused. W8A8 (`fp8_act`: x and act in
    e4m3 per token and bk columns, e4m3 dots, each K step's partial sums scaled by both
    sides' scales), both SiLU forms, down tiles and TMA: close to the same steps emulated one
    pair at a time with the same quantizer, much closer than the weight-only result is (a
    kernel that ignored `fp8_act` fails there); that emulation with torch's quantizer is
    within FP8's error of the reference (the kernel's own error here is the interpreter's
    e4m3 cast's too: its dropped carries; tests/gpu checks 0.06)."""
    k = _kernels()
    fm = k.fused_moe
    from tandem_kernels.fp8 import quantize_expert_blocks

    block = (bn, bk)
    num_tokens, num_experts, top_k = 13, 5, 2
    gen = torch.Generator().manual_seed(17)
    # Columns of different magnitudes: an activation group's scale on the wrong K step shows.
    x = (torch.randn(num_tokens, hidden, generator=gen) * torch.linspace(0.2, 3, hidden)).to(dtype)
    w13 = 0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    w2 = 0.2 * torch.randn(num_experts, hidden, inter, generator=gen)
    # Tiles of very different magnitudes: a scale applied to the wrong tile shows.
    w13 *= 0.25 + torch.rand(num_experts, 2 * inter, 1, generator=gen)
    w2 *= 0.25 + torch.rand(num_experts, 1, inter, generator=gen)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = scores.softmax(-1).topk(top_k, dim=-1)
    topk_ids = topk_ids.to(torch.int32)
    topk_ids[3::5, 1] = num_experts
    q13, s13 = quantize_expert_blocks(w13, block)
    q2, s2 = quantize_expert_blocks(w2, block)
    assert q13.dtype == torch.float8_e4m3fn
    assert s13.shape == (num_experts, -(-2 * inter // bn), -(-hidden // bk))
    assert s2.shape == (num_experts, -(-hidden // bn), -(-inter // bk))
    deq13 = k.moe_ref.dequantize_expert_blocks(q13, s13, block, torch.float32)
    assert ((deq13 - w13).abs() <= w13.abs() * 2**-4 + s13.max() * 2**-9).all()
    ref = k.moe_ref.fused_moe_ref(x, q13, q2, topk_weights, topk_ids, s13, s2, block)
    assert ref.abs().max() > 0.1
    scales = {"w13_scale": s13, "w2_scale": s2, "weight_block_size": block}
    unfused = fm.MoEConfig(16, 16, 16, 2, 4, 1)
    configs = [
        unfused,
        unfused._replace(silu_in_epilogue=True),
        unfused._replace(silu_in_epilogue=True, down=fm.GemmTiles(32, 16, 1, 4, 1)),
        fm.DecodeConfig(16, 16, 1, 16, 16, 1, 4),
        fm.DecodeConfig(8, bk, 1, 16, bk, 2, 4),
        None,  # the untuned default: the decode path here, for_block_size
    ]
    if fm.b_tma_usable(q13, q2):
        assert (hidden, inter) == (48, 32)
        configs += [c._replace(b_tma=True) for c in configs[:3]]
    for config in configs:
        assert config is None or fm.fits_block(config, block)
        with nan_filled_empty():
            out = fm.fused_moe(x, q13, q2, topk_weights, topk_ids, config, **scales)
        assert out.dtype == dtype and not out.isnan().any(), config
        torch.testing.assert_close(out, ref, **_tol(dtype))
    # Only the weights changed: the row-scaled and bf16 forms are untouched by a block call.
    assert fm._shape_key(q13, top_k, block) != fm._shape_key(q13, top_k)
    wide = (
        unfused._replace(block_k=2 * bk),
        unfused._replace(down=fm.GemmTiles(16, 2 * bk, 1, 4, 1)),
        fm.DecodeConfig(16, 2 * bk, 1, 16, 16, 1, 4),
    )
    for config in wide:
        assert not fm.fits_block(config, block)
        assert fm.fits_block(fm.for_block_size(config, bk), block)
        with pytest.raises(ValueError, match="must divide the weights' block columns"):
            fm.fused_moe(x, q13, q2, topk_weights, topk_ids, config, **scales)
    # W8A8: against x quantized per token group, each pair's gate and up rounded to dtype,
    # SiLU-and-mul, act quantized per token group, the routed weight, the sum over the
    # token's pairs; quantized by the activation quantizer the kernel runs (here with the
    # interpreter's e4m3 cast, whose dropped carries add to FP8's error), and by torch's.
    from tandem_kernels import fp8

    deq2 = k.moe_ref.dequantize_expert_blocks(q2, s2, block, torch.float32)

    def emulate(quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        def per_group(t: torch.Tensor) -> torch.Tensor:
            q, scale = quantize(t, bk)
            assert scale.shape == (t.shape[0], -(-t.shape[1] // bk))
            return q.float() * scale.repeat_interleave(bk, 1)[:, : t.shape[1]]

        x8 = per_group(x)
        assert (x8 != x.float()).any()
        out = torch.zeros(num_tokens, hidden)
        for pair, expert in enumerate(topk_ids.reshape(-1).tolist()):
            if expert >= num_experts:
                continue
            token = pair // top_k
            gate_up = (x8[token] @ deq13[expert].T).to(dtype)
            act = per_group(k.activation.silu_and_mul_ref(gate_up.unsqueeze(0)))
            y = act @ deq2[expert].T * topk_weights[token, pair % top_k]
            out[token] += y[0].to(dtype).float()
        return out

    emulated = emulate(fp8.dynamic_quant_per_token_group)
    torch_quantized = emulate(fp8.quantize_per_token_group)
    assert (torch_quantized - ref.float()).norm() < 0.06 * ref.float().norm()  # FP8's error
    weight_only = fm.fused_moe(x, q13, q2, topk_weights, topk_ids, unfused, **scales).float()
    a8_configs = [c._replace(fp8_act=True) for c in configs if isinstance(c, fm.MoEConfig)]
    assert len(a8_configs) == (6 if fm.b_tma_usable(q13, q2) else 3)
    for config in a8_configs:
        assert fm.fits_block(config, block) and fm.config_name(config).endswith("+a8")
        with nan_filled_empty():
            out = fm.fused_moe(x, q13, q2, topk_weights, topk_ids, config, **scales)
        assert out.dtype == dtype and not out.isnan().any(), config
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # fp16: act's one rounding apart
        torch.testing.assert_close(out.float(), emulated, atol=tol, rtol=tol)
        off = (out.float() - emulated).norm()
        assert off < 0.1 * (weight_only - emulated).norm(), (config, off)


@_case(*({"dtype": d, "silu_in_epilogue": f} for d in DTYPES for f in (False, True)))
def case_fused_moe_b_tma(dtype: torch.dtype, silu_in_epilogue: bool) -> None:
    """The weights through TMA descriptors (`MoEConfig.b_tma`) against the reference and
    against the pointer loads with the same tiles, bit for bit: I = 24 over block_n 16 (GEMM
    1's last tile reads past an expert's rows into the next's, or past the end: masked at
    the store), K = 40 over block_k 16 (columns past K read zeros), H = 40 over GEMM 2's
    block_n 32, absent experts' pairs mixed in, buffers handed out full of NaN."""
    k = _kernels()
    fm = k.fused_moe
    num_tokens, num_experts, top_k = 13, 5, 2
    x, w13, w2, topk_weights, topk_ids = _moe_problem(11, num_tokens, top_k, dtype)
    topk_ids[2::5, 0] = num_experts
    assert fm.b_tma_usable(w13, w2)
    plain = fm.MoEConfig(16, 16, 16, 2, 4, 1, silu_in_epilogue, fm.GemmTiles(32, 16, 1, 4, 1))
    tma = plain._replace(b_tma=True)
    ref = k.moe_ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    with nan_filled_empty():
        expected = fm.fused_moe(x, w13, w2, topk_weights, topk_ids, plain)
        out = fm.fused_moe(x, w13, w2, topk_weights, topk_ids, tma)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    assert torch.equal(out, expected)
    assert fm.config_name(tma) == fm.config_name(plain) + "+tma"
    assert fm.config_from_name(fm.config_name(tma)) == tma
    # Weights one element off a 16-byte boundary (another layer than the tuned one, say):
    # TMA cannot read them, and the TMA config falls back to pointer loads.
    shifted = []
    for w in (w13, w2):
        buf = torch.empty(w.numel() + 1, dtype=dtype)
        view = buf[1:].view(w.shape)
        view.copy_(w)
        shifted.append(view)
    assert not fm.b_tma_usable(*shifted)
    with nan_filled_empty():
        fallback = fm.fused_moe(x, *shifted, topk_weights, topk_ids, tma)
    assert torch.equal(fallback, expected)


@_case(*({"dtype": d, "silu_in_epilogue": f} for d in DTYPES for f in (False, True)))
def case_fused_moe_down_tiles(dtype: torch.dtype, silu_in_epilogue: bool) -> None:
    """GEMM 2 with tiles of its own (`MoEConfig.down`; block_m shared): block_n 32 over H 40
    (a partial tile), block_k 8 over I 24, against the reference, absent experts mixed in;
    GEMM 1 keeps the config's own tiles."""
    k = _kernels()
    fm = k.fused_moe
    num_tokens, num_experts, top_k = 13, 5, 2
    x, w13, w2, topk_weights, topk_ids = _moe_problem(9, num_tokens, top_k, dtype)
    topk_ids[1::4, 1] = num_experts
    down = fm.GemmTiles(32, 8, 1, 4, 1)
    config = fm.MoEConfig(16, 16, 16, 2, 4, 1, silu_in_epilogue, down=down)
    assert config.down_tiles == down and config.gate_up_tiles == fm.GemmTiles(16, 16, 2, 4, 1)
    assert config._replace(down=None).down_tiles == config.gate_up_tiles
    ref = k.moe_ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    with (
        nan_filled_empty(),
        unittest.mock.patch.object(fm, "_launch", wraps=fm._launch) as launch,
    ):
        out = fm.fused_moe(x, w13, w2, topk_weights, topk_ids, config)
    calls = [c.args[9:12] for c in launch.call_args_list]  # block_m, tiles, b_tma
    assert calls == [(16, config.gate_up_tiles, False), (16, down, False)]
    torch.testing.assert_close(out, ref, **_tol(dtype))


@_case(*({"dtype": d, "silu_in_epilogue": f} for d in DTYPES for f in (False, True)))
def case_fused_moe_zero_fill(dtype: torch.dtype, silu_in_epilogue: bool) -> None:
    """The down rows start as zeros only where some pair may name another rank's expert:
    `all_experts_local=True` on local ids equals the reference with every buffer handed out
    full of NaN (every row is written); ids >= E by default are still right and finite (the
    fill is taken); and ids >= E under the keyword (a caller's broken promise) give NaN
    exactly in the tokens with such a pair, which shows the fill was skipped."""
    k = _kernels()
    fm = k.fused_moe
    num_tokens, num_experts, top_k = 11, 5, 2
    x, w13, w2, topk_weights, topk_ids = _moe_problem(7, num_tokens, top_k, dtype)
    ep_ids = topk_ids.clone()
    ep_ids[::3, 1] = num_experts
    ep_ids[4] = num_experts + 1
    config = fm.MoEConfig(16, 16, 16, 2, 4, 1, silu_in_epilogue)
    ref = k.moe_ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    ep_ref = k.moe_ref.fused_moe_ref(x, w13, w2, topk_weights, ep_ids)
    with nan_filled_empty():
        local = fm.fused_moe(x, w13, w2, topk_weights, topk_ids, config, all_experts_local=True)
        ep = fm.fused_moe(x, w13, w2, topk_weights, ep_ids, config)
        broken = fm.fused_moe(x, w13, w2, topk_weights, ep_ids, config, all_experts_local=True)
    torch.testing.assert_close(local, ref, **_tol(dtype))
    torch.testing.assert_close(ep, ep_ref, **_tol(dtype))
    assert torch.equal(ep[4], torch.zeros_like(ep[4]))
    has_absent = (ep_ids >= num_experts).any(dim=1)
    assert torch.equal(broken.isnan().all(dim=1), has_absent)
    assert torch.equal(broken.isnan().any(dim=1), has_absent)


@_case(
    *(
        {"dtype": d, "num_tokens": t, "other_rank": o}
        for d, t, o in [
            (torch.float32, 1, False),
            (torch.float32, 1, True),
            (torch.float32, 3, True),
            (torch.float32, 8, True),
            (torch.float16, 8, False),
            (torch.float16, 3, True),
        ]
    )
)
def case_fused_moe_decode(dtype: torch.dtype, num_tokens: int, other_rank: bool) -> None:
    """The decode path (no sorting: a GEMV per pair, then one per token over its top_k)
    against the reference: tokens routed to 3 of 5 experts, odd sizes (masks on every dim,
    tiles smaller and larger than them); `other_rank`: ids >= E (experts another rank holds)
    add nothing (every other token's second; with more than one token, all of the last one's:
    it gets zeros)."""
    k = _kernels()
    fm = k.fused_moe
    hidden, num_experts, top_k = 40, 5, 3
    x, w13, w2, topk_weights, topk_ids = _moe_problem(num_tokens, num_tokens, top_k, dtype)
    if other_rank:
        topk_ids[::2, 1] = num_experts
        if num_tokens > 1:
            topk_ids[-1] = num_experts + 1
    # Untuned, the decode path runs up to 2 expected rows per expert (here T <= 3).
    default = fm.default_config(num_tokens, top_k, num_experts)
    assert isinstance(default, fm.DecodeConfig) == (num_tokens <= 3)
    ref = k.moe_ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    assert ref.abs().max() > 0.1
    for config in (fm.DecodeConfig(8, 16, 1, 16, 16, 2, 4), fm._DEFAULT_DECODE):
        for ids in (topk_ids, topk_ids.long()):
            out = fm.fused_moe(x, w13, w2, topk_weights, ids, config)
            assert out.dtype == dtype and out.shape == (num_tokens, hidden)
            torch.testing.assert_close(out, ref, **_tol(dtype))
            if other_rank and num_tokens > 1:
                assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    # The same call by default (untuned on the CPU: `default`).
    torch.testing.assert_close(fm.fused_moe(x, w13, w2, topk_weights, topk_ids), ref, **_tol(dtype))


# --- runner -------------------------------------------------------------------------------


def selected_cases(items: list[pytest.Item]) -> list[str]:
    """The interpreter cases among the collected `items`."""
    module = sys.modules[__name__]
    names = {
        item.callspec.params["case"]
        for item in items
        if getattr(item, "module", None) is module and hasattr(item, "callspec")
    }
    return sorted(names & _CASES.keys())


class InterpChild:
    """The interpreter child running the selected cases, started once the session is
    collected (tests/unit/conftest.py) so it runs on the spare core, at the lowest priority,
    while the suite's other files run; the first case waits for its results. One thread for
    torch, numpy and OpenMP: it must not crowd the tests beside it."""

    def __init__(self, cases: list[str]) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = "1"
        self._proc = subprocess.Popen(
            [sys.executable, __file__, *cases],
            env=env,
            cwd=_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: os.nice(19),
        )
        self._output: tuple[str, str] = ("", "")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        self._output = self._proc.communicate()

    def results(self, timeout_s: float = 900.0) -> dict[str, str]:
        """Case name -> "ok" or the traceback; waits up to `timeout_s` from now (at full
        priority where the system allows raising it back)."""
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self._proc.pid, 0)
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            self.stop()
            pytest.fail(f"interpreter child still running after {timeout_s:.0f} s")
        stdout, stderr = self._output
        for line in reversed(stdout.splitlines()):
            if line.startswith(_RESULTS_MARK):
                return json.loads(line.removeprefix(_RESULTS_MARK))
        pytest.fail(f"interpreter child failed (rc {self._proc.returncode}):\n{stdout}\n{stderr}")

    def stop(self) -> None:
        """Kill the child if it still runs (a session stopped early)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._reader.join()


INTERP_CHILD = pytest.StashKey[InterpChild]()


@pytest.fixture(scope="module")
def interp_results(request: pytest.FixtureRequest) -> dict[str, str]:
    """Run the selected cases in one interpreter child; case name -> "ok" or the traceback.
    The child started at collection's end where the conftest hook ran, else here."""
    child = request.config.stash.get(INTERP_CHILD, None)
    if child is None:
        child = InterpChild(selected_cases(request.session.items))
        request.config.stash[INTERP_CHILD] = child
    return child.results()


@pytest.mark.parametrize("case", sorted(_CASES))
def test_kernel_interp(case: str, interp_results: dict[str, str]) -> None:
    result = interp_results.get(case, "not run")
    if result != "ok":
        pytest.fail(f"{case}:\n{result}", pytrace=False)


def _patch_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses
    (triton-lang/triton#9171); `range(0, tensor_bound)` in a kernel needs it."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor


def _run_cases(names: list[str]) -> dict[str, str]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    assert "triton" not in sys.modules
    _patch_interpreter_for_numpy_2_4()
    assert type(_kernels().paged_attention._prefill_kernel).__name__ == "InterpretedFunction"
    results = {}
    for name in names or sorted(_CASES):
        try:
            _CASES[name]()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    return results


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(_ROOT))
    outcome = _run_cases(sys.argv[1:])
    for case_name, text in outcome.items():
        print(f"{case_name}: {'ok' if text == 'ok' else 'FAILED'}", file=sys.stderr)
    print(_RESULTS_MARK + json.dumps(outcome))
