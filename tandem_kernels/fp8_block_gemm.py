"""Weight-only FP8 GEMM with block scales: `y = x @ (W_fp8 * S)^T` for checkpoints stored with
`weight_block_size` (`[bn, bk]` tiles, one scale each).

The weight stays e4m3 in memory (half of bf16's bytes, what decode reads every step); each tile
is widened to the activations' dtype in registers (exact: every e4m3 value is a bf16) and its
products scaled after the dot, once per `bk` columns. Activations stay in the model's dtype
(W8A16).

Scale layout: `S` `[N, ceil(K / bk)]`, float32, one value per output row and K block (a
checkpoint's `[ceil(N / bn), ceil(K / bk)]` tile scale repeated over each tile's rows, as the
loader shards it). The reference: `fp8_block_gemm_ref`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        x = tl.load(
            x_rows + k0 + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_rows + k0 + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
        )
        # BLOCK_K divides the scale's bk: one scale per row over this tile.
        s = tl.load(s_rows + k0 // SCALE_BK, mask=n_mask, other=0.0)
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=INPUT_PRECISION)
        acc += part * s[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int
) -> torch.Tensor:
    """`x [M, K] @ (weight [N, K] e4m3 * scale)^T` in x's dtype; `scale` `[N, ceil(K/block_k)]`
    float32 (see the module docstring). Rows and columns contiguous; any M, N, K."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and scale.stride(1) == 1
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    m, k = x.shape
    n = weight.shape[0]
    assert scale.shape == (n, -(-k // block_k)), (scale.shape, n, k, block_k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    tile_k = min(block_k, 128)
    while block_k % tile_k or tile_k & (tile_k - 1):  # a power of two dividing bk
        tile_k //= 2
    tile_k = max(tile_k, 16)
    assert block_k % tile_k == 0, f"block_k {block_k} needs a power-of-two divisor >= 16"
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        x,
        weight,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        SCALE_BK=block_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=tile_k,
        # fp32 activations: exact products (tf32 would lose digits); ignored for 16-bit.
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4 if block_m * block_n <= 64 * 64 else 8,
        num_stages=3,
    )
    return out


def fp8_block_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int
) -> torch.Tensor:
    """Pure-torch reference: the weight dequantized to float32, then the product."""
    k = weight.shape[1]
    w = weight.to(torch.float32) * scale.repeat_interleave(block_k, 1)[:, :k]
    return F.linear(x.to(torch.float32), w).to(x.dtype)
