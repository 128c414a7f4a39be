"""Paged attention over the block-table KV cache: prefill/mixed batches and decode.

Batch layout (flattened, no padding): request r owns query rows
`query_start_loc[r]:query_start_loc[r+1]` (q_len_r of them); its context is `seq_lens[r]`
tokens, the last q_len_r of which are its new tokens, already written to the cache:

    positions  0 ............. seq_len - q_len - 1 | seq_len - q_len ...... seq_len - 1
               cached context (prefix hits, chunks)  | this step's query rows j = 0..q_len-1

Query row j attends causally to positions `0 .. seq_len - q_len + j`; with a sliding window W
(`sliding_window`, 0/None: off) only to the last W of them, `p - W < k <= p` for the row at
position p (transformers' convention). Tiles wholly left of a program's window are skipped and
K/V rows left of it are never loaded: a KV manager may free those blocks and leave the null
block id 0 in their block-table slots. Every K/V, the new ones
included, is read from the cache `[num_blocks, 2, block_size, num_kv_heads, head_size]`
through `block_table[r]` (position p lives in block `block_table[r, p // block_size]`, offset
`p % block_size`). The cache may be a strided view: only its last dim must be contiguous.

Entries:
- `paged_prefill_attention`: any batch (prefill, chunked prefill, mixed prefill + decode).
  One program per (block of BLOCK_Q query rows of one request, KV head); the rows of all
  query heads of that KV head are packed into one BLOCK_M = BLOCK_Q * heads-per-group tile,
  so each K/V tile is loaded once per group. Online softmax, fp32 accumulation.
- `paged_decode_attention`: every request has exactly one query row (row r is request r).
  Split-K (flash-decoding): each request's context is cut into `num_splits` partitions, one
  program per (request, KV head, partition); a second kernel merges the partial results,
  or (`merge_last`) the last of a (request, KV head)'s programs to finish does (a lock counts
  arrivals).
  `num_splits` is a function of Python ints only (`decode_num_splits`), and partition sizes
  are derived inside the kernel from the device-side `seq_lens`, so a captured CUDA graph is
  correct for any sequence lengths.
- `paged_attention`: dispatches on `max_query_len == 1`.

Head size: any (padded to a power of two inside). num_heads must be a multiple of num_kv_heads.

FP8 cache (`float8_e4m3fn`, with a query in bf16/fp16/fp32): K and V tiles are converted to the
query's dtype as they are loaded (exact: every e4m3 value is a bf16), the per-tensor `k_scale`
is folded into the softmax scale and `v_scale` into the output, so the cache is read once at
half the bytes and nothing is dequantized outside the kernels. `x ~= x_fp8 * scale`, as
`reshape_and_cache` wrote it.

Long contexts (to 128k tokens): cache offsets are int64 (block ids are widened before they
multiply the block stride, which spans every layer: 2 MiB per 16-token block at the 8B shape, so
a cache past 2^31 elements is the normal case); positions, lengths and the block-table index stay
int32. Decode splits are capped at MAX_NUM_SPLITS, the width of the merge kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator

import torch
import triton
import triton.language as tl

from tandem_kernels.pdl import launch_options, pdl_launch, pdl_wait

_LOG2E = 1.4426950408889634
# Below this many context tokens per partition a split costs more than it brings.
MIN_TOKENS_PER_SPLIT = 256
MAX_NUM_SPLITS = 64
# Fully masked rows start from this instead of -inf so no inf - inf appears.
_NEG_INIT = tl.constexpr(-1.0e30)
# The FP8 KV cache's dtype (`--kv-cache-dtype fp8`).
FP8_KV_DTYPE = torch.float8_e4m3fn


@triton.jit
def find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= pid (the request of q-block pid)."""
    lo = pid * 0
    hi = pid * 0 + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def load_q_tile(
    q_ptr,
    q_start,
    q_len,
    context_len,
    q_block,
    kv_head,
    stride_q_tok,
    stride_q_head,
    QPK: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
):
    """The query tile of q-block `q_block` of a request (rows from `q_start`, `q_len` of
    them) for KV head `kv_head`, GQA rows packed: tile row m is query row
    `q_idx = q_block * BLOCK_Q + m // QPK_PAD` for query head `kv_head * QPK + m % QPK_PAD`
    (padded heads and rows past `q_len` read 0). Returns `(q, q_idx, q_pos, head, tok, offs_d,
    row_valid, q_mask)`: `q_pos` the rows' positions (`context_len + q_idx`), `tok` their
    int64 token indices, `q_mask` `[BLOCK_M, BLOCK_D]`."""
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // QPK_PAD
    head_in_group = offs_m % QPK_PAD
    row_valid = (q_idx < q_len) & (head_in_group < QPK)
    q_pos = context_len + q_idx
    head = kv_head * QPK + head_in_group
    tok = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_SIZE
    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    return q, q_idx, q_pos, head, tok, offs_d, row_valid, q_mask


