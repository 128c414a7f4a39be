"""FP8 weights, 16-bit activations (W8A16) for the small batches of decode.

`y = x @ (W_fp8 * s)^T`, W `[N, K]` e4m3 with a per-tensor (`[]`) or per-output-channel
(`[N, 1]`) float32 scale, x `[M, K]` in the model's dtype (bf16, fp16; fp32 for tests).
Activations are not quantized at all; the scale is applied once to the fp32 sum.

Why: at decode batch sizes a linear layer is bound by reading its weight. FP8 halves the bytes,
but cuBLASLt's e4m3 GEMM (`torch._scaled_mm`) was slower than the bf16 GEMM it replaces at
M <= 64 on the H200 (qkv of the 8B at M = 1: 2.1 against 2.7 TFLOP/s), before the activation
quantization pass it also needs. Which path serves which batch size is measured per weight shape
when the weights load (`tune_w8a16`): this module's candidate configs against the scaled-GEMM
path the layer would otherwise run, at each bucket of `M_BUCKETS`. Larger batches keep the
scaled GEMM, whose FP8 tensor cores then pay.

Three kernel forms, one launch (`w8a16_gemm`), chosen by the config:

    BLOCK_M >= 16   tensor-core form: each weight tile widened to x's dtype in registers and
                    fed to a 16-bit dot, `x W^T` (rows padded to 16)
      swap_ab       the same as `W x^T`: the 64-128 weight rows the dot's M side (on Hopper a
                    warpgroup MMA can take the widened weight from registers), the rows its
                    16-wide N side; transposed once at the end
    BLOCK_M < 16    GEMV form (M = 1..8): the weight tile read with 16-byte loads, widened to
                    fp32 and reduced against each of the BLOCK_M rows on the CUDA cores (one
                    row: products summed in place, reduced across K once at the end)

`gated`: x is a SiLU-and-mul's input (gate | up) and the kernels compute the activation as
they load x, with that kernel's rounding (`GatedActivation`, tandem.layers.quantization.
input_quant): down_proj at small batches without the SiLU-and-mul launch.

Split-K (both forms): the grid is `[N / BLOCK_N, M / BLOCK_M, SPLIT_K]`; program `k` sums its
slice of K. A 4096-row weight in 16-row blocks is only 256 programs, too few to keep 132 SMs'
loads in flight; SPLIT_K = 4 makes 1024. The slices are summed in the same launch by the last
program of each tile (tandem_kernels.split_k); the lock buffer (`w8a16_locks`, made by the
layer after loading) is all zeros between calls.

Reference: `w8a16_gemm_ref` (dequantize, then matmul in fp32).

16-bit weights take the same kernels (W16A16: the weight in x's dtype, a scale of one), for
the unquantized linear layers and the LM head at the batch buckets where they time faster
than the 16-bit GEMM at load (`tune_w16a16`; TANDEM_W16A16=off turns it off:
`w16a16_setting`). On an H100, 8B shape in bf16: batch-1 decode 6.32 -> 5.96 ms.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem_kernels.pdl import launch_options, pdl_launch, pdl_wait
from tandem_kernels.split_k import k_slice, split_k_buffers, store_tile

# Batch sizes (rows of x) measured at load; a call with M rows uses the smallest bucket >= M.
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Config(NamedTuple):
    """One W8A16 launch: tile sizes, K slices (`split_k`), Triton's warps and stages.
    `block_m` < 16 selects the GEMV form; `swap_ab` the tensor-core form that multiplies
    `W x^T` (the weight tile the dot's wide side, the few rows its narrow one); `prefetch`
    the GEMV form that loads the next weight chunk before it sums the current one (twice the
    bytes in flight a program, for more registers); `reduce_each` (see `in_place`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False
    prefetch: bool = False
    reduce_each: bool = False

    @property
    def name(self) -> str:
        flags = ("s" if self.swap_ab else "") + ("p" if self.prefetch else "")
        return "x".join(map(str, self[:6])) + flags + ("r" if self.reduce_each else "")

    @property
    def in_place(self) -> bool:
        """The one-row GEMV's products summed in place, `[BLOCK_N, BLOCK_K]` fp32, and reduced
        across K once at the end; `reduce_each`: each chunk reduced as it comes (no such
        accumulator: fewer registers, a warp reduction a chunk)."""
        return self.block_m == 1 and not self.reduce_each


def _gemv(m: int) -> tuple[Config, ...]:
    """GEMV candidates for `m` rows: no split for wide N (gate_up's 28672 rows are 1792
    programs), split-K for N = 4096-6144 (qkv, o, down), 8- to 32-row blocks, 8-16 KB tiles.
    One and two rows also try the prefetching loop (`Config.prefetch`) on the 4- and 8-KB
    tiles of 4 warps, and one row the loop that reduces each chunk as it comes
    (`Config.reduce_each`). On sm_90a (`python -m benchmarks.kernel_registers --w8a16`) the
    one-row plain loop's best configs hold 28-32 KB of weight in flight an SM (126 registers,
    4 blocks of 4 warps); prefetching, 40-48 KB; reducing each chunk, 40-96 KB (47-96
    registers, 5-10 blocks)."""
    plain = (
        Config(m, 16, 512, 1, 4, 1),
        Config(m, 32, 512, 1, 8, 1),
        Config(m, 16, 512, 4, 4, 1),
        Config(m, 16, 256, 8, 4, 1),
        Config(m, 8, 1024, 4, 4, 1),
    )
    if m > 2:
        return plain
    prefetching = (
        Config(m, 16, 512, 1, 4, 1, prefetch=True),
        Config(m, 16, 512, 4, 4, 1, prefetch=True),
        Config(m, 16, 256, 8, 4, 1, prefetch=True),
        Config(m, 8, 512, 4, 4, 1, prefetch=True),
    )
    if m > 1:
        return plain + prefetching
    reducing = (
        Config(1, 16, 512, 4, 4, 1, reduce_each=True),
        Config(1, 16, 512, 4, 4, 1, prefetch=True, reduce_each=True),
        Config(1, 16, 256, 8, 4, 1, reduce_each=True),
        Config(1, 32, 512, 1, 8, 1, reduce_each=True),
        Config(1, 16, 512, 1, 4, 1, prefetch=True, reduce_each=True),
        Config(1, 32, 512, 4, 4, 1, reduce_each=True),
    )
    # A K slice of 4,096 (qkv, o) in one chunk: with PDL the whole slice is read before the
    # wait (`EARLY_WEIGHT`), while the kernel before still runs (`chain_lead`).
    whole_slice = (
        Config(1, 16, 512, 8, 4, 1),
        Config(1, 16, 512, 8, 4, 1, reduce_each=True),
        Config(1, 8, 1024, 4, 4, 1, reduce_each=True),
    )
    return plain + prefetching + reducing + whole_slice


# The tensor-core form split along K: the same 16-row tiles, 4x the programs for N = 4096.
_DOT_SPLIT: tuple[Config, ...] = (
    Config(16, 32, 256, 4, 4, 4),
    Config(16, 64, 256, 2, 4, 4),
    Config(16, 32, 512, 2, 4, 3),
    Config(16, 16, 512, 4, 4, 3),
)
# `W x^T`, split along K: 64- and 128-row weight tiles as the dot's M side (on Hopper a
# warpgroup MMA with the widened weight in registers), the rows padded to 16 its N side.
_DOT_SWAP: tuple[Config, ...] = (
    Config(16, 64, 128, 8, 4, 3, True),
    Config(16, 64, 256, 4, 4, 3, True),
    Config(16, 128, 128, 4, 8, 3, True),
)
# Unsplit tensor-core tiles (the winners of the first measurements at M <= 16 first).
_DOT_16: tuple[Config, ...] = (
    Config(16, 32, 512, 1, 4, 3),
    Config(16, 32, 256, 1, 4, 4),
    Config(16, 64, 256, 1, 4, 4),
    Config(16, 16, 256, 1, 4, 4),
    Config(16, 16, 512, 1, 4, 3),
    Config(16, 64, 128, 1, 4, 4),
    Config(16, 32, 128, 1, 2, 8),
    Config(16, 32, 1024, 1, 8, 3),
)


def _dot(*tiles: tuple[int, int, int, int, int]) -> tuple[Config, ...]:
    return tuple(Config(bm, bn, bk, 1, w, s) for bm, bn, bk, w, s in tiles)


_CANDIDATES: dict[int, tuple[Config, ...]] = {
    1: _gemv(1) + _DOT_SWAP + _DOT_SPLIT + _DOT_16[:1],
    2: _gemv(2) + _DOT_SWAP + _DOT_SPLIT + _DOT_16[:1],
    4: _gemv(4) + _DOT_SWAP + _DOT_SPLIT + _DOT_16[:1],
    8: _gemv(8) + _DOT_SWAP + _DOT_SPLIT + _DOT_16[:3],
    16: _DOT_SWAP + _DOT_SPLIT + _DOT_16[:4],
    32: _dot((32, 32, 256, 4, 4), (32, 64, 256, 4, 3), (32, 64, 128, 4, 4), (32, 128, 128, 8, 3)),
    64: _dot((64, 64, 128, 4, 4), (64, 64, 256, 4, 3), (64, 128, 128, 8, 3), (64, 32, 256, 4, 4)),
    128: _dot(
        (64, 64, 128, 4, 4), (128, 128, 128, 8, 3), (64, 128, 128, 8, 3), (128, 64, 128, 4, 4)
    ),
    256: _dot(
        (128, 128, 128, 8, 3), (128, 64, 128, 4, 4), (64, 128, 128, 8, 3), (128, 256, 64, 8, 3)
    ),
}
# About 62 distinct kernels to compile over all buckets (GEMV: one per row count), the most
# of an 8B model's tuning at load; the timing itself is ~1-3 s a weight shape.
# Used without tuning (TANDEM_TUNE_KERNELS=0 on CUDA, the interpreter): this kernel up to
# M = 16, the scaled GEMM above.
_DEFAULT = Config(16, 32, 256, 1, 4, 4)
_DEFAULT_MAX_M = 16
# Batches up to this many rows may take a SiLU-and-mul's input ungated (`w8a16_gemm(...,
# gated=True)`): each of the N / BLOCK_N programs recomputes its K slice of it for its rows.
# Measured on the H200 at the 8B down shape: one row, the GEMV form, 21.1 us against 22.3 for
# SiLU-and-mul then the GEMM; two and four rows, the tile form, 149 us against 27.
GATED_MAX_M = 1
# The narrowest output block of any split-K candidate: `w8a16_locks` holds a lock per tile.
_MIN_SPLIT_BLOCK_N = 8

# (N, K, x dtype, baseline name) -> {bucket: config, or None for the baseline}.
_choices: dict[tuple[int, int, torch.dtype, str], dict[int, Config | None]] = {}
tuning_log: list[dict[str, object]] = []


@triton.jit
def _load_x(ptrs, mask, GATED: tl.constexpr, up_offset):
    """x's values at `ptrs`; GATED: `silu(gate) * up` of the gate at `ptrs` and the up value
    `up_offset` further, rounded as the SiLU-and-mul kernel rounds (tandem_kernels.activation:
    silu in fp32 to x's dtype, the product in fp32 to x's dtype), so the values are that
    kernel's output bit for bit."""
    if GATED:
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + up_offset, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    locks_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_s,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The tensor-core form: one [BLOCK_M, BLOCK_N] output tile over one K slice (SWAP_AB:
    its transpose, `W x^T`, transposed back once at the end)."""
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_begin, k_end = k_slice(K, pid_k, BLOCK_K, SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            x = _load_x(x_ptrs, m_mask[:, None], GATED, K)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = k0 + offs_k < K
            x = _load_x(x_ptrs, m_mask[:, None] & k_mask[None, :], GATED, K)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SWAP_AB:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.trans(acc) if SWAP_AB else acc
    tile = pid_m * tl.num_programs(0) + pid_n
    store_tile(
        out, offs_m, offs_n, M, N, s_ptr, stride_s, out_ptr, stride_om, ws_ptr, locks_ptr, tile,
        pid_k, SPLIT_K,
    )  # fmt: skip


@triton.jit
def _gemv_chunk(
    w,
    x_ptrs,
    k_mask,
    acc,
    acc_k,
    row0,
    M,
    K,
    stride_xm,
    rows,
    offs_k,
    BLOCK_M: tl.constexpr,
    MASK_K: tl.constexpr,
    GATED: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """One BLOCK_K chunk of the GEMV form: the weight chunk `w` `[BLOCK_N, BLOCK_K]` (e4m3)
    widened to fp32 and reduced against rows `row0 ..` of x (`k_mask` on x's loads with
    MASK_K); returns `(acc, acc_k)` (`acc_k`: the in-place products of a one-row block,
    IN_PLACE; else each row's chunk is reduced into `acc` here)."""
    w = w.to(tl.float32)
    for i in tl.static_range(BLOCK_M):
        # A row-constant mask (`offs_k * 0` folds away), so x's loads stay 16 bytes wide.
        row_ok = offs_k * 0 + (row0 + i) < M
        if MASK_K:
            x = _load_x(x_ptrs + i * stride_xm, k_mask & row_ok, GATED, K)
        else:
            x = _load_x(x_ptrs + i * stride_xm, row_ok, GATED, K)
        if IN_PLACE:
            acc_k += w * x.to(tl.float32)[None, :]
        else:
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
            acc = tl.where(rows[:, None] == i, acc + part[None, :], acc)
    return acc, acc_k


@triton.jit(do_not_specialize=["M"])
def _w8a16_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    locks_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_s,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY_WEIGHT: tl.constexpr,
    PREFETCH: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """The few-row form: each program reads its BLOCK_N weight rows over one K slice once, in
    BLOCK_K-wide chunks (16 e4m3 per thread and load: the K offsets are contiguous and the
    row stride a multiple of 16), widens them to fp32 and reduces each of the BLOCK_M
    activation rows against them on the CUDA cores. EARLY_WEIGHT (set with USE_PDL) reads
    the slice's first weight chunk before the wait for the kernels before
    (tandem_kernels.pdl): weights are the one input no kernel writes. PREFETCH: each chunk's
    loads are issued before the chunk before it is summed (the first before the wait)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_begin, k_end = k_slice(K, pid_k, BLOCK_K, SPLIT_K)
    rows = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    x_ptrs = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm + k_begin + offs_k
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # IN_PLACE (one row, `Config.in_place`): products summed in place, reduced across K once
    # at the end.
    acc_k = tl.zeros([BLOCK_N, BLOCK_K] if IN_PLACE else [1, 1], dtype=tl.float32)
    row0 = pid_m * BLOCK_M
    # The slice's first chunk (nothing for an empty slice): masks constant along K keep the
    # loads 16 bytes wide.
    first_k = offs_k * 0 + k_begin < k_end if EVEN_K else k_begin + offs_k < k_end
    if PREFETCH:
        w = tl.load(w_ptrs, mask=n_mask[:, None] & first_k[None, :], other=0.0)
        pdl_wait(USE_PDL)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k_next = k0 + BLOCK_K
            next_k = offs_k * 0 + k_next < k_end if EVEN_K else k_next + offs_k < k_end
            w_next = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None] & next_k[None, :], other=0.0)
            k_mask = k0 + offs_k < K
            acc, acc_k = _gemv_chunk(
                w, x_ptrs, k_mask, acc, acc_k, row0, M, K, stride_xm, rows, offs_k, BLOCK_M,
                not EVEN_K, GATED, IN_PLACE,
            )  # fmt: skip
            w = w_next
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:
        loop_begin = k_begin
        if EARLY_WEIGHT:  # the first chunk read before the wait (none for an empty slice)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & first_k[None, :], other=0.0)
            pdl_wait(USE_PDL)
            acc, acc_k = _gemv_chunk(
                w, x_ptrs, first_k, acc, acc_k, row0, M, K, stride_xm, rows, offs_k, BLOCK_M,
                True, GATED, IN_PLACE,
            )  # fmt: skip
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            loop_begin += BLOCK_K
        else:
            pdl_wait(USE_PDL)
        for k0 in range(loop_begin, k_end, BLOCK_K):
            k_mask = k0 + offs_k < K
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc, acc_k = _gemv_chunk(
                w, x_ptrs, k_mask, acc, acc_k, row0, M, K, stride_xm, rows, offs_k, BLOCK_M,
                not EVEN_K, GATED, IN_PLACE,
            )  # fmt: skip
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if IN_PLACE:
        acc = tl.sum(acc_k, axis=1)[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    store_tile(
        acc, offs_m, offs_n, M, N, s_ptr, stride_s, out_ptr, stride_om, ws_ptr, locks_ptr, tile,
        pid_k, SPLIT_K,
    )  # fmt: skip


def w8a16_locks(n: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed lock buffer for split-K calls on an `[N, K]` weight: one lock per output tile
    of any candidate, for one block of rows (M <= BLOCK_M, as every split-K candidate is
    chosen). Make it outside CUDA-graph capture, once per weight and stream; the kernels
    leave it zeroed."""
    return torch.zeros(triton.cdiv(n, _MIN_SPLIT_BLOCK_N), dtype=torch.int32, device=device)


def w8a16_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    config: Config | None = None,
    locks: torch.Tensor | None = None,
    gated: bool = False,
    early_weight: bool | None = None,
) -> torch.Tensor:
    """`x [M, K] @ (weight [N, K] e4m3 * scale)^T` in x's dtype; `scale` float32 `[]`, `[1]`
    or `[N, 1]`; the weight may be in x's dtype instead (W16A16, with `unit_scale`). Rows
    contiguous. One kernel launch (and a fp32 workspace from the caching allocator for
    split-K); reads no device values on the host, so it can be captured in a CUDA graph.
    `locks`: `w8a16_locks(N, ...)`, for a split-K config; without it a zeroed one is made
    per call (one more memset).
    `gated`: x is `[M, 2K]` (gate | up) and the product is that of its SiLU-and-mul, computed
    as the kernel reads it (the same values as tandem_kernels.activation.silu_and_mul's).
    `early_weight`: the GEMV form reads its first weight chunk ahead of the rest, as it does
    when launched with PDL (None: exactly then); the values are the same either way."""
    assert x.dim() == 2 and weight.dim() == 2
    assert x.shape[1] == weight.shape[1] * (2 if gated else 1), (x.shape, weight.shape, gated)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert weight.dtype in (torch.float8_e4m3fn, x.dtype), (weight.dtype, x.dtype)
    assert scale.dtype == torch.float32
    m = x.shape[0]
    n, k = weight.shape
    assert scale.numel() in (1, n), (scale.shape, n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    c = config or _DEFAULT
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_m), c.split_k)
    workspace, locks = split_k_buffers(out, c.split_k, grid[0] * grid[1], locks)
    args = (x, weight, scale, out, workspace, locks, m, n, k)
    strides = (x.stride(0), weight.stride(0), out.stride(0), 0 if scale.numel() == 1 else 1)
    use_pdl = pdl_launch(x.device)
    if c.block_m < 16:
        early = use_pdl if early_weight is None else early_weight
        extra = {"EARLY_WEIGHT": early, "PREFETCH": c.prefetch, "IN_PLACE": c.in_place}
        kernel = _w8a16_gemv_kernel
    else:
        # fp32 activations: exact products (tf32 would lose digits); ignored for 16-bit.
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        kernel, extra = _w8a16_kernel, {"INPUT_PRECISION": precision, "SWAP_AB": c.swap_ab}
    kernel[grid](
        *args,
        *strides,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        SPLIT_K=c.split_k,
        EVEN_K=k % (c.block_k * c.split_k) == 0,
        GATED=gated,
        USE_PDL=use_pdl,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        **extra,
        **launch_options(use_pdl),
    )
    return out


def w8a16_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool = False
) -> torch.Tensor:
    """Pure-torch reference: the weight dequantized to float32, then the product (`gated`: of
    x's SiLU-and-mul, rounded to x's dtype as the unfused op's output is)."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    w = weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
    return F.linear(x.to(torch.float32), w).to(x.dtype)


def bucket(m: int) -> int | None:
    """The smallest tuned batch bucket holding `m` rows, or None above the largest."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return None


