"""Fused mixture-of-experts: tokens sorted by expert, then two grouped GEMMs.

    topk_ids [T, k] --moe_align_block_size--> sorted_token_ids [EM], expert_ids [EM / BLOCK_M]

          pair p = t * k + j (token t's j-th expert). Pairs are grouped by expert and each
          expert's run is padded to a multiple of BLOCK_M with the id T * k (no pair), so one
          tile of BLOCK_M rows always belongs to one expert:

          sorted_token_ids  | e0 e0 e0 -- | e1 -- -- -- | e3 e3 e3 e3 | e3 -- -- -- | pad...
          expert_ids        |     0       |     1       |     3       |     3       | E ...

    GEMM 1   C1[p] = x[p // k] @ w13[e]^T            [T * k, 2I]   (tile: one expert's rows)
    act      silu(C1[:, :I]) * C1[:, I:]             [T * k, I]
    GEMM 2   C2[p] = act[p] @ w2[e]^T * weight[p]    [T * k, H]
    sum      out[t] = sum_j C2[t * k + j]            [T, H]

With SiLU in GEMM 1's epilogue (`MoEConfig.silu_in_epilogue`), GEMM 1 writes act itself and
C1 is never stored: a program holds the tile of gate columns n and the tile of up columns
I + n of one expert, both accumulated over the same tiles of x, and stores their product:

              .-- @ w13[e, n]^T      gate [BLOCK_M, BLOCK_N] fp32 --.
    x[p // k] |                                                      +--> act[p, n]  [T * k, I]
              '-- @ w13[e, I + n]^T  up   [BLOCK_M, BLOCK_N] fp32 --'     silu(gate) * up

(gate and up are rounded to the input dtype first, as C1 is stored, then silu and the
product as `silu_and_mul` rounds them: the same values as the unfused form for the same
accumulators.) This saves C1's write and read ([T * k, 2I]) and a launch, but a tile carries
two accumulators: the tuner times both forms (see Tile configs) and keeps the faster.

The padded length EM = T * k + E * (BLOCK_M - 1) is an upper bound known on the host, and the
real length stays on the device: no host sync, so a call can be captured in a CUDA graph. The
alignment is three Triton launches (tandem_kernels/moe_align.py; its torch reference beside
it runs on the CPU). With `MoEConfig.b_tma` (sm_90+) both GEMMs read the expert weights
through TMA tensor descriptors; the gathered rows of x and act are always pointer loads.
Tiles past the real length exit at once. Ids >= E (experts of another rank) are never
computed and add nothing: their rows of C2 are never written, so C2 starts as zeros, unless
the caller passes `all_experts_local=True` (every id < E, as without expert parallel, or in an
exact expert-parallel dispatch: every row of C2 is written, and the fill is skipped).

Decode path (a `DecodeConfig`): with few pairs, no sorting or padding, two GEMVs:

    kernel 1  grid (T * k, I / BLOCK_N1)   act[p, n] = silu(x[p // k] . w13[e_p, n])
                                                       * (x[p // k] . w13[e_p, I + n])
    kernel 2  grid (T, H / BLOCK_N2)       out[t, n] = sum_j w[t, j] * act[t * k + j] . w2[e_j, n]

(e_p: pair p's expert id, w: topk_weights; act is float32.) Kernel 1 skips pairs whose id is
>= E; kernel 2 masks their rows (they add nothing) and writes each output element once, summed
over the token's top_k in registers (fp32). No host sync either.

FP8 (e4m3) experts come with a scale per expert and output row (`w13_scale [E, 2I]`, `w2_scale
[E, H]`, applied to the finished sums), or with a block-scaled checkpoint's scale per expert
and `bn x bk` tile (`weight_block_size`), applied at each K step (k0: the step's first
column), to the weight tile before its dot on the grouped path, to the partial sums on the
decode path:

    w13_scale [E, ceil(2I / bn), ceil(H / bk)]     w2_scale [E, ceil(H / bn), ceil(I / bk)]

    acc = A tile @ (B tile * scale[e, n // bn, k0 // bk])^T + acc     (grouped)
    acc += (x chunk . w chunk) * scale[e, n // bn, k0 // bk]          (decode)

so every BLOCK_K (grouped and decode) must divide bk (`fits_block`; the tuner times only such
configs, `for_block_size`). Either way the weight tiles widen to the activations' dtype in
registers (weight-only, W8A16: exactly with row scales, the block-scaled tile rounded to it
after its scale), or, on the grouped path (`MoEConfig.fp8_act`, W8A8), the activations are
quantized too (x before GEMM 1, act before GEMM 2) and the dots run on e4m3 operands: per
token against row scales, the scales applied to the finished sums; per token and bk columns
against block scales (`a_scale [rows, ceil(K / bk)]`), each K step's partial sums taking
both sides' scales:

    acc += (A tile @ B tile^T) * a_scale[row, k0 // bk] * scale[e, n // bn, k0 // bk]

The decode path stays weight-only.

Torch grouped-GEMM path (a `GroupedMMConfig`): the same two GEMMs through torch's grouped GEMM
(`torch._grouped_mm`: CUTLASS kernels with TMA loads on sm_90, which the Triton tiles' gathered
rows of x cannot use), on pairs copied into expert order first:

    order    = argsort(ids)                  pairs by expert (ids >= E last); offs[e]: the end
                                             of expert e's rows (searchsorted, on the device)
    GEMM 1   C1 = grouped_mm(x[order // k], w13^T, offs)            [T * k, 2I]
    act      silu(C1[:, :I]) * C1[:, I:] * weight[order]            [T * k, I]  (one pass)
    GEMM 2   C2 = grouped_mm(act, w2^T, offs)                       [T * k, H]
    sum      out[t] = sum_j C2[inverse[t * k + j]]                  [T, H]

(the routed weight scales act's rows, since GEMM 2 is linear in them). Rows past offs[E - 1]
(another rank's experts) are left unwritten by the GEMMs and zeroed before the sum, unless the
caller vouches there are none. No host sync: it can be captured in a CUDA graph. bf16 only
(torch's grouped GEMM), H and I multiples of 8 (16-byte strides); the tuner times it beside the
Triton configs for token counts past the decode path's and keeps it only where it is faster.

Tile configs (a `MoEConfig`: BLOCK_M/N/K, GROUP_M, warps, stages, the SiLU form and GEMM 2's own
tiles but BLOCK_M, if any; or a `DecodeConfig`) are tuned per shape and per token-count bucket on
the device the first time a shape runs outside graph capture (an engine's start-up profile forward:
every bucket up to its token count at once), as the attention kernels are. Layers whose experts
weigh under `_MIN_TUNE_BYTES` (test-sized models) take the default rule untimed (the unfused form):
their calls cost their launches, whatever the tiles. (On the H200 the tiny Qwen3-MoE engine test
took 20 s untuned; tuned, it once ran past 140 s.) `fused_moe_ref` (moe_ref.py) is the torch
reference.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Literal, NamedTuple, TypeVar

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tandem_kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_tile
from tandem_kernels.fp8 import dynamic_quant_per_token, dynamic_quant_per_token_group
from tandem_kernels.fp8_fused import QuantStrategy, silu_and_mul_fp8
from tandem_kernels.moe_align import moe_align_block_size


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    b_scale_ptr,
    a_scale_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    EM,
    num_valid_tokens,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    B_ROWS,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    B_TMA: tl.constexpr,
    B_SCALE: tl.constexpr,
    A_SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    """One `[BLOCK_M, BLOCK_N]` tile of `C[p] = A[p // A_ROW_DIV] @ B[expert]^T` over the
    sorted pairs of one expert (times the pair's routing weight when MUL_ROUTED_WEIGHT).

    SILU_AND_MUL (GEMM 1 with SiLU in its epilogue): B has 2N rows, gate then up; the tile
    of gate columns n and the tile of up columns N + n accumulate over the same A tiles, and
    C (`[P, N]`) gets `silu(gate) * up`, with gate and up rounded to C's dtype first as the
    unfused path stores them (silu_and_mul_tile: the same values as silu_and_mul's).

    B_TMA: `b_ptr` is a tensor descriptor over B's `[E * B_ROWS, K]` view (`[BLOCK_N,
    BLOCK_K]` blocks) and B's tiles come through TMA; a tile past an expert's N rows reads the
    next expert's rows (or zeros past the end) into columns the store masks, and columns past
    K read zeros. Else B is read through pointers with its strides.

    B_SCALE: B is FP8 (e4m3) with one scale per expert and row (`b_scale[e * B_ROWS +
    n]`, gate then up under SILU_AND_MUL): its tiles widen to A's dtype (exactly) for the dot
    and the accumulators take the row scales before the epilogue (a row's scale factors out
    of its sum over K). A_SCALE: A is FP8 too, with one scale per row of A (`a_scale[p //
    A_ROW_DIV]`, per token): the dot runs on e4m3 operands and the accumulators take the
    row scales as well.

    B_SCALE with SCALE_BK > 0: B's scales are per expert and `SCALE_BN x SCALE_BK` tile
    instead (`b_scale [E, cdiv(B_ROWS, SCALE_BN), cdiv(K, SCALE_BK)]`, contiguous; row r of
    B in tile row r // SCALE_BN, up rows included): BLOCK_K divides SCALE_BK, so each K step
    lies in one tile column, and its B tile is dequantized to A's dtype with its rows' tile
    scales before the dot (the weights fused_moe_ref dequantizes, rounded alike; the dots
    chain into one accumulator, where a partial dot scaled after it needed a second tile of
    registers: at Qwen3-30B-A3B's 4,096 tokens on an H100 that form ran 1.59 ms, slower than
    bf16's 0.90). With A_SCALE too (W8A8), A is FP8 with one scale per row of A and SCALE_BK
    columns (`a_scale [rows of A, cdiv(K, SCALE_BK)]`, contiguous, per token group): each K
    step's dot runs on the e4m3 operands and its partial sums join the accumulator times both
    sides' scales, `acc += (A @ B^T) * a_scale[row, kb] * b_scale[tile row of n, kb]`."""
    tl.static_assert(not (SILU_AND_MUL and MUL_ROUTED_WEIGHT))
    BLOCK_SCALED: tl.constexpr = B_SCALE and SCALE_BK > 0
    tl.static_assert(not BLOCK_SCALED or SCALE_BK % BLOCK_K == 0)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_M >= num_tokens_post_padded:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    pair_mask = offs_pair < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (offs_pair[:, None] // A_ROW_DIV) * stride_am + offs_k[None, :] * stride_ak
    if B_TMA:
        b_row = (expert * B_ROWS + pid_n * BLOCK_N).to(tl.int32)
    else:
        b_ptrs = (
            b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        )
    if BLOCK_SCALED:
        num_kb = tl.cdiv(K, SCALE_BK)
        b_scales = b_scale_ptr + expert * tl.cdiv(B_ROWS, SCALE_BN) * num_kb
        gate_scales = b_scales + (offs_n // SCALE_BN) * num_kb
        if SILU_AND_MUL:
            up_scales = b_scales + ((N + offs_n) // SCALE_BN) * num_kb
        if A_SCALE:
            a_scales = a_scale_ptr + (offs_pair // A_ROW_DIV) * num_kb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_AND_MUL:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        if B_TMA:
            b = b_ptr.load([b_row, k * BLOCK_K]).T
        else:
            b_mask = k_mask[:, None] & n_mask[None, :]
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if BLOCK_SCALED:
            kb = (k * BLOCK_K) // SCALE_BK
            scale = tl.load(gate_scales + kb, mask=n_mask, other=0.0)
            if A_SCALE:
                a_scale = tl.load(a_scales + kb, mask=pair_mask, other=0.0)[:, None]
                acc += tl.dot(a, b) * a_scale * scale[None, :]
            else:
                b = (b.to(tl.float32) * scale[None, :]).to(a.dtype)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:
            if B_SCALE:
                b = b.to(a.dtype)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if SILU_AND_MUL:
            if B_TMA:
                b_up = b_ptr.load([b_row + N, k * BLOCK_K]).T
            else:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            if BLOCK_SCALED:
                scale_up = tl.load(up_scales + kb, mask=n_mask, other=0.0)
                if A_SCALE:
                    acc_up += tl.dot(a, b_up) * a_scale * scale_up[None, :]
                else:
                    b_up = (b_up.to(tl.float32) * scale_up[None, :]).to(a.dtype)
                    acc_up = tl.dot(a, b_up, acc_up, input_precision=INPUT_PRECISION)
            else:
                if B_SCALE:
                    b_up = b_up.to(a.dtype)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        if not B_TMA:
            b_ptrs += BLOCK_K * stride_bk
    if B_SCALE and not BLOCK_SCALED:
        scales = b_scale_ptr + expert * B_ROWS + offs_n
        acc = acc * tl.load(scales, mask=n_mask, other=0.0)[None, :]
        if SILU_AND_MUL:
            acc_up = acc_up * tl.load(scales + N, mask=n_mask, other=0.0)[None, :]
    if A_SCALE and not BLOCK_SCALED:
        row_scale = tl.load(a_scale_ptr + offs_pair // A_ROW_DIV, mask=pair_mask, other=0.0)
        acc = acc * row_scale[:, None]
        if SILU_AND_MUL:
            acc_up = acc_up * row_scale[:, None]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + offs_pair, mask=pair_mask, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    if SILU_AND_MUL:
        gate = acc.to(c_ptr.dtype.element_ty)
        acc = silu_and_mul_tile(gate, acc_up.to(c_ptr.dtype.element_ty))
    c_ptrs = c_ptr + offs_pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    topk_ids_ptr,
    w13_scale_ptr,
    num_experts,
    hidden,
    inter,
    stride_xm,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    """`act[p, n] = silu(gate) * up` for pair p (program 0) and BLOCK_N of its expert's I
    rows (program 1): one GEMV per pair over x's row; pairs of absent experts write nothing.
    NUM_STAGES > 1 prefetches the next steps' tiles (cp.async into shared memory). W_SCALE:
    w13 is FP8 with a scale per expert and row (`[E, 2I]`), applied to the row sums; with
    SCALE_BK > 0, one per expert and `SCALE_BN x SCALE_BK` tile (`[E, cdiv(2I, SCALE_BN),
    cdiv(H, SCALE_BK)]`, contiguous), applied to each step's products (BLOCK_K divides
    SCALE_BK: a step lies in one tile column)."""
    BLOCK_SCALED: tl.constexpr = W_SCALE and SCALE_BK > 0
    tl.static_assert(not BLOCK_SCALED or SCALE_BK % BLOCK_K == 0)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    if expert >= num_experts:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K) * stride_xm
    gate_rows = w13_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + inter * stride_wn
    if BLOCK_SCALED:
        num_kb = tl.cdiv(hidden, SCALE_BK)
        scales = w13_scale_ptr + expert * tl.cdiv(2 * inter, SCALE_BN) * num_kb
        gate_scales = scales + (offs_n // SCALE_BN) * num_kb
        up_scales = scales + ((inter + offs_n) // SCALE_BN) * num_kb
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(hidden, BLOCK_K), num_stages=NUM_STAGES):
        cols = k * BLOCK_K + offs_k
        k_mask = cols < hidden
        x = tl.load(x_row + cols, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        mask = n_mask[:, None] & k_mask[None, :]
        gate = tl.load(gate_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            kb = (k * BLOCK_K) // SCALE_BK
            gate = gate * tl.load(gate_scales + kb, mask=n_mask, other=0.0)[:, None]
            up = up * tl.load(up_scales + kb, mask=n_mask, other=0.0)[:, None]
        acc_gate += gate * x
        acc_up += up * x
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    if W_SCALE and not BLOCK_SCALED:
        scales = w13_scale_ptr + expert * 2 * inter + offs_n
        gate = gate * tl.load(scales, mask=n_mask, other=0.0)
        up = up * tl.load(scales + inter, mask=n_mask, other=0.0)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair * inter + offs_n, act, mask=n_mask)


@triton.jit
def _moe_decode_down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    topk_weights_ptr,
    topk_ids_ptr,
    w2_scale_ptr,
    num_experts,
    hidden,
    inter,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    """`out[t, n] = sum_j weight[t, j] * act[t * k + j] . w2[e_j, n]` for token t (program 0)
    and BLOCK_N of the H outputs (program 1), summed over top_k in registers, stored once;
    pairs of absent experts (id >= E) are masked out. One loop over (expert j, column block),
    so that NUM_STAGES > 1 prefetches across the experts too. W_SCALE: w2 is FP8 with a scale
    per expert and row (`[E, H]`), taken into each product (it differs from expert to
    expert, so it cannot wait for the sum); with SCALE_BK > 0, one per expert and `SCALE_BN
    x SCALE_BK` tile (`[E, cdiv(H, SCALE_BN), cdiv(I, SCALE_BK)]`, contiguous; BLOCK_K
    divides SCALE_BK)."""
    BLOCK_SCALED: tl.constexpr = W_SCALE and SCALE_BK > 0
    tl.static_assert(not BLOCK_SCALED or SCALE_BK % BLOCK_K == 0)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    row_offs = offs_n.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    num_k = tl.cdiv(inter, BLOCK_K)
    if BLOCK_SCALED:
        num_kb = tl.cdiv(inter, SCALE_BK)
        scale_offs = (offs_n // SCALE_BN) * num_kb
        expert_scales = tl.cdiv(hidden, SCALE_BN) * num_kb
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.range(0, TOP_K * num_k, num_stages=NUM_STAGES):
        j = step // num_k
        pair = token * TOP_K + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
        # An absent expert's pair reads no column (nothing to add).
        num_cols = tl.where(expert < num_experts, inter, 0)
        weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
        col0 = (step - j * num_k) * BLOCK_K
        cols = col0 + offs_k
        k_mask = cols < num_cols
        act = tl.load(act_ptr + pair * inter + cols, mask=k_mask, other=0.0) * weight
        local = tl.minimum(expert, num_experts - 1)
        rows = w2_ptr + local * stride_we + row_offs
        w = tl.load(rows + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = w.to(tl.float32)
        if BLOCK_SCALED:
            scales = w2_scale_ptr + local * expert_scales + scale_offs + col0 // SCALE_BK
            w = w * tl.load(scales, mask=n_mask, other=0.0)[:, None]
        elif W_SCALE:
            w = w * tl.load(w2_scale_ptr + local * hidden + offs_n, mask=n_mask, other=0.0)[:, None]
        acc += w * act[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


class GemmTiles(NamedTuple):
    """One grouped GEMM's tiles but BLOCK_M: `block_n` output columns over `block_k` columns
    of K a step, `group_m` row tiles side by side (they share B tiles in L2), `num_warps`,
    `num_stages` (software pipelining)."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


class MoEConfig(NamedTuple):
    """Tiles of the grouped path (see the module docstring): `[block_m, block_n]` output
    tiles of GEMM 1 (the rest as in `GemmTiles`). `silu_in_epilogue`: GEMM 1 stores
    `silu(gate) * up` (block_n of the I act columns a tile, two accumulators) instead of
    gate_up for a separate SiLU-and-mul pass. `down`: GEMM 2's own tiles (K is I, N is H),
    None for GEMM 1's; block_m is shared, since the alignment pads each expert's rows to it.
    `b_tma`: both GEMMs read the expert weights through TMA tensor descriptors (sm_90 and
    later, `b_tma_usable`), the gathered rows of x and act through pointers as ever.
    `fp8_act` (FP8 weights only): both GEMMs' inputs are quantized to e4m3 first (x, then
    act), per token against row-scaled weights, per token and bk columns against block-scaled
    ones, so the dots run on FP8 tensor cores (W8A8); else the weight tiles widen to the
    activations' dtype (W8A16)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    silu_in_epilogue: bool = False
    down: GemmTiles | None = None
    b_tma: bool = False
    fp8_act: bool = False

    @property
    def gate_up_tiles(self) -> GemmTiles:
        """GEMM 1's tiles but BLOCK_M."""
        return GemmTiles(*self[1:6])

    @property
    def down_tiles(self) -> GemmTiles:
        """GEMM 2's tiles but BLOCK_M: `down`, or GEMM 1's."""
        return self.gate_up_tiles if self.down is None else self.down


class DecodeConfig(NamedTuple):
    """Tiles of the decode path (see the module docstring): kernel 1 computes `block_n1` of a
    pair's I outputs (gate and up rows) over `block_k1` columns of H per step, with
    `num_stages1` steps in flight (1: plain loads; more: cp.async prefetch into shared memory);
    kernel 2 `block_n2` of a token's H outputs over `block_k2` columns of I per step."""

    block_n1: int
    block_k1: int
    num_stages1: int
    block_n2: int
    block_k2: int
    num_stages2: int
    num_warps: int


class GroupedMMConfig(NamedTuple):
    """The torch grouped-GEMM path (see the module docstring): no tiles of ours, CUTLASS picks
    its own."""


FusedMoEConfig = MoEConfig | DecodeConfig | GroupedMMConfig
_Config = TypeVar("_Config", MoEConfig, DecodeConfig, GroupedMMConfig)
_T = TypeVar("_T")
# What a grouped GEMM does to its fp32 tile before storing it (None: nothing).
Epilogue = Literal["silu_and_mul", "routed_weight"] | None
# Decode path tiles. Each program streams a [block_n, block_k] tile a step (kernel 1: two, gate
# and up): with plain loads a step's tiles are what a program has in flight, so tiles of 8-16K
# elements (16-32 KB of bf16) with a few programs per SM keep the ~30 KB per SM in flight that
# H200's bandwidth needs; num_stages > 1 keeps that many steps in flight (cp.async, 25-50 KB of
# shared memory). Kernel 1 at Qwen3-30B-A3B T=1 (8 pairs, I 768): block_n1 16 gives 384
# programs on 132 SMs; Mixtral (2 pairs, I 14336): 1792. Kernel 2's grid is (T, H / block_n2),
# so its tiles are narrow and long (H 2048 at 8 rows: 256 programs at T=1). All compile for
# sm_90 without spills (registers 64-138 a thread).
_DECODE_CANDIDATES: tuple[DecodeConfig, ...] = (
    DecodeConfig(16, 256, 1, 8, 1024, 1, 4),
    DecodeConfig(16, 256, 3, 8, 1024, 3, 4),
    DecodeConfig(8, 512, 3, 8, 512, 4, 4),
    DecodeConfig(16, 512, 1, 8, 1024, 1, 8),
    DecodeConfig(32, 256, 1, 4, 2048, 1, 8),
    DecodeConfig(16, 256, 4, 16, 512, 3, 4),
    DecodeConfig(8, 256, 1, 8, 512, 1, 4),
    DecodeConfig(32, 128, 3, 4, 1024, 3, 4),
    DecodeConfig(16, 256, 1, 16, 1024, 1, 8),
    DecodeConfig(16, 256, 3, 8, 256, 4, 4),
    DecodeConfig(8, 512, 1, 4, 1024, 1, 4),
)
# Untuned: plain loads (the pipelined candidates are measured before they run).
_DEFAULT_DECODE = DecodeConfig(16, 256, 1, 8, 1024, 1, 4)
# The decode path reads an expert's weights once per pair routed to it (the grouped path once
# per expert) but runs 2 kernels instead of the alignment's ~15 small ops, the zeros and the
# sum: at H200 T=1 those dominate (Qwen3-30B-A3B 0.65 ms eager for 75 MB of weights, 18 us of
# reads). Pairs are the fastest grid axis, so pairs of one expert read the same rows at about
# the same time and repeats mostly hit L2. Untuned, it runs up to 2 expected rows per expert
# (Qwen3-30B-A3B: T <= 32, Mixtral: T <= 8): at most twice the grouped path's weight bytes.
# The tuner times it up to 8 rows per expert and keeps whichever path is faster.
_DECODE_DEFAULT_MAX_ROWS = 2
# A layer's expert weights below this are not tuned (see the module docstring).
_MIN_TUNE_BYTES = 4 << 20
_DECODE_TUNE_MAX_ROWS = 8
# The fastest configs of a bucket are timed again, in interleaved rounds, before one is kept:
# a first timing of a few calls can fall on other clocks than its rivals' (the device runs
# faster in a burst than held). On an H100 at Qwen3-30B-A3B's 16,384 tokens the tuner kept
# a config 9% slower than the other SiLU form's fastest, timed side by side afterwards.
_FINALISTS = 3
_FINAL_ROUNDS = 2
_UNFUSED_CANDIDATES: tuple[MoEConfig, ...] = (
    MoEConfig(16, 64, 128, 1, 4, 3),
    MoEConfig(16, 128, 128, 1, 4, 3),
    MoEConfig(16, 64, 64, 1, 4, 4),
    MoEConfig(16, 128, 64, 1, 4, 4),
    MoEConfig(16, 256, 64, 1, 8, 3),
    MoEConfig(32, 64, 128, 8, 4, 3),
    MoEConfig(32, 128, 64, 8, 4, 4),
    MoEConfig(64, 64, 64, 8, 4, 4),
    MoEConfig(64, 128, 64, 8, 4, 3),
    MoEConfig(64, 128, 64, 8, 8, 3),
    MoEConfig(64, 256, 64, 8, 8, 3),
    MoEConfig(128, 128, 64, 8, 8, 3),
    MoEConfig(128, 256, 64, 8, 8, 3),
    MoEConfig(128, 128, 32, 8, 4, 4),
)
# SiLU in GEMM 1's epilogue: two accumulators and two B tiles a step, so block_n is about half
# an unfused tile's for the same registers and shared memory. All compile for sm_90a without
# spills (benchmarks/kernel_registers.py --moe, Triton 3.9): GEMM 1 takes 108-216 registers a
# thread and 72-192 KB of shared memory (H200: 227 KB a block).
_SILU_EPILOGUE_CANDIDATES: tuple[MoEConfig, ...] = (
    MoEConfig(16, 64, 128, 1, 4, 3, True),
    MoEConfig(16, 128, 64, 1, 4, 4, True),
    MoEConfig(32, 64, 128, 8, 4, 3, True),
    MoEConfig(64, 64, 64, 8, 4, 4, True),
    MoEConfig(64, 128, 64, 8, 8, 3, True),
    MoEConfig(128, 64, 64, 8, 4, 4, True),
    MoEConfig(128, 128, 64, 8, 8, 3, True),
    MoEConfig(128, 128, 64, 8, 8, 4, True),
)
# The tuner times both forms; which is faster is the device's to say.
_CANDIDATES = _UNFUSED_CANDIDATES + _SILU_EPILOGUE_CANDIDATES
# GEMM 2's own tiles, timed on the fastest config of each SiLU form (GEMM 1 and BLOCK_M kept).
# GEMM 2 is long in N (H: 2048, 4096) and short in K (I: 768 at Qwen3-30B-A3B), while an
# epilogue config's block_n is narrow for GEMM 1's two accumulators. At every block_m of the
# candidates they compile for sm_90a without spills, at most 192 KB of shared memory.
_DOWN_CANDIDATES: tuple[GemmTiles, ...] = (
    GemmTiles(64, 64, 8, 4, 4),
    GemmTiles(128, 64, 8, 4, 3),
    GemmTiles(128, 64, 8, 8, 4),
    GemmTiles(128, 128, 8, 8, 3),
    GemmTiles(256, 64, 8, 8, 3),
    GemmTiles(64, 128, 8, 4, 3),
)
# (E, 2I, H, top_k, dtype, FP8 weight block size or None) of a layer; with the token bucket,
# what a tuned config is kept for.
_ShapeKey = tuple[int, int, int, int, torch.dtype, tuple[int, int] | None]
_configs: dict[tuple[_ShapeKey, int], FusedMoEConfig] = {}
tuning_log: list[dict[str, object]] = []


def default_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    weight_block_size: tuple[int, int] | None = None,
) -> FusedMoEConfig:
    """The untuned config: the decode path when each expert sees at most
    `_DECODE_DEFAULT_MAX_ROWS` rows on average, then small tiles when it sees few; the
    grouped path unfused (SiLU in the epilogue runs only where the tuner timed it faster).
    `weight_block_size`: block-scaled FP8 weights, the config `for_block_size`."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    config: FusedMoEConfig
    if rows_per_expert <= _DECODE_DEFAULT_MAX_ROWS:
        config = _DEFAULT_DECODE
    elif rows_per_expert <= 16:
        config = MoEConfig(16, 64, 64, 1, 4, 3)
    elif rows_per_expert <= 64:
        config = MoEConfig(32, 64, 64, 8, 4, 3)
    else:
        config = MoEConfig(64, 128, 64, 8, 8, 3)
    return config if weight_block_size is None else for_block_size(config, weight_block_size[1])


def _block_k_dividing(block_k: int, bk: int) -> int:
    """The largest power of two up to `block_k` (one itself) that divides `bk`."""
    while bk % block_k:
        block_k //= 2
    return block_k


def for_block_size(config: _Config, bk: int) -> _Config:
    """`config` for FP8 weights with block scales `bk` columns wide: every BLOCK_K (GEMM 1's,
    GEMM 2's own, the decode path's two) lowered to the largest power of two that divides
    `bk` (itself where it divides already), so each K step lies in one scale column."""
    if isinstance(config, DecodeConfig):
        return config._replace(
            block_k1=_block_k_dividing(config.block_k1, bk),
            block_k2=_block_k_dividing(config.block_k2, bk),
        )
    if isinstance(config, MoEConfig):
        down = config.down
        if down is not None:
            down = down._replace(block_k=_block_k_dividing(down.block_k, bk))
        return config._replace(block_k=_block_k_dividing(config.block_k, bk), down=down)
    return config


def fits_block(config: FusedMoEConfig, weight_block_size: tuple[int, int]) -> bool:
    """Whether `config` runs FP8 weights with these block scales: a Triton path whose every
    BLOCK_K divides bk (weight-only or, `fp8_act`, with activations per token group of bk)."""
    bk = weight_block_size[1]
    if isinstance(config, DecodeConfig):
        return bk % config.block_k1 == 0 and bk % config.block_k2 == 0
    if isinstance(config, MoEConfig):
        steps = (config.gate_up_tiles.block_k, config.down_tiles.block_k)
        return all(bk % step == 0 for step in steps)
    return False


def _check_block_config(config: FusedMoEConfig, weight_block_size: tuple[int, int]) -> None:
    """ValueError, naming the config, unless it `fits_block`."""
    if fits_block(config, weight_block_size):
        return
    bn, bk = weight_block_size
    if isinstance(config, GroupedMMConfig):
        why = "the torch grouped-GEMM path takes bf16 weights"
    else:
        why = f"every BLOCK_K must divide the weights' block columns bk = {bk}"
    raise ValueError(f"fused MoE config {config_name(config)} with [{bn}, {bk}] blocks: {why}")


def token_bucket(num_tokens: int) -> int:
    """Tuned configs are kept per power of two of the token count."""
    return triton.next_power_of_2(max(num_tokens, 1))


def _may_tune(tensor: torch.Tensor) -> bool:
    """On CUDA only: not on the CPU interpreter, not in graph capture, not with
    TANDEM_TUNE_KERNELS=0."""
    return (
        tensor.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("TANDEM_TUNE_KERNELS", "1") != "0"
        and not torch.cuda.is_current_stream_capturing()
    )


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: FusedMoEConfig | None = None,
    *,
    all_experts_local: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`[T, H]`: `sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])` (fused_moe_ref's
    result). hidden_states `[T, H]`, w13 `[E, 2I, H]`, w2 `[E, H, I]` (contiguous, one dtype),
    topk_weights `[T, k]` float32, topk_ids `[T, k]` int. `config` unset: the tuned one for
    this shape and token bucket (tuning it now when allowed, see the module docstring); a
    `DecodeConfig` runs the decode path.

    `all_experts_local`: the caller vouches that every id is < E (no pair names another
    rank's expert), so GEMM 2 writes every pair's row and the grouped path skips zero-filling
    them first. Not checked (that would cost a host sync): set with ids >= E, the output is
    garbage. The default is right for any ids; the decode path never fills.

    `w13_scale` `[E, 2I]` and `w2_scale` `[E, H]` (float32, both or neither): the weights are
    FP8 (e4m3) with a scale per expert and output row, and the activations stay in
    hidden_states' dtype (weight-only FP8: the Triton paths widen the weight tiles; the torch
    grouped-GEMM path is bf16-only and is not taken).

    `weight_block_size` `(bn, bk)`: the FP8 weights' scales are per expert and `bn x bk`
    tile instead, `w13_scale` `[E, ceil(2I/bn), ceil(H/bk)]` and `w2_scale` `[E, ceil(H/bn),
    ceil(I/bk)]` (float32, contiguous; w13's rows gate then up, tiled as one matrix), as a
    block-scaled checkpoint stores them. Each K step's weight tile takes its tile's scales,
    so every BLOCK_K of the config (`block_k`, the down tiles', the decode path's `block_k1`
    / `block_k2`) must divide bk, a multiple of 16 (`fits_block`; the tuner and the default
    rule offer only such configs).

    `MoEConfig.fp8_act` (FP8 weights only, W8A8): x and act are quantized to e4m3 before
    their GEMMs, per token with row scales (`dynamic_quant_per_token`, `silu_and_mul_fp8`
    "token"), per token and bk columns with block scales (`dynamic_quant_per_token_group`,
    `silu_and_mul_fp8` "group"); within FP8's error of fused_moe_ref, not equal to it."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_inter // 2)
    assert w13.is_contiguous() and w2.is_contiguous() and hidden_states.stride(-1) == 1
    scaled = _check_scales(hidden_states, w13, w2, w13_scale, w2_scale, weight_block_size)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    top_k = topk_ids.shape[1]
    if config is None:
        config = _config_for(hidden_states, w13, w2, top_k, w13_scale, w2_scale, weight_block_size)
    if scaled and isinstance(config, GroupedMMConfig):
        raise ValueError("the torch grouped-GEMM path takes bf16 weights, not FP8 ones")
    if isinstance(config, MoEConfig) and config.fp8_act and not scaled:
        raise ValueError("FP8 activations (MoEConfig.fp8_act) need FP8 weights")
    if weight_block_size is not None:
        _check_block_config(config, weight_block_size)
    if isinstance(config, MoEConfig) and config.b_tma and not b_tma_usable(w13, w2):
        # Tuned on one layer's weights: another's may not meet TMA's alignment.
        config = config._replace(b_tma=False)
    out = torch.empty(num_tokens, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    if num_tokens == 0:
        return out
    if isinstance(config, DecodeConfig):
        _fused_moe_decode(
            hidden_states, w13, w2, topk_weights, topk_ids, config, out, w13_scale, w2_scale,
            weight_block_size,
        )  # fmt: skip
        return out
    if isinstance(config, GroupedMMConfig):
        _fused_moe_grouped_mm(
            hidden_states, w13, w2, topk_weights, topk_ids, out, all_experts_local
        )
        return out
    block_m = config.block_m
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, num_experts)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    num_pairs = num_tokens * top_k
    dev, dtype = hidden_states.device, hidden_states.dtype
    routing = (weights, sorted_ids, expert_ids, num_post)
    gate_up_tiles, tma, block = config.gate_up_tiles, config.b_tma, weight_block_size
    # FP8 activations: per token, or per token and bk columns against block scales.
    group = None if block is None else block[1]
    x, x_scale = hidden_states, None
    if config.fp8_act:
        x, x_scale = _quant_act(hidden_states, group)
    act_scale = None
    if config.silu_in_epilogue:
        act = torch.empty(num_pairs, two_inter // 2, dtype=dtype, device=dev)
        _launch(
            x, w13, act, *routing, top_k, "silu_and_mul", block_m, gate_up_tiles, tma,
            w13_scale, x_scale, block,
        )  # fmt: skip
        if config.fp8_act:
            act, act_scale = _quant_act(act, group)
    else:
        gate_up = torch.empty(num_pairs, two_inter, dtype=dtype, device=dev)
        _launch(
            x, w13, gate_up, *routing, top_k, None, block_m, gate_up_tiles, tma, w13_scale,
            x_scale, block,
        )  # fmt: skip
        if config.fp8_act:
            strategy: QuantStrategy = "token" if group is None else "group"
            act, act_scale = silu_and_mul_fp8(gate_up, strategy, group=group)
        else:
            act = silu_and_mul(gate_up)
    # Rows of other ranks' experts are never written: unless there are none, they must read
    # as zeros in the sum.
    alloc = torch.empty if all_experts_local else torch.zeros
    down = alloc(num_pairs, hidden, dtype=dtype, device=dev)
    _launch(
        act, w2, down, *routing, 1, "routed_weight", block_m, config.down_tiles, tma, w2_scale,
        act_scale, block,
    )  # fmt: skip
    return torch.sum(down.view(num_tokens, top_k, hidden), dim=1, out=out)


def _quant_act(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's FP8 input: `x` in e4m3 per token (`[rows, 1]` scales), or per token and
    `group` columns (`[rows, ceil(K / group)]`)."""
    return dynamic_quant_per_token(x) if group is None else dynamic_quant_per_token_group(x, group)


def _check_scales(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    weight_block_size: tuple[int, int] | None = None,
) -> bool:
    """Whether the weights are FP8 with row scales, or block scales with `weight_block_size`
    (asserting the shapes and dtypes agree); else the weights are in hidden_states' dtype."""
    if w13_scale is None and w2_scale is None:
        assert weight_block_size is None, "weight_block_size goes with FP8 weights' scales"
        assert hidden_states.dtype == w13.dtype == w2.dtype, (hidden_states.dtype, w13.dtype)
        return False
    assert w13_scale is not None and w2_scale is not None, "w13_scale and w2_scale go together"
    assert w13.dtype == w2.dtype == torch.float8_e4m3fn, (w13.dtype, w2.dtype)
    if weight_block_size is None:
        assert w13_scale.shape == w13.shape[:2] and w2_scale.shape == w2.shape[:2]
    else:
        bn, bk = weight_block_size
        assert bn >= 1 and bk % 16 == 0, ("bk a multiple of 16 (a dot's K steps)", bn, bk)
        for w, s in ((w13, w13_scale), (w2, w2_scale)):
            tiles = (w.shape[0], -(-w.shape[1] // bn), -(-w.shape[2] // bk))
            assert s.shape == tiles, (f"block scales {tuple(s.shape)} for {tuple(w.shape)}", tiles)
    assert w13_scale.dtype == w2_scale.dtype == torch.float32
    assert w13_scale.is_contiguous() and w2_scale.is_contiguous()
    return True


def grouped_mm_supported(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the torch grouped-GEMM path can run these weights: torch has the op, bf16,
    H and I multiples of 8 (its operands' strides must be multiples of 16 bytes)."""
    inter, hidden = w2.shape[2], w2.shape[1]
    return (
        hasattr(torch, "_grouped_mm")
        and w13.dtype == w2.dtype == torch.bfloat16
        and hidden % 8 == 0
        and inter % 8 == 0
    )


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def b_tma_usable(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the grouped path can read these expert weights through TMA descriptors
    (`MoEConfig.b_tma`): a CUDA sm_90+ device or the interpreter, 16-byte aligned bases and
    rows (H and I times the element size multiples of 16 bytes)."""
    if w13.is_cuda:
        if _capability(w13.device.index)[0] < 9:
            return False
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return False
    inter, hidden, size = w2.shape[2], w2.shape[1], w2.element_size()
    return (
        (hidden * size) % 16 == 0
        and (inter * size) % 16 == 0
        and w13.data_ptr() % 16 == 0
        and w2.data_ptr() % 16 == 0
    )


def _fused_moe_grouped_mm(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    all_experts_local: bool,
) -> None:
    num_tokens, hidden = hidden_states.shape
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    # offs[e]: pairs with an id <= e, the end of expert e's rows (ids >= E sort past them).
    bounds = torch.arange(1, num_experts + 1, device=flat_ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    x = hidden_states.index_select(0, order // top_k)
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
    pair_weights = topk_weights.reshape(-1).index_select(0, order)
    silu = silu_and_mul if gate_up.is_cuda else silu_and_mul_ref
    act = silu(gate_up, row_scale=pair_weights)
    down = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    if not all_experts_local:
        # Another rank's pairs: rows past offs[E - 1] that neither GEMM wrote.
        down.masked_fill_((sorted_ids >= num_experts).unsqueeze(1), 0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    per_token = down.index_select(0, inverse).view(num_tokens, top_k, hidden)
    torch.sum(per_token, dim=1, out=out)


def _fused_moe_decode(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: DecodeConfig,
    out: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | None = None,
) -> None:
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = w13.shape
    scale_bn, scale_bk = weight_block_size or (0, 0)
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=torch.float32, device=out.device)
    _moe_decode_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, config.block_n1))](
        hidden_states,
        w13,
        act,
        ids,
        w13 if w13_scale is None else w13_scale,
        num_experts,
        hidden,
        inter,
        hidden_states.stride(0),
        w13.stride(0),
        w13.stride(1),
        TOP_K=top_k,
        BLOCK_N=config.block_n1,
        BLOCK_K=config.block_k1,
        NUM_STAGES=config.num_stages1,
        W_SCALE=w13_scale is not None,
        SCALE_BN=scale_bn,
        SCALE_BK=scale_bk,
        num_warps=config.num_warps,
    )
    _moe_decode_down_kernel[(num_tokens, triton.cdiv(hidden, config.block_n2))](
        act,
        w2,
        out,
        weights,
        ids,
        w2 if w2_scale is None else w2_scale,
        num_experts,
        hidden,
        inter,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_N=config.block_n2,
        BLOCK_K=config.block_k2,
        NUM_STAGES=config.num_stages2,
        W_SCALE=w2_scale is not None,
        SCALE_BN=scale_bn,
        SCALE_BK=scale_bk,
        num_warps=config.num_warps,
    )


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post: torch.Tensor,
    a_row_div: int,
    epilogue: Epilogue,
    block_m: int,
    tiles: GemmTiles,
    b_tma: bool = False,
    b_scale: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | None = None,
) -> None:
    """`c = a @ b^T` over the sorted pairs (`_fused_moe_kernel`); "silu_and_mul": b holds
    gate then up rows and c gets `silu(gate) * up` (half b's rows wide). `b_tma`: b's tiles
    through a TMA descriptor over its `[E * rows, K]` view. `b_scale` `[E, rows]`: b is FP8
    with a scale per expert and row; with `weight_block_size` `(bn, bk)`, `[E, ceil(rows /
    bn), ceil(K / bk)]`, a scale per expert and tile. `a_scale` `[rows of a, 1]`: a is FP8
    too, a scale per row; with `weight_block_size`, `[rows of a, ceil(K / bk)]`, a scale
    per row and bk columns."""
    scale_bn, scale_bk = weight_block_size or (0, 0)
    if a_scale is not None:
        groups = 1 if weight_block_size is None else triton.cdiv(a.shape[1], scale_bk)
        assert a_scale.shape == (a.shape[0], groups) and a_scale.is_contiguous(), a_scale.shape
    em = sorted_ids.shape[0]
    silu = epilogue == "silu_and_mul"
    n, k = b.shape[1] // 2 if silu else b.shape[1], b.shape[2]
    assert c.shape[1] == n
    grid = (triton.cdiv(em, block_m) * triton.cdiv(n, tiles.block_n),)
    b_arg: torch.Tensor | TensorDescriptor = b
    if b_tma:
        b_arg = TensorDescriptor.from_tensor(b.view(-1, k), [tiles.block_n, tiles.block_k])
    _fused_moe_kernel[grid](
        a,
        b_arg,
        c,
        c if b_scale is None else b_scale,
        c if a_scale is None else a_scale,
        weights,
        sorted_ids,
        expert_ids,
        num_post,
        n,
        k,
        em,
        c.shape[0],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        b.shape[1],
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=epilogue == "routed_weight",
        SILU_AND_MUL=silu,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        B_TMA=b_tma,
        B_SCALE=b_scale is not None,
        A_SCALE=a_scale is not None,
        SCALE_BN=scale_bn,
        SCALE_BK=scale_bk,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _shape_key(
    w13: torch.Tensor, top_k: int, weight_block_size: tuple[int, int] | None = None
) -> _ShapeKey:
    num_experts, two_inter, hidden = w13.shape
    block = None
    if weight_block_size is not None:
        block = (int(weight_block_size[0]), int(weight_block_size[1]))
    return (num_experts, two_inter, hidden, top_k, w13.dtype, block)


def _log_key(key: _ShapeKey) -> list[object]:
    """A shape key as the tuning log writes it: `[E, 2I, H, top_k, "torch.bfloat16"]`, and
    `"block:128x128"` after it for block-scaled FP8 weights."""
    head: list[object] = [key[0], key[1], key[2], key[3], str(key[4])]
    block = key[5]
    return head if block is None else [*head, f"block:{block[0]}x{block[1]}"]


def _config_for(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | None = None,
) -> FusedMoEConfig:
    num_tokens = hidden_states.shape[0]
    key = _shape_key(w13, top_k, weight_block_size)
    bucket = token_bucket(num_tokens)
    found = _configs.get((key, bucket))
    if found is not None:
        return found
    weight_bytes = (w13.numel() + w2.numel()) * w13.element_size()
    if weight_bytes >= _MIN_TUNE_BYTES and num_tokens > 0 and _may_tune(hidden_states):
        tune_fused_moe(
            w13,
            w2,
            top_k,
            max_tokens=num_tokens,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            dtype=hidden_states.dtype,
            weight_block_size=weight_block_size,
        )
        found = _configs.get((key, bucket))
        if found is not None:
            return found
    return default_config(num_tokens, top_k, w13.shape[0], weight_block_size)


def tune_fused_moe(
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    max_tokens: int,
    candidates: tuple[MoEConfig, ...] = _CANDIDATES,
    iters: int = 3,
    decode_candidates: tuple[DecodeConfig, ...] = _DECODE_CANDIDATES,
    down_candidates: tuple[GemmTiles, ...] = _DOWN_CANDIDATES,
    grouped_mm: bool | None = None,
    b_tma: bool | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    fp8_act: bool | None = None,
    weight_block_size: tuple[int, int] | None = None,
    finalists: int = _FINALISTS,
) -> dict[int, FusedMoEConfig]:
    """Time `candidates` for every token bucket up to `max_tokens` not tuned yet for this
    layer shape (on these weights, uniformly random routing, seeded) and keep the fastest;
    returns bucket -> config for the shape. Once per shape and bucket per process.

    Buckets of at most `_DECODE_TUNE_MAX_ROWS` rows per expert also time `decode_candidates`
    (the decode path), and there every candidate's whole call is timed replayed from a CUDA
    graph, as decode runs it (eager, the alignment's launches would decide); larger buckets
    are timed eagerly. Then the fastest grouped config of each SiLU form is timed again with
    each of `down_candidates` as GEMM 2's tiles (`MoEConfig.down`), and the fastest of all
    is kept: a second step, not the product of the two lists. `grouped_mm` (None: where
    `grouped_mm_supported`): buckets past the decode path's also time the torch grouped-GEMM
    path (`GroupedMMConfig`). `b_tma` (None: where `b_tma_usable`): last, the fastest config
    of each SiLU form (its down tiles included) is timed again with the weights through TMA
    (`MoEConfig.b_tma`). `w13_scale` / `w2_scale`: FP8 weights (see `fused_moe`), timed on
    activations of `dtype` (None: the weights' dtype, bf16 for FP8 ones). `fp8_act` (None:
    with FP8 weights): last, the fastest config of each SiLU form is timed again with FP8
    activations (`MoEConfig.fp8_act`, W8A8; per token group against block scales).
    `weight_block_size`: the FP8 weights' scales are per tile (see `fused_moe`): every
    candidate is timed `for_block_size` (duplicates once). Last, the
    `finalists` fastest of a bucket are timed again before one is kept (`_final_pick`; the
    log's `final_ms`)."""
    if weight_block_size is not None:
        bk = weight_block_size[1]
        candidates = _unique(for_block_size(c, bk) for c in candidates)
        decode_candidates = _unique(for_block_size(c, bk) for c in decode_candidates)
        down_candidates = _unique(
            t._replace(block_k=_block_k_dividing(t.block_k, bk)) for t in down_candidates
        )
    if fp8_act is None:
        fp8_act = w13_scale is not None
    if dtype is None:
        dtype = torch.bfloat16 if w13_scale is not None else w13.dtype
    if grouped_mm is None:
        grouped_mm = grouped_mm_supported(w13, w2)
    if b_tma is None:
        b_tma = b_tma_usable(w13, w2)
    key = _shape_key(w13, top_k, weight_block_size)
    num_experts, _, hidden = w13.shape
    dev = w13.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    bucket = 1
    while bucket <= token_bucket(max_tokens):
        if (key, bucket) not in _configs:
            x = torch.randn(bucket, hidden, generator=gen).to(device=dev, dtype=dtype)
            scores = torch.rand(bucket, num_experts, generator=gen)
            topk_weights, topk_ids = scores.topk(top_k, dim=-1)
            topk_weights, topk_ids = topk_weights.to(dev), topk_ids.to(dev, torch.int32)
            decode = bucket * top_k <= _DECODE_TUNE_MAX_ROWS * num_experts
            problem = _Problem(
                x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, weight_block_size
            )
            timings: list[tuple[FusedMoEConfig, float]] = []
            others: tuple[FusedMoEConfig, ...] = (
                decode_candidates if decode else (GroupedMMConfig(),) if grouped_mm else ()
            )
            for config in candidates + others:
                if isinstance(config, MoEConfig) and config.block_m > 2 * max(
                    bucket * top_k // num_experts, 16
                ):
                    continue  # tiles far taller than an expert's rows: padding only
                ms = _time_call(problem, config, decode, iters)
                if ms is not None:
                    timings.append((config, ms))
            for silu in (False, True):
                base = _fastest_of_form(timings, silu)
                for down in down_candidates if base is not None else ():
                    if down != base.gate_up_tiles:  # else base itself
                        config = base._replace(down=down)
                        ms = _time_call(problem, config, decode, iters)
                        if ms is not None:
                            timings.append((config, ms))
            # Twins of each form's fastest so far: weights through TMA, then FP8 activations.
            for twin in [name for name, on in (("b_tma", b_tma), ("fp8_act", fp8_act)) if on]:
                for silu in (False, True):
                    base = _fastest_of_form(timings, silu)
                    if base is not None:
                        config = base._replace(**{twin: True})
                        ms = _time_call(problem, config, decode, iters)
                        if ms is not None:
                            timings.append((config, ms))
            if timings:
                best, final_ms = _final_pick(problem, timings, decode, iters, finalists)
                _configs[(key, bucket)] = best
                tuning_log.append(
                    {
                        "key": _log_key(key),
                        "num_tokens": bucket,
                        "timed_in_graph": decode,
                        "ms": {config_name(c): t for c, t in timings},
                        "final_ms": {config_name(c): t for c, t in final_ms.items()},
                        "best": config_name(best),
                    }
                )
        bucket *= 2
    return {b: c for (k, b), c in _configs.items() if k == key}


def _final_pick(
    problem: _Problem,
    timings: list[tuple[FusedMoEConfig, float]],
    in_graph: bool,
    iters: int,
    finalists: int,
) -> tuple[FusedMoEConfig, dict[FusedMoEConfig, float]]:
    """The config to keep of a bucket's `timings`: the `finalists` fastest timed again in
    `_FINAL_ROUNDS` interleaved rounds, each kept by its best retime (the first timings left
    out: one may have run on a burst's clocks, another on held ones); with fewer than two
    finalists, the fastest first timing. Returns it and the finalists' retimes."""
    ranked = _unique(config for config, _ in sorted(timings, key=lambda timed: timed[1]))
    top = ranked[:finalists]
    if len(top) < 2:
        return ranked[0], {}
    retimes: dict[FusedMoEConfig, float] = {}
    for _ in range(_FINAL_ROUNDS):
        for config in top:
            ms = _time_call(problem, config, in_graph, iters)
            if ms is not None:
                retimes[config] = min(ms, retimes.get(config, ms))
    if not retimes:
        return ranked[0], {}
    return min(retimes, key=retimes.__getitem__), retimes


def _unique(items: Iterable[_T]) -> tuple[_T, ...]:
    """`items` in order, each once."""
    return tuple(dict.fromkeys(items))


def _fastest_of_form(
    timings: list[tuple[FusedMoEConfig, float]], silu_in_epilogue: bool
) -> MoEConfig | None:
    """The fastest grouped-path config timed so far with this SiLU form, if any."""
    form = [
        (config, ms)
        for config, ms in timings
        if isinstance(config, MoEConfig) and config.silu_in_epilogue == silu_in_epilogue
    ]
    if not form:
        return None
    best = min(form, key=lambda timed: timed[1])[0]
    assert isinstance(best, MoEConfig)
    return best


def config_name(config: FusedMoEConfig) -> str:
    """`16x64x64x1x4x3` for a grouped-path config, `silu-epilogue:16x64x64x1x4x3` for one
    with SiLU in GEMM 1's epilogue, either followed by `/down:128x64x8x4x3` where GEMM 2 has
    its own tiles, then `+tma` where the weights come through TMA (`MoEConfig.b_tma`) and
    `+a8` where the activations are FP8 too (`MoEConfig.fp8_act`);
    `decode:16x256x1x8x1024x1x4` for the decode path's, `grouped-mm` for the torch
    grouped-GEMM path (the tuning log's names)."""
    if isinstance(config, DecodeConfig):
        return "decode:" + _join(config)
    if isinstance(config, GroupedMMConfig):
        return _GROUPED_MM_NAME
    name = _join(config[:6])
    if config.silu_in_epilogue:
        name = f"silu-epilogue:{name}"
    if config.down is not None:
        name = f"{name}/down:{_join(config.down)}"
    if config.b_tma:
        name += _TMA_SUFFIX
    return name + _FP8_ACT_SUFFIX if config.fp8_act else name


def config_from_name(name: str) -> FusedMoEConfig:
    """The config `config_name` gave this name (a tuning log's entries back to configs)."""
    if name == _GROUPED_MM_NAME:
        return GroupedMMConfig()
    fp8_act = name.endswith(_FP8_ACT_SUFFIX)
    name = name.removesuffix(_FP8_ACT_SUFFIX)
    b_tma = name.endswith(_TMA_SUFFIX)
    name = name.removesuffix(_TMA_SUFFIX)
    head, _, down = name.partition("/down:")
    form, _, tiles = head.rpartition(":")
    values = [int(v) for v in tiles.split("x")]
    if form == "decode" and not down and not b_tma and not fp8_act:
        return DecodeConfig(*values)
    if form not in ("", "silu-epilogue") or len(values) != 6:
        raise ValueError(f"not a fused MoE config name: {name!r}")
    down_tiles = GemmTiles(*(int(v) for v in down.split("x"))) if down else None
    return MoEConfig(
        *values,
        silu_in_epilogue=form == "silu-epilogue",
        down=down_tiles,
        b_tma=b_tma,
        fp8_act=fp8_act,
    )


_GROUPED_MM_NAME = "grouped-mm"
_TMA_SUFFIX = "+tma"
_FP8_ACT_SUFFIX = "+a8"


def _join(values: tuple[int, ...]) -> str:
    return "x".join(map(str, values))


class _Problem(NamedTuple):
    """One `fused_moe` call the tuner times (its arguments but the config)."""

    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    weight_block_size: tuple[int, int] | None


def _time_call(
    problem: _Problem, config: FusedMoEConfig, in_graph: bool, iters: int
) -> float | None:
    """Milliseconds per `fused_moe` of `problem` with `config` (every id < E, as in a layer
    without expert parallel): replayed from a CUDA graph, or eagerly; None when the device
    cannot run the config."""
    from tandem_kernels.fp8_w8a16 import time_in_graph
    from tandem_kernels.paged_attention import time_config

    run = functools.partial(
        fused_moe,
        *problem[:5],
        config,
        all_experts_local=True,
        w13_scale=problem.w13_scale,
        w2_scale=problem.w2_scale,
        weight_block_size=problem.weight_block_size,
    )
    if in_graph:
        us = time_in_graph([run])
        return None if us is None else us / 1e3
    return time_config(run, iters)