@triton.jit
def store_out_tile(out_ptr, out, tok_rows, head_rows, offs_d, stride_o_tok, stride_o_head, mask):
    """Store fp32 `out` at `out[tok, head, offs_d]` in the output's dtype: `tok_rows` and
    `head_rows` are the rows' token and head indices shaped to broadcast against
    `offs_d[None, :]` (`[M, 1]` columns or scalars)."""
    tl.store(
        out_ptr + tok_rows * stride_o_tok + head_rows * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def online_softmax_step(m_i, l_i, acc, qk, v, INPUT_PRECISION: tl.constexpr):
    """One key tile into a row block's running max `m_i`, sum `l_i` and output `acc`
    (unnormalised): `qk` the tile's scores in log2 units, -inf where masked; `v` its values.
    Shared by every attention kernel here and in tandem_kernels.cascade_attention."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def widen_kv(x, dtype: tl.constexpr, HW_FP8: tl.constexpr):
    """A K or V tile in the dtype of the query it meets. With HW_FP8 (the launcher's word: CUDA
    sm_89 or later, not the interpreter), an FP8 (e4m3) tile meeting an fp16 query is widened
    by the hardware's paired conversion (`cvt.rn.f16x2.e4m3x2`: one instruction per two
    values, exact, since e4m3 is a subset of fp16); Triton's
    own FP8 -> bf16 path is about six integer instructions a value, which held the FP8 decode
    kernel at half the bf16 kernel's bytes per second on the H200. Any other pair: `.to`."""
    if HW_FP8 and x.dtype == tl.float8e4nv and dtype == tl.float16:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            constraints="=r,=r,r",
            args=[x],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    return x.to(dtype)


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    start_n,
    key_start,
    key_end,
    q_pos,
    window,
    bt_row,
    cache_head,
    scale_log2,
    stride_c_block,
    stride_c_kv,
    stride_c_off,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    MASK_BELOW: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HW_FP8: tl.constexpr = False,
):
    """One online-softmax step over keys start_n .. start_n + BLOCK_N of the paged context.

    MASK_KEYS: keys at or past key_end are neither loaded nor used (else the whole tile is
    valid); MASK_BELOW: nor are keys below key_start (a sliding window's left edge). Only
    callers with a window set MASK_BELOW: its second compare took the FP8 decode kernel's
    128-key config from 168 to 182 registers a thread (Triton 3.6, sm_90a), two blocks an SM
    instead of three, and it ran 20% slower on the H200 (benchmarks/kernel_registers.py).
    CAUSAL: key n is dropped for row m when n > q_pos[m]. WINDOW: key n is dropped for row m
    when n <= q_pos[m] - window.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_SIZE
    n_valid = offs_n < key_end
    if MASK_BELOW:
        n_valid = n_valid & (offs_n >= key_start)
    if MASK_KEYS:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_mask = n_valid[:, None] & d_mask[None, :]
    else:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    kv_row = cache_head + blk * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_off
    # An FP8 cache is widened to the query's dtype here (a no-op for a cache in that dtype).
    k = tl.load(kv_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    k = widen_kv(k, q.dtype, HW_FP8)
    v = tl.load(kv_row[:, None] + stride_c_kv + offs_d[None, :], mask=kv_mask, other=0.0)
    v = widen_kv(v, q.dtype, HW_FP8)

    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2
    if CAUSAL or WINDOW:
        keep = n_valid[None, :] & (q_pos[:, None] >= 0)  # [rows, keys]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW:
            keep = keep & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
    elif MASK_KEYS:
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
    return online_softmax_step(m_i, l_i, acc, qk, v, INPUT_PRECISION)


# Ints that change from step to step are not specialised on (divisibility by 16, == 1):
# otherwise a new batch shape could compile a new kernel variant in the middle of serving.
@triton.jit(
    do_not_specialize=["num_reqs", "stride_bt", "window"],
    # Mixed steps pass row-offset views (seq_lens[nd:], block_table[nd:]): their alignment
    # changes with nd, and must not pick a new variant either.
    do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr"],
)
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    scale_log2,
    v_scale,
    num_reqs,
    window,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_kv,
    stride_c_off,
    stride_c_head,
    stride_bt,
    QPK: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCALE_V: tl.constexpr,
    SLIDING: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # Row m of the tile: query row q_idx of this request, query head `head`.
    q, _q_idx, q_pos, head, tok, offs_d, _row_valid, q_mask = load_q_tile(
        q_ptr, q_start, q_len, context_len, q_block, kv_head, stride_q_tok, stride_q_head, QPK,
        QPK_PAD, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_SIZE,
    )  # fmt: skip

    m_i = tl.full([BLOCK_M], _NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys below the tile's first row are visible to every row: no masks. The rest, up to the
    # last row's position (causal) and within the context, is the masked diagonal. With a
    # window, keys from the first row's window start (`key_lo`) to where every row's window
    # has begun (`left_end`) are a masked band, and tiles left of `key_lo` are not visited:
    #
    #   key_lo   left_end          full_end   num_keys
    #     |  band   |    unmasked     | diagonal |
    p_first = context_len + q_block * BLOCK_Q
    num_keys = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    full_end = p_first // BLOCK_N * BLOCK_N
    key_lo = p_first * 0
    left_end = key_lo
    if SLIDING:
        key_lo = tl.maximum(p_first - window + 1, 0)
        left_end = tl.minimum(
            tl.cdiv(tl.maximum(num_keys - window, 0), BLOCK_N) * BLOCK_N, full_end
        )
        left_end = tl.maximum(left_end, key_lo // BLOCK_N * BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    cache_head = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    if SLIDING:
        for start_n in range(key_lo // BLOCK_N * BLOCK_N, left_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, start_n, key_lo, num_keys, q_pos, window, bt_row, cache_head,
                scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D,
                BLOCK_SIZE, HEAD_SIZE, True, True, False, True, INPUT_PRECISION,
            )  # fmt: skip
    for start_n in range(left_end, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, key_lo, num_keys, q_pos, window, bt_row, cache_head,
            scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            HEAD_SIZE, False, False, False, False, INPUT_PRECISION,
        )  # fmt: skip
    for start_n in range(tl.maximum(full_end, left_end), num_keys, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, key_lo, num_keys, q_pos, window, bt_row, cache_head,
            scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            HEAD_SIZE, True, SLIDING, True, SLIDING, INPUT_PRECISION,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SCALE_V:
        out = out * v_scale
    store_out_tile(
        out_ptr, out, tok[:, None], head[:, None], offs_d, stride_o_tok, stride_o_head, q_mask
    )


@triton.jit(
    do_not_specialize=["num_splits", "stride_bt", "window"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "block_table_ptr"],
)
def _decode_kernel(
    q_ptr,
    cache_ptr,
    seq_lens_ptr,
    block_table_ptr,
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    locks_ptr,
    scale_log2,
    v_scale,
    num_splits,
    num_heads,
    window,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_kv,
    stride_c_off,
    stride_c_head,
    stride_bt,
    QPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    SCALE_V: tl.constexpr,
    SLIDING: tl.constexpr,
    FP16_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
    MERGE_LAST: tl.constexpr = False,
    QPK_P2: tl.constexpr = 1,
    CHUNK_S: tl.constexpr = 8,
):
    pdl_wait(USE_PDL)
    # HEADS_FIRST: the KV heads of one request are neighbouring programs, so the programs in
    # flight together read whole token rows of the cache (all heads) rather than one head's
    # slice of many requests' rows.
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        req = tl.program_id(1)
    else:
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    # The keys read: [key_lo, seq_len), the last `window` with a sliding window. Partitions
    # are whole BLOCK_N tiles from key_lo's tile on; trailing partitions may be empty.
    key_lo = seq_len * 0
    if SLIDING:
        key_lo = tl.maximum(seq_len - window, 0)
    tile_lo = key_lo // BLOCK_N * BLOCK_N
    part_len = tl.cdiv(tl.cdiv(seq_len - tile_lo, num_splits), BLOCK_N) * BLOCK_N
    start = tile_lo + split * part_len
    end = tl.maximum(tl.minimum(start + part_len, seq_len), start)

    offs_h = tl.arange(0, BLOCK_H)
    h_valid = offs_h < QPK
    head = kv_head * QPK + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_SIZE
    hd_mask = h_valid[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + req.to(tl.int64) * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=hd_mask,
        other=0.0,
    )
    if FP16_DOT:  # an FP8 cache: fp16 products (see widen_kv); q kept inside fp16's range
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], _NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    cache_head = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    # The window's first tile masked (keys below key_lo), whole tiles unmasked, then the
    # tail; q_pos (here `start`) is unused: not causal, the window is [key_lo, seq_len).
    first_full = start
    if SLIDING:
        first_full = tl.minimum(tl.maximum(start, tl.cdiv(key_lo, BLOCK_N) * BLOCK_N), end)
        for start_n in range(start, first_full, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, start_n, key_lo, end, start, window, bt_row, cache_head,
                scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D,
                BLOCK_SIZE, HEAD_SIZE, True, True, False, False, INPUT_PRECISION, FP16_DOT,
            )  # fmt: skip
    full_end = first_full + (end - first_full) // BLOCK_N * BLOCK_N
    for start_n in range(first_full, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, key_lo, end, start, window, bt_row, cache_head,
            scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            HEAD_SIZE, False, False, False, False, INPUT_PRECISION, FP16_DOT,
        )  # fmt: skip
    for start_n in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, key_lo, end, start, window, bt_row, cache_head,
            scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            HEAD_SIZE, True, SLIDING, False, False, INPUT_PRECISION, FP16_DOT,
        )  # fmt: skip

    if SCALE_V:  # the merge is linear in each partition's accumulator
        acc = acc * v_scale
    if SPLIT:
        # Unnormalised partial results, [num_reqs, num_heads, num_splits(, head_size)].
        part = (req * num_heads + head).to(tl.int64) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=h_valid)
        tl.store(part_l_ptr + part, l_i, mask=h_valid)
        tl.store(part_out_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :], acc, mask=hd_mask)
        if MERGE_LAST:
            # The last of the (request, KV head)'s partitions to finish merges them all (see
            # `paged_decode_attention`): no second launch.
            tl.debug_barrier()  # every thread's partial stored before the one thread's release
            lock = locks_ptr + req * (num_heads // QPK) + kv_head
            arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                _merge_partials(
                    part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, req, kv_head * QPK,
                    num_splits, num_heads, stride_o_tok, stride_o_head, QPK, QPK_P2, CHUNK_S,
                    BLOCK_D, HEAD_SIZE,
                )  # fmt: skip
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        store_out_tile(
            out_ptr, out, req.to(tl.int64), head[:, None], offs_d, stride_o_tok, stride_o_head,
            hd_mask,
        )  # fmt: skip


@triton.jit
def _merge_partials(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    req,
    head0,
    num_splits,
    num_heads,
    stride_o_tok,
    stride_o_head,
    QPK: tl.constexpr,
    QPK_P2: tl.constexpr,
    CHUNK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
):
    """Heads `head0 .. head0 + QPK` of request `req`: their `num_splits` partial results
    merged and stored, as `_decode_reduce_kernel` does for one head (the maximum first, then
    the weighted sums, `CHUNK_S` partitions at a time). The partials are read past L1 (`.cg`):
    other SMs wrote them, and this SM may hold lines of an earlier call's at the same
    addresses."""
    offs_h = tl.arange(0, QPK_P2)
    h_mask = offs_h < QPK
    head = head0 + offs_h
    row = (req * num_heads + head).to(tl.int64) * num_splits  # [QPK_P2]
    offs_c = tl.arange(0, CHUNK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_SIZE
    m_max = tl.full([QPK_P2], _NEG_INIT, dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        s_mask = h_mask[:, None] & (s0 + offs_c < num_splits)[None, :]
        m = tl.load(
            part_m_ptr + row[:, None] + s0 + offs_c[None, :],
            mask=s_mask,
            other=_NEG_INIT,
            cache_modifier=".cg",
        )
        m_max = tl.maximum(m_max, tl.max(m, axis=1))
    l_tot = tl.zeros([QPK_P2], dtype=tl.float32)
    acc = tl.zeros([QPK_P2, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        s_mask = h_mask[:, None] & (s0 + offs_c < num_splits)[None, :]
        part = row[:, None] + s0 + offs_c[None, :]  # [QPK_P2, CHUNK_S]
        m = tl.load(part_m_ptr + part, mask=s_mask, other=_NEG_INIT, cache_modifier=".cg")
        l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0, cache_modifier=".cg")  # noqa: E741
        w = tl.exp2(m - m_max[:, None])
        l_tot += tl.sum(w * l, axis=1)
        o = tl.load(
            part_out_ptr + part[:, :, None] * HEAD_SIZE + offs_d[None, None, :],
            mask=s_mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.sum(o * w[:, :, None], axis=1)
    l_tot = tl.where(l_tot > 0.0, l_tot, 1.0)
    out = acc / l_tot[:, None]
    tl.store(
        out_ptr + req.to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_splits,
    num_heads,
    stride_o_tok,
    stride_o_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_SIZE
    part = (req * num_heads + head).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=_NEG_INIT)
    l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)  # noqa: E741
    acc = tl.load(
        part_out_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(w * l, axis=0)
    l_tot = tl.where(l_tot > 0.0, l_tot, 1.0)
    out = tl.sum(acc * w[:, None], axis=0) / l_tot
    tl.store(
        out_ptr + req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def check_common(
    query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
) -> tuple[int, int, int, int]:
    """Assert the layouts every paged kernel assumes; `(num_heads, num_kv_heads, head_size,
    block_size)`."""
    assert query.dim() == 3 and query.stride(-1) == 1, (query.shape, query.stride())
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.stride(-1) == 1
    _, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, cache_head_size = kv_cache.shape
    assert cache_head_size == head_size, (kv_cache.shape, query.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.dtype == kv_cache.dtype or kv_cache.dtype == FP8_KV_DTYPE, (
        query.dtype,
        kv_cache.dtype,
    )
    assert query.dtype in (torch.bfloat16, torch.float16, torch.float32), query.dtype
    assert block_size & (block_size - 1) == 0, block_size
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32, seq_lens.dtype
    assert block_table.dim() == 2 and block_table.dtype == torch.int32, block_table.dtype
    assert block_table.stride(-1) == 1 and block_table.shape[0] >= seq_lens.shape[0]
    return num_heads, num_kv_heads, head_size, block_size


def check_kv_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Scales other than 1.0 belong to an FP8 cache only."""
    if kv_cache.dtype != FP8_KV_DTYPE:
        assert k_scale == 1.0 and v_scale == 1.0, (kv_cache.dtype, k_scale, v_scale)
    assert k_scale > 0 and v_scale > 0, (k_scale, v_scale)