def candidates(b: int) -> tuple[Config, ...]:
    """The configs timed at batch bucket `b`."""
    return _CANDIDATES[b]


def choose(m: int, n: int, k: int, dtype: torch.dtype, baseline: str) -> Config | None:
    """This kernel's config for an `[m, k] x [n, k]^T` product, or None where the layer's
    scaled-GEMM path (`baseline`) is faster or the shape was never measured."""
    b = bucket(m)
    if b is None:
        return None
    choices = _choices.get((n, k, dtype, baseline))
    if choices is None:
        return _DEFAULT if m <= _DEFAULT_MAX_M else None
    return choices.get(b)


def _may_tune(weight: torch.Tensor) -> bool:
    return (
        weight.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("TANDEM_TUNE_KERNELS", "1") != "0"
        and not torch.cuda.is_current_stream_capturing()
    )


def time_in_graph(runs: list[Callable[[], object]], reps: int = 8) -> float | None:
    """Microseconds per call, as decode runs it: the calls (`runs`, one per weight copy, so
    that together they overflow L2 and every weight comes from HBM, as each layer's does in a
    forward) captured `reps` times in one CUDA graph, the graph replayed and timed. None when
    this device cannot run it (shared memory, registers) or it cannot be captured."""
    try:
        for run in runs:  # compiles
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for run in runs:
                    run()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:
        torch.cuda.synchronize()
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (3 * reps * len(runs))


