"""Split-K for the small-batch GEMMs (tandem_kernels.fp8_w8a16, tandem_kernels.int_w4a16):
the K slices of one output tile summed in the launch that computes them, without atomics on
the output and without zeroing anything per call ("last program reduces").

The grid is `[N / BLOCK_N, M / BLOCK_M, SPLIT_K]`; program `k` sums its slice of K
(`k_slice`: whole BLOCK_K chunks, shared out evenly), then `store_tile`:

    every program      stores its partial sum [BLOCK_M, BLOCK_N] in fp32 to
                       workspace[k]  (per call, uninitialised, SPLIT_K x M x N)
                       barrier; then one thread: arrived = atomic_add(lock[tile], 1)
                       (acq_rel, gpu scope: the partial is visible before the count is)
    arrived == SPLIT_K - 1 (the last of the tile's programs):
                       sums workspace[0..SPLIT_K) in order (L2 loads), scales, stores the
                       output tile, and sets lock[tile] back to 0

Invariant: `locks` (int32, one per output tile) is all zeros between calls, so a lock buffer
made once (by the layer after loading, outside any CUDA graph) serves every call and every
graph replay on its stream. The sum over slices is in a fixed order, so results do not depend
on which program came last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def split_k_buffers(
    out: torch.Tensor, split_k: int, tiles: int, locks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(workspace, locks)` for a launch of `split_k` slices over `tiles` output tiles writing
    `out` `[M, N]`: an uninitialised fp32 workspace `[split_k, M, N]` and `locks` (a zeroed
    buffer made per call when None: one more memset). SPLIT_K 1: `out` twice (unused)."""
    if split_k == 1:
        return out, out
    m, n = out.shape
    workspace = torch.empty((split_k, m, n), dtype=torch.float32, device=out.device)
    if locks is None:
        locks = torch.zeros(tiles, dtype=torch.int32, device=out.device)
    assert locks.dtype == torch.int32 and locks.numel() >= tiles, (
        f"{locks.numel()} locks for {tiles} tiles"
    )
    return workspace, locks


@triton.jit
def k_slice(K, pid_k, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """`[k_begin, k_end)` of slice `pid_k`: whole BLOCK_K chunks, shared out evenly (a slice
    may be empty when there are fewer chunks than slices)."""
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * per_split
    return k_begin, tl.minimum(k_begin + per_split, K)


@triton.jit
def store_tile(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    s_ptr,
    stride_s,
    out_ptr,
    stride_om,
    ws_ptr,
    locks_ptr,
    tile,
    pid_k,
    SPLIT_K: tl.constexpr,
    SCALED: tl.constexpr = True,
):
    """Scale (SCALED: by `s_ptr[n * stride_s]`, fp32, stride 0 for one scale; else `s_ptr` is
    not read) and store the output tile `acc` (fp32); with SPLIT_K > 1, through the workspace
    and the last program of the tile (module docstring)."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        out = _scaled(acc, s_ptr, stride_s, offs_n, n_mask, SCALED)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        slice_stride = M.to(tl.int64) * N
        tl.store(ws + pid_k * slice_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the one thread's release
        arrived = tl.atomic_add(locks_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                part = tl.load(ws + s * slice_stride, mask=mask, other=0.0, cache_modifier=".cg")
                total += part
            out = _scaled(total, s_ptr, stride_s, offs_n, n_mask, SCALED)
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(locks_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _scaled(acc, s_ptr, stride_s, offs_n, n_mask, SCALED: tl.constexpr):
    """`acc` times its columns' scales (SCALED), else `acc` as it is."""
    if SCALED:
        scale = tl.load(s_ptr + offs_n * stride_s, mask=n_mask, other=0.0)
        acc = acc * scale[None, :]
    return acc
