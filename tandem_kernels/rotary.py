"""Rotary position embedding, neox style (rotate halves, as the Hugging Face Llama does).

For a head vector x and rotary_dim = 2 * half, with c = cos[pos], s = sin[pos] (`[half]`):
    out[:half]       = x[:half] * c - x[half:rotary_dim] * s
    out[half:rot]    = x[half:rotary_dim] * c + x[:half] * s
    out[rotary_dim:] = x[rotary_dim:]          (partial rotary; usually rotary_dim == head_size)
Math in fp32, one rounding to the IO dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.pdl import launch_options, pdl_launch, pdl_wait


@triton.jit
def rotate_neox(x1, x2, c, s):
    """One rotation of halves `x1`, `x2` (`[heads, half]`, any float dtype) by `c`, `s`
    (`[half]` fp32), in fp32: `(x1 c - x2 s, x2 c + x1 s)`. Every rotary kernel here calls
    this one helper, so they all round alike."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * c[None, :] - x2f * s[None, :]
    o2 = x2f * c[None, :] + x1f * s[None, :]
    return o1, o2


@triton.jit
def rotate_heads(
    src_ptr,
    dst_ptr,
    tok,
    stride_src_tok,
    stride_src_head,
    stride_dst_tok,
    stride_dst_head,
    num_heads,
    c,
    s,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Token `tok`'s `num_heads` heads rotated from `src_ptr` to `dst_ptr` (the rotary dims
    only; the rest is the caller's). Both rotary kernels' one step over Q (and this module's
    over K)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    src = src_ptr + tok * stride_src_tok + offs_h[:, None] * stride_src_head + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    o1, o2 = rotate_neox(x1, x2, c, s)
    dst = dst_ptr + tok * stride_dst_tok + offs_h[:, None] * stride_dst_head + offs_d[None, :]
    tl.store(dst, o1.to(x1.dtype), mask=mask)
    tl.store(dst + HALF, o2.to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_cos,
    stride_sin,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=dmask, other=0.0).to(tl.float32)
    rotate_heads(
        q_ptr,
        q_out_ptr,
        tok,
        stride_q_tok,
        stride_q_head,
        stride_qo_tok,
        stride_qo_head,
        num_heads,
        c,
        s,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    rotate_heads(
        k_ptr,
        k_out_ptr,
        tok,
        stride_k_tok,
        stride_k_head,
        stride_ko_tok,
        stride_ko_head,
        num_kv_heads,
        c,
        s,
        HALF,
        BLOCK_HKV,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` `[T, H, D]` and `key` `[T, Hkv, D]` at `positions` `[T]`.

    `cos_cache`/`sin_cache`: `[max_pos, rotary_dim // 2]` (fp32 recommended). With
    `inplace=True` the inputs are overwritten and returned; otherwise new tensors are returned.
    """
    assert query.dim() == 3 and key.dim() == 3, (query.shape, key.shape)
    num_tokens, num_heads, head_size = query.shape
    assert key.shape[0] == num_tokens and key.shape[2] == head_size, (query.shape, key.shape)
    assert positions.shape == (num_tokens,) and not positions.dtype.is_floating_point
    assert cos_cache.shape == sin_cache.shape and cos_cache.dim() == 2
    half = cos_cache.shape[1]
    assert 2 * half <= head_size, (cos_cache.shape, head_size)
    assert cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    assert query.stride(-1) == 1 and key.stride(-1) == 1
    assert query.dtype == key.dtype and query.dtype in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
    )
    if inplace:
        q_out, k_out = query, key
    elif 2 * half == head_size:
        q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    else:
        q_out, k_out = query.clone(), key.clone()
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = key.shape[1]
    use_pdl = pdl_launch(query.device)
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        q_out,
        k_out,
        cos_cache,
        sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        USE_PDL=use_pdl,
        num_warps=4,
        **launch_options(use_pdl),
    )
    return q_out, k_out


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `rotary_embedding` (out of place)."""
    half = cos_cache.shape[1]
    c = cos_cache[positions].float()[:, None, :]
    s = sin_cache[positions].float()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)

    return rotate(query), rotate(key)
