"""Write a step's new K and V rows into the paged KV cache.

Cache layout per layer: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (index 0 of
dim 1 is K, 1 is V). It is usually a strided view into the all-layer tensor
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`, so only the innermost
dimension is assumed contiguous; every other stride is read from the tensor.

Token t goes to slot `slot_mapping[t]`: block `slot // block_size`, offset
`slot % block_size`. A negative slot (padded rows) writes nothing.

FP8 cache (`float8_e4m3fn`): each value is written as `x / scale` saturated to e4m3 (per-tensor
`k_scale`, `v_scale`; `x ~= x_fp8 * scale` when read), in this one kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.pdl import launch_options, pdl_launch, pdl_wait

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def store_cache_tile(dst, x, mask, scale, FP8: tl.constexpr):
    """Store a K or V tile `x` (the model's dtype) at cache pointers `dst`: as is, or for an
    FP8 cache `x / scale` saturated to e4m3. Every kernel that writes the cache stores
    through this one helper, so they all write the same bits."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_kv,
    stride_c_off,
    stride_c_head,
    num_kv_heads,
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_SIZE)
    src_k = key_ptr + tok.to(tl.int64) * stride_k_tok + offs_h[:, None] * stride_k_head
    src_v = value_ptr + tok.to(tl.int64) * stride_v_tok + offs_h[:, None] * stride_v_head
    k = tl.load(src_k + offs_d[None, :], mask=mask)
    v = tl.load(src_v + offs_d[None, :], mask=mask)
    dst = (
        cache_ptr
        + block * stride_c_block
        + off * stride_c_off
        + offs_h[:, None] * stride_c_head
        + offs_d[None, :]
    )
    store_cache_tile(dst, k, mask, k_scale, FP8)
    store_cache_tile(dst + stride_c_kv, v, mask, v_scale, FP8)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into `kv_cache` at `slot_mapping` `[T]` (in place).

    Rows of `key`/`value` past `slot_mapping.shape[0]` are ignored. Slots < 0 are skipped.
    An FP8 cache is written quantized with `k_scale` / `v_scale` (see the module docstring).
    """
    assert key.dim() == 3 and value.shape == key.shape, (key.shape, value.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    assert key.shape[0] >= num_tokens and key.shape[1:] == (num_kv_heads, head_size)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    fp8 = kv_cache.dtype == FP8_KV_DTYPE
    assert key.dtype == value.dtype and (fp8 or key.dtype == kv_cache.dtype), (
        key.dtype,
        value.dtype,
        kv_cache.dtype,
    )
    assert fp8 or (k_scale == 1.0 and v_scale == 1.0), (k_scale, v_scale)
    assert slot_mapping.dim() == 1 and slot_mapping.dtype in (torch.int32, torch.int64)
    assert key.device == kv_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    use_pdl = pdl_launch(key.device)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        k_scale,
        v_scale,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
        FP8=fp8,
        USE_PDL=use_pdl,
        num_warps=4,
        **launch_options(use_pdl),
    )


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Pure-torch reference of `reshape_and_cache` (in place on `kv_cache`)."""
    num_tokens = slot_mapping.shape[0]
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offs = slots // block_size, slots % block_size
    key, value = key[:num_tokens][keep], value[:num_tokens][keep]
    if kv_cache.dtype == FP8_KV_DTYPE:
        key = (key.float() / k_scale).clamp(-448.0, 448.0)
        value = (value.float() / v_scale).clamp(-448.0, 448.0)
    kv_cache[blocks, 0, offs] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offs] = value.to(kv_cache.dtype)