def window_arg(sliding_window: int | None) -> int:
    """The kernels' `window` argument: 0 for full attention."""
    assert sliding_window is None or sliding_window >= 0, sliding_window
    return sliding_window or 0


def input_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s precision for inputs of `dtype`: "ieee" for fp32 (exact products; tf32
    would lose ~3 digits), else "tf32" (ignored for 16-bit inputs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for a flattened batch of any query lengths (see the module docstring).

    query `[T, H, D]`; kv_cache `[num_blocks, 2, block_size, Hkv, D]` (strided view allowed);
    query_start_loc `[R + 1]` int32; seq_lens `[R]` int32; block_table `[>= R, max_blocks]`
    int32. Rows of `query` past `query_start_loc[R]` are not written in `out`. Launches one
    kernel; reads no device values on the host. `block_q`, `block_n`, `num_warps` and
    `num_stages` are tuning knobs; left unset on CUDA, the first large enough call tunes
    them (see `_tuned_prefill_config`). `k_scale` / `v_scale`: an FP8 cache's scales.
    `sliding_window`: each row attends to the last that many positions (0/None: all).
    """
    num_heads, num_kv_heads, head_size, block_size = check_common(
        query, kv_cache, seq_lens, block_table
    )
    check_kv_scales(kv_cache, k_scale, v_scale)
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.stride(-1) == 1 and out.dtype == query.dtype
    num_tokens = query.shape[0]
    window = window_arg(sliding_window)
    if num_tokens == 0 or num_reqs == 0:
        return out
    if block_q is None and block_n is None and num_warps is None and num_stages is None:
        config = _tuned_prefill_config(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale * k_scale, out
        )
        if config is not None:
            block_q, block_n, num_warps, num_stages = config
    num_warps = 4 if num_warps is None else num_warps
    num_stages = 3 if num_stages is None else num_stages

    qpk = num_heads // num_kv_heads
    qpk_pad = triton.next_power_of_2(qpk)
    block_d = triton.next_power_of_2(head_size)
    if block_q is None:
        block_m = 64 if block_d <= 128 else 32
        block_q = max(block_m // qpk_pad, 1)
    block_m = max(block_q * qpk_pad, 16)
    block_q = block_m // qpk_pad
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        scale * k_scale * _LOG2E,
        v_scale,
        num_reqs,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        QPK=qpk,
        QPK_PAD=qpk_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        INPUT_PRECISION=input_precision(query.dtype),
        SCALE_V=v_scale != 1.0,
        SLIDING=window > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# (head size, query heads per KV head, dtype, block size): what a tuned config is kept for.
ShapeKey = tuple[int, int, torch.dtype, int]


def shape_key(num_heads: int, kv_cache: torch.Tensor) -> ShapeKey:
    """The key tuned configs and picked paths are kept under, for this layer's cache."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    return attention_shape_key(num_heads, num_kv_heads, head_size, kv_cache.dtype, block_size)


def attention_shape_key(
    num_heads: int, num_kv_heads: int, head_size: int, kv_cache_dtype: torch.dtype, block_size: int
) -> ShapeKey:
    """`shape_key` from host values (a step's planner has no cache tensor at hand)."""
    return (head_size, num_heads // num_kv_heads, kv_cache_dtype, block_size)


def key_json(key: ShapeKey) -> list[object]:
    """A shape key as JSON values (for the tuning logs)."""
    return [key[0], key[1], str(key[2]), key[3]]


def may_tune(device: torch.device) -> bool:
    """Tuning runs on CUDA only: not on the CPU interpreter, not when TANDEM_TUNE_KERNELS=0."""
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("TANDEM_TUNE_KERNELS", "1") != "0"
    )


# Prefill configurations tried on CUDA: (query rows per tile BLOCK_M, keys per tile BLOCK_N,
# warps, pipeline stages); BLOCK_M counts rows of all query heads of a KV head together.
_PREFILL_CANDIDATES = (
    (64, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 32, 4, 3),
    (128, 64, 4, 2),
    (256, 64, 8, 2),
    (64, 32, 4, 4),
)
# Calls with fewer query rows than this run the default config and tune nothing (the prefill
# paths' timing in cascade_attention follows the same rule).
MIN_TUNE_TOKENS = 1024
# Shape key (`shape_key`) -> (block_q, block_n, warps, stages).
_prefill_configs: dict[ShapeKey, tuple[int, int, int, int]] = {}
prefill_tuning_log: list[dict[str, object]] = []
_tuning_allowed = False


@contextlib.contextmanager
def prefill_tuning() -> Iterator[None]:
    """Allow `paged_prefill_attention` to tune its config inside this block (an engine's
    start-up forward); elsewhere it uses a tuned config or the default and never compiles
    candidates in the middle of serving."""
    global _tuning_allowed
    previous, _tuning_allowed = _tuning_allowed, True
    try:
        yield
    finally:
        _tuning_allowed = previous


def prefill_tuning_active() -> bool:
    """True inside `prefill_tuning()` (kernels may time candidates on the call they serve)."""
    return _tuning_allowed


def _tuned_prefill_config(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> tuple[int, int, int, int] | None:
    """The fastest of `_PREFILL_CANDIDATES` for this model's attention shape on this device.

    Timed once per shape key, inside `prefill_tuning()` only (an engine's memory-profiling
    forward at start-up), on the first call with at least `MIN_TUNE_TOKENS` query rows, on
    that call's own inputs; each candidate runs twice untimed (compilation) and three times
    timed. Not on the CPU interpreter, not during CUDA graph capture, not when
    TANDEM_TUNE_KERNELS=0.
    """
    if not may_tune(query.device):
        return None
    key = shape_key(query.shape[1], kv_cache)
    if key in _prefill_configs:
        return _prefill_configs[key]
    if (
        not _tuning_allowed
        or query.shape[0] < MIN_TUNE_TOKENS
        or torch.cuda.is_current_stream_capturing()
    ):
        return None
    qpk_pad = triton.next_power_of_2(key[1])
    timings: dict[tuple[int, int, int, int], float] = {}
    for block_m, block_n, warps, stages in _PREFILL_CANDIDATES:
        if block_m < qpk_pad:
            continue
        config = (block_m // qpk_pad, block_n, warps, stages)
        run = functools.partial(
            paged_prefill_attention,
            query,
            kv_cache,
            query_start_loc,
            seq_lens,
            block_table,
            scale,
            out=out,
            block_q=config[0],
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        )
        ms = time_config(run, iters=3)
        if ms is not None:
            timings[config] = ms
    if not timings:
        return None
    best = min(timings, key=lambda c: timings[c])
    _prefill_configs[key] = best
    prefill_tuning_log.append(
        {
            "key": key_json(key),
            "num_tokens": query.shape[0],
            "ms": {"x".join(map(str, c)): t for c, t in timings.items()},
            "best": "x".join(map(str, best)),
        }
    )
    return best


def time_config(run: Callable[[], object], iters: int, lead_cycles: int = 0) -> float | None:
    """Milliseconds per call of `run` on the current stream after two untimed calls (which
    compile it); None when this device cannot run the config (shared memory, registers).
    `lead_cycles`: a sleep kernel of that many clock cycles is queued before the timed calls,
    keeping the stream busy while the host enqueues them (see `time_device`)."""
    try:
        run()
        run()
    except Exception:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if lead_cycles:
        torch.cuda._sleep(lead_cycles)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


# Clock cycles of the sleep kernel `time_device` queues before its timed calls: about 5 ms at
# Hopper's clocks, more than a few calls' host work (the calls it times are long steps' pieces).
DEVICE_TIMING_LEAD_CYCLES = 10_000_000


def time_device(run: Callable[[], object], iters: int) -> float | None:
    """Milliseconds of device time per call of `run`: `time_config` with the host's work left
    out, since a call whose host side (op dispatch, a library's plan lookup) takes longer than
    its kernels is not charged for it. For paths that run in eager steps with many layers
    queued ahead, where the device, not the host, sets the pace."""
    return time_config(run, iters, DEVICE_TIMING_LEAD_CYCLES)


@functools.lru_cache(maxsize=16)
def _converts_fp8_in_hardware(device: torch.device) -> bool:
    """Whether `device` has the paired e4m3 -> fp16 conversion `widen_kv` uses (CUDA sm_89+).
    Cached: the decode launcher asks on every call."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def decode_merge_setting() -> bool:
    """TANDEM_DECODE_MERGE, read once a process: unset or "kernel", split decode partitions
    merged by a second kernel (the measured default); "last", by the last program of each
    (request, KV head), one launch fewer a layer (off: with the fused rotary and K/V write,
    batch-1 FP8 decode with PDL took 3.56 ms against 3.55 without either on an H100, session
    21; scripts/gpu_session20.sh PART=fuse)."""
    flag = os.environ.get("TANDEM_DECODE_MERGE", "kernel")
    if flag not in ("last", "kernel"):
        raise ValueError(f"TANDEM_DECODE_MERGE={flag!r}: expected 'last' or 'kernel'")
    return flag == "last"


# Lock buffers of the in-kernel decode merge, per device, largest last. A CUDA graph keeps
# the address of the buffer it was captured with, so none is ever freed or replaced. Calls
# that share a buffer must not overlap: one stream's decode calls (and graph replays) at a time,
# as for the W8A16 GEMV's locks.
_merge_lock_buffers: dict[torch.device, list[torch.Tensor]] = {}


def _merge_locks(device: torch.device, count: int) -> torch.Tensor | None:
    """An int32 lock buffer of at least `count` zeros (one per (request, KV head)), made
    outside CUDA graph capture; None while capturing when none is large enough."""
    buffers = _merge_lock_buffers.setdefault(device, [])
    if buffers and buffers[-1].numel() >= count:
        return buffers[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    size = max(count, 4096, 2 * buffers[-1].numel() if buffers else 0)
    buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def decode_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Partitions per request so that (requests x KV heads x splits) fills the GPU.

    One partition once the (request, KV head) programs alone cover three quarters of the SMs;
    below that, enough to aim at two programs an SM. Never cuts a context into pieces shorter
    than MIN_TOKENS_PER_SPLIT. A function of Python ints only, so it is fixed at graph capture.

    Measured in CUDA graphs on an H100, the 8B's attention shape at 1,024 tokens
    (benchmarks/decode_configs.py; decode_configs_h100_2026-12-06_s24.json): a split's partial
    results and their merge cost more than its parallelism gives once every SM has a program
    (batch 16, 128 programs: 2,159 GB/s of KV read at one split against 2,096 at the three
    the two-an-SM aim gave; batch 32: 2,674 against 2,296 at two), while below that more
    splits keep paying (batch 1: 190 GB/s at one split, 508 at eight; batch 8: 1,236 at one,
    1,694 at four). Aiming at one program an SM at every batch was slower served (TPOT p50
    7.87-7.89 ms against 7.48 at 5 req/s, where about 8 requests decode at a time).
    """
    programs = max(num_reqs * num_kv_heads, 1)
    if 4 * programs >= 3 * num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    by_len = max(math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT), 1)
    return max(1, min(wanted, by_len, MAX_NUM_SPLITS))


# Decode configurations tried on CUDA: (keys per tile BLOCK_N, warps, pipeline stages, heads
# first, register cap a thread or 0 for none). The first is the untuned default. The capped
# ones: uncapped under Triton 3.6 the 128-key config reading an FP8 cache in fp16 takes 196
# registers a thread (two blocks of 4 warps an SM); ptxas fits it in 168 (three) and 128
# (four) with no or 68 bytes of spill (benchmarks/kernel_registers.py). Results do not depend
# on the cap, only speed.
_DECODE_CANDIDATES: tuple[tuple[int, int, int, bool, int], ...] = (
    (64, 4, 3, False, 0),
    (64, 4, 3, True, 0),
    (32, 4, 4, True, 0),
    (128, 4, 3, True, 0),
    (64, 8, 3, True, 0),
    (128, 8, 2, True, 0),
    (32, 2, 4, True, 0),
    (16, 4, 4, True, 0),
    (128, 4, 3, True, 168),
    (128, 4, 3, True, 128),
)
# Shape key (`shape_key`) -> (block_n, warps, stages, heads first, register cap).
_decode_configs: dict[ShapeKey, tuple[int, int, int, bool, int]] = {}
decode_tuning_log: list[dict[str, object]] = []


def tune_decode_attention(
    kv_cache: torch.Tensor,
    num_heads: int,
    *,
    num_reqs: int,
    seq_len: int,
    candidates: tuple[tuple[int, int, int, bool, int], ...] = _DECODE_CANDIDATES,
    iters: int = 5,
) -> tuple[int, int, int, bool, int] | None:
    """Pick the fastest decode config for this attention shape on this device, once per
    process (a later call returns the config already picked).

    Times `candidates` on a synthetic batch: `num_reqs` requests of `seq_len` tokens over
    distinct blocks of `kv_cache` (one layer's `[num_blocks, 2, block_size, Hkv, D]` view, its
    contents irrelevant: only time is measured) in shuffled order, as in a pool after churn.
    The batch shrinks to what the cache holds. Returns the config now used by every
    `paged_decode_attention` call of this shape that sets no knob (None: nothing tuned).
    Call it before capturing CUDA graphs (they keep the config they were captured with).
    Not on the CPU interpreter, not during capture, not when TANDEM_TUNE_KERNELS=0.
    """
    if not may_tune(kv_cache.device) or torch.cuda.is_current_stream_capturing():
        return None
    num_blocks, _, block_size, num_kv_heads, head_size = kv_cache.shape
    key = shape_key(num_heads, kv_cache)
    if key in _decode_configs:  # once per process: every engine in it runs the same kernels
        return _decode_configs[key]
    blocks_per_req = -(-seq_len // block_size)
    num_reqs = min(num_reqs, num_blocks // max(blocks_per_req, 1))
    if num_reqs < 1 or seq_len < 1:
        return None
    dev = kv_cache.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randperm(num_blocks, generator=gen)[: num_reqs * blocks_per_req]
    block_table = ids.view(num_reqs, blocks_per_req).to(device=dev, dtype=torch.int32)
    seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32, device=dev)
    # An FP8 cache is read by a bf16 query (the models' dtype on CUDA).
    q_dtype = torch.bfloat16 if kv_cache.dtype == FP8_KV_DTYPE else kv_cache.dtype
    query = torch.randn((num_reqs, num_heads, head_size), generator=gen, dtype=torch.float32).to(
        device=dev, dtype=q_dtype
    )
    out = torch.empty_like(query)
    splits = decode_num_splits(num_reqs, num_kv_heads, seq_len, _num_sms(dev))
    timings: dict[tuple[int, int, int, bool, int], float] = {}
    for config in candidates:
        run = functools.partial(
            paged_decode_attention,
            query,
            kv_cache,
            seq_lens,
            block_table,
            1.0 / math.sqrt(head_size),
            max_seq_len=seq_len,
            num_splits=splits,
            out=out,
            block_n=config[0],
            num_warps=config[1],
            num_stages=config[2],
            heads_first=config[3],
            max_registers=config[4],
        )
        ms = time_config(run, iters)
        if ms is not None:
            timings[config] = ms
    if not timings:
        return None
    best = min(timings, key=lambda c: timings[c])
    _decode_configs[key] = best
    kv_bytes = num_reqs * seq_len * num_kv_heads * head_size * 2 * kv_cache.element_size()
    decode_tuning_log.append(
        {
            "key": key_json(key),
            "num_reqs": num_reqs,
            "seq_len": seq_len,
            "num_splits": splits,
            "ms": {_config_name(c): t for c, t in timings.items()},
            "kv_read_GBps": {_config_name(c): kv_bytes / t / 1e6 for c, t in timings.items()},
            "best": _config_name(best),
        }
    )
    return best


def _config_name(config: tuple[int, int, int, bool, int]) -> str:
    cap = f"/maxnreg{config[4]}" if config[4] else ""
    return "x".join(map(str, config[:3])) + ("/heads-first" if config[3] else "") + cap


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_first: bool | None = None,
    max_registers: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    merge_last: bool | None = None,
) -> torch.Tensor:
    """Attention of one query row per request over its whole cached context (split-K), or
    over its last `sliding_window` positions (0/None: all; the splits cut the window).

    query `[>= R, H, D]` (row r is request r's only query, at position seq_lens[r] - 1);
    seq_lens `[R]` int32; block_table `[>= R, max_blocks]` int32. `max_seq_len` (a host int,
    an upper bound is fine) only picks `num_splits` when it is not given; results do not
    depend on it. Requests with seq_len 0 produce zeros. Allocations depend only on R, H, D
    and num_splits, so the call can be captured in a CUDA graph. `block_n`, `num_warps`,
    `num_stages`, `heads_first` (program order) and `max_registers` (a register cap a thread,
    0: none; ptxas's `maxnreg`) are tuning knobs; left unset, the config
    `tune_decode_attention` picked for this shape is used, else the default. `k_scale` /
    `v_scale`: an FP8 cache's scales.

    With more than one split the partitions are merged by the last program of each
    (request, KV head) to finish (`merge_last`; None: `decode_merge_setting()`), counted on a
    lock buffer that is all zeros between calls (`_merge_locks`), or else by a second kernel.
    The in-kernel merge needs a lock buffer made outside any CUDA graph capture; a capture
    that finds none large enough takes the second kernel.
    """
    num_heads, num_kv_heads, head_size, block_size = check_common(
        query, kv_cache, seq_lens, block_table
    )
    check_kv_scales(kv_cache, k_scale, v_scale)
    num_reqs = seq_lens.shape[0]
    assert query.shape[0] >= num_reqs, (query.shape, num_reqs)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.stride(-1) == 1 and out.dtype == query.dtype
    if num_reqs == 0:
        return out
    window = window_arg(sliding_window)
    if num_splits is None:
        span = min(max_seq_len, window) if window else max_seq_len
        num_splits = decode_num_splits(num_reqs, num_kv_heads, span, _num_sms(query.device))
    # The merge kernel reads MAX_NUM_SPLITS partials per row: more would be dropped silently.
    assert 1 <= num_splits <= MAX_NUM_SPLITS, (num_splits, MAX_NUM_SPLITS)

    qpk = num_heads // num_kv_heads
    block_h = max(triton.next_power_of_2(qpk), 16)
    block_d = triton.next_power_of_2(head_size)
    tuned = _decode_configs.get(shape_key(num_heads, kv_cache))
    if tuned is not None:
        block_n = tuned[0] if block_n is None else block_n
        num_warps = tuned[1] if num_warps is None else num_warps
        num_stages = tuned[2] if num_stages is None else num_stages
        heads_first = tuned[3] if heads_first is None else heads_first
        max_registers = tuned[4] if max_registers is None else max_registers
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    num_warps = 4 if num_warps is None else num_warps
    num_stages = 3 if num_stages is None else num_stages
    heads_first = False if heads_first is None else heads_first
    # Only a set cap is passed: Triton keys its compiled kernels on the options given.
    cap = {"maxnreg": max_registers} if max_registers else {}
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (num_reqs, num_heads, num_splits, head_size), dtype=torch.float32, device=query.device
        )
        part_m = torch.empty(
            (num_reqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused
    if merge_last is None:
        merge_last = decode_merge_setting()
    locks = _merge_locks(query.device, num_reqs * num_kv_heads) if split and merge_last else None
    merge_last = locks is not None
    grid = (num_kv_heads, num_reqs) if heads_first else (num_reqs, num_kv_heads)
    # An FP8 cache on CUDA sm_89+ is read in fp16 (`widen_kv`); the interpreter has no
    # inline assembly and keeps the query's dtype.
    fp16_dot = (
        kv_cache.dtype == FP8_KV_DTYPE
        and query.dtype in (torch.bfloat16, torch.float16)
        and _converts_fp8_in_hardware(query.device)
    )
    use_pdl = pdl_launch(query.device)
    _decode_kernel[(*grid, num_splits)](
        query,
        kv_cache,
        seq_lens,
        block_table,
        out,
        part_out,
        part_m,
        part_l,
        seq_lens if locks is None else locks,  # unused without the in-kernel merge
        scale * k_scale * _LOG2E,
        v_scale,
        num_splits,
        num_heads,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        QPK=qpk,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        SPLIT=split,
        INPUT_PRECISION=input_precision(query.dtype),
        HEADS_FIRST=heads_first,
        SCALE_V=v_scale != 1.0,
        SLIDING=window > 0,
        FP16_DOT=fp16_dot,
        USE_PDL=use_pdl,
        MERGE_LAST=merge_last,
        QPK_P2=triton.next_power_of_2(qpk),
        num_warps=num_warps,
        num_stages=num_stages,
        **cap,
        **launch_options(use_pdl),
    )
    if split and not merge_last:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            part_out,
            part_m,
            part_l,
            out,
            num_splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_SIZE=head_size,
            # One variant for every split count (no compile when a new count appears).
            BLOCK_S=triton.next_power_of_2(MAX_NUM_SPLITS),
            BLOCK_D=block_d,
            USE_PDL=use_pdl,
            num_warps=4,
            **launch_options(use_pdl),
        )
    return out


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One entry for both paths: decode when `max_query_len == 1` (then every request must
    have exactly one query row), else prefill/mixed."""
    scales = {"k_scale": k_scale, "v_scale": v_scale, "sliding_window": sliding_window}
    if max_query_len == 1:
        return paged_decode_attention(
            query,
            kv_cache,
            seq_lens,
            block_table,
            scale,
            max_seq_len=max_seq_len,
            out=out,
            **scales,
        )
    return paged_prefill_attention(
        query, kv_cache, query_start_loc, seq_lens, block_table, scale, out=out, **scales
    )


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference (fp32 math, one request at a time; reads device values). An FP8
    cache is dequantized (`x_fp8 * scale`) before the math. With `sliding_window` W, row at
    position p sees keys p - W < k <= p, and positions left of every row's window are not
    read."""
    out = torch.zeros_like(query)
    num_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_lo, q_hi = starts[r], starts[r + 1]
        q_len = q_hi - q_lo
        if q_len == 0 or seq_len == 0:
            continue
        lo = max(seq_len - q_len - sliding_window + 1, 0) if sliding_window else 0
        pos = torch.arange(lo, seq_len, device=query.device)
        blocks = block_table[r, pos // block_size].long()
        offs = pos % block_size
        k = kv_cache[blocks, 0, offs].float() * k_scale
        v = kv_cache[blocks, 1, offs].float() * v_scale
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[q_lo:q_hi].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        allowed = pos[None, :] <= q_pos[:, None]
        if sliding_window:
            allowed &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