# Weight copies timed in turn: at least this many bytes (twice an H200's 50 MB L2), at most
# _MAX_COPIES of them; weights under _MIN_TUNE_BYTES are not measured (the default rule serves
# them: a tiny model's GEMMs cost their launch, whatever the path).
_STREAM_BYTES = 128 << 20
_MAX_COPIES = 16
_MIN_TUNE_BYTES = 1 << 20


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and enough clones of it that reading them in turn streams from HBM."""
    weight_bytes = weight.numel() * weight.element_size()
    num_copies = min(-(-_STREAM_BYTES // weight_bytes), _MAX_COPIES)
    return [weight] + [weight.clone() for _ in range(num_copies - 1)]


def time_config(
    x: torch.Tensor,
    copies: list[torch.Tensor],
    scale: torch.Tensor,
    config: Config,
    locks: torch.Tensor,
    lead: Callable[[], object] | None = None,
) -> float | None:
    """`time_in_graph` of `w8a16_gemm` with `config` over the weight `copies` (one lock buffer
    serves them all: the calls run one after another), each call after `lead` when given
    (`chain_lead`)."""
    return time_in_graph(
        [_after(lead, lambda w=w: w8a16_gemm(x, w, scale, config, locks)) for w in copies]
    )


def _after(lead: Callable[[], object] | None, run: Callable[[], object]) -> Callable[[], object]:
    """`run`, with `lead` launched just before it when given."""
    if lead is None:
        return run
    return lambda: (lead(), run())


def timing_setting() -> str:
    """TANDEM_W8A16_TIMING: how the tuner times a candidate with PDL on. "alone" (default):
    the calls back to back (without PDL they are always timed so); "chain": each call after
    a short kernel, as a decode step runs it (`chain_lead`). The two gave the same batch-1
    FP8 step with PDL on an H100 (3.55 ms either way, session 21), so the cheaper one
    stays."""
    flag = os.environ.get("TANDEM_W8A16_TIMING", "alone")
    if flag not in ("chain", "alone"):
        raise ValueError(f"TANDEM_W8A16_TIMING={flag!r}: expected 'chain' or 'alone'")
    return flag


def chain_lead(m: int, k: int, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """The kernel a decode step runs before most of its GEMVs, as a stand-in to time them
    after: an add+RMSNorm of `m` rows of `k` (before qkv and gate_up it is that very kernel;
    before o_proj the attention merge, as short). With PDL the GEMV reads its first weight
    chunk before it waits for the kernel before (`EARLY_WEIGHT`), so its weight stream starts
    while that kernel runs; timed back to back after another GEMV, whose own stream keeps the
    memory busy, that head start does not show, and the tuner would not see what the configs
    that read the most before the wait (a K slice in one chunk) win in a step. Down_proj at
    one row follows gate_up itself (the SiLU-and-mul is in its loads): `tune_w8a16` times that
    bucket back to back, after another GEMV (`gated_input`)."""
    from tandem_kernels.rms_norm import fused_add_rms_norm

    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    residual = torch.randn(m, k, device=device, generator=gen).to(dtype)
    weight = torch.ones(k, dtype=dtype, device=device)
    return lambda: fused_add_rms_norm(x, residual, weight, 1e-6)


def tune_w8a16(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    baseline_name: str,
    baseline: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    gated_input: bool = False,
) -> dict[int, Config | None]:
    """Measure, once per (N, K, dtype, baseline), this kernel's candidates against `baseline`
    (the layer's own path, `baseline(x, weight)`: activation quantization + scaled GEMM) at
    every bucket of `M_BUCKETS`, on random activations and this weight, in CUDA graphs
    (`time_in_graph`; with PDL each call after `chain_lead`, see `timing_setting`, but for a
    `gated_input` layer's buckets up to GATED_MAX_M rows, where it takes the SiLU-and-mul's
    input and so follows the projection before it directly); remember the winners for
    `choose`. The log entry (`tuning_log`) keeps every candidate's time and
    the seconds the shape took (`tune_s`, compiles included).
    A no-op off CUDA, under the interpreter, during capture, or with TANDEM_TUNE_KERNELS=0."""
    n, k = weight.shape
    key = (n, k, dtype, baseline_name)
    if key in _choices or not _may_tune(weight) or weight.numel() < _MIN_TUNE_BYTES:
        return _choices.get(key, {})
    started = time.perf_counter()
    gen = torch.Generator(device=weight.device).manual_seed(0)
    copies = weight_copies(weight)
    locks = w8a16_locks(n, weight.device)
    choices: dict[int, Config | None] = {}
    chain = pdl_launch(weight.device) and timing_setting() == "chain"
    record: dict[str, object] = {
        "n": n, "k": k, "baseline": baseline_name, "chain": chain, "us": {},
    }  # fmt: skip
    for b in M_BUCKETS:
        x = torch.randn(b, k, device=weight.device, generator=gen).to(dtype)
        # With PDL, each call after the short kernel a step runs before it (`chain_lead`):
        # every time then includes that kernel's (`lead_us`, timed alone).
        follows_gemv = gated_input and b <= GATED_MAX_M
        lead = chain_lead(b, k, dtype, weight.device) if chain and not follows_gemv else None
        base_us = time_in_graph([_after(lead, lambda x=x, w=w: baseline(x, w)) for w in copies])
        timed = {c: time_config(x, copies, scale, c, locks, lead) for c in candidates(b)}
        ok = {c: t for c, t in timed.items() if t is not None}
        best = min(ok, key=ok.__getitem__) if ok else None
        use = best if best is not None and (base_us is None or ok[best] < base_us) else None
        choices[b] = use
        record["us"][str(b)] = {  # type: ignore[index]
            "baseline": base_us,
            "best": best.name if best else None,
            "best_us": ok.get(best) if best else None,
            "use": "w8a16" if use else "baseline",
            "lead_us": time_in_graph([lead] * len(copies)) if lead else None,
            "candidates": {c.name: t for c, t in timed.items()},
        }
    del copies
    record["tune_s"] = time.perf_counter() - started  # compiles included
    _choices[key] = choices
    tuning_log.append(record)
    return choices


# 16-bit weights (W16A16): the same kernels with the weight in x's dtype and a scale of one,
# against the 16-bit GEMM (`F.linear`, cuBLAS) the unquantized layer runs otherwise.
W16A16_BASELINE = "linear"


def w16a16_setting() -> bool:
    """TANDEM_W16A16: unset or "tuned" (the default), the unquantized linear layers (and the
    LM head) on CUDA time this module's kernels against their 16-bit GEMM at load and take
    them at the batch buckets where they win (`tune_w16a16`); "off", the 16-bit GEMM always.
    Measured on an H100 (8B shape, bf16; benchmarks/results/*_s21*): batch-1 decode 6.32 ->
    5.96 ms, served TPOT p50 1-2% lower at 5-25 req/s, about 4 s more start-up."""
    flag = os.environ.get("TANDEM_W16A16", "tuned")
    if flag not in ("tuned", "off"):
        raise ValueError(f"TANDEM_W16A16={flag!r}: expected 'tuned' or 'off'")
    return flag == "tuned"


def unit_scale(device: torch.device | str) -> torch.Tensor:
    """The scale of a 16-bit weight: one, float32 `[1]`."""
    return torch.ones(1, dtype=torch.float32, device=device)


def tune_w16a16(weight: torch.Tensor, scale: torch.Tensor) -> dict[int, Config | None]:
    """`tune_w8a16` for a 16-bit weight (`scale`: its `unit_scale`), against `F.linear` at
    each bucket; activations in the weight's dtype."""
    return tune_w8a16(weight, scale, weight.dtype, W16A16_BASELINE, lambda x, w: F.linear(x, w))


def choose_w16a16(m: int, n: int, k: int, dtype: torch.dtype) -> Config | None:
    """This module's config for a 16-bit `[m, k] x [n, k]^T` product where `tune_w16a16`
    measured it faster than the 16-bit GEMM, else None (also for a shape never measured:
    unlike the FP8 path, no untuned default)."""
    b = bucket(m)
    if b is None:
        return None
    return _choices.get((n, k, dtype, W16A16_BASELINE), {}).get(b)
