"""The rotary embedding and the K/V cache write of one attention layer, in one kernel.

Decode at small batches is a chain of short kernels; this one does the work of two of them
(`tandem_kernels.rotary.rotary_embedding`, then `tandem_kernels.reshape_and_cache`) from the
fused QKV projection, one program per token row:

    qkv row t   [ q: H * D | k: Hkv * D | v: Hkv * D ]      (a view: only the last dim contiguous)
        q --rotate--> query[t]                               (new `[T, H, D]`)
        k --rotate--> key[t]                                 (new `[T, Hkv, D]`)
                      cache[slot_mapping[t]] K <- key[t], V <- v   (t < len(slot_mapping),
                                                                    slot >= 0)
    value = the v columns of qkv as `[T, Hkv, D]`            (a view, nothing copied)

Rows: every qkv row is rotated; only the first `slot_mapping.shape[0]` rows are written to the
cache (the attention backend passes `slot_mapping[:num_actual_tokens]`), and a negative slot
writes nothing: what the two kernels do. The math is theirs, through the same jit helpers
(`rotate_neox`, `store_cache_tile`): the rotation in fp32 rounded once to the IO dtype, K
written to the cache as rounded, an FP8 cache as `clamp(x / scale, -448, 448)` in e4m3. So the
query and key are those of `rotary_embedding(..., inplace=False)` and the cache those of
`reshape_and_cache` of the rotated key, to the bit.

The Triton attention backend runs it with `TANDEM_ROTARY_KV=fused` (`rotary_kv_setting`);
by default it runs the two kernels, the measured path, until a device A/B has timed this one
(scripts/gpu_session20.sh).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem_kernels.pdl import launch_options, pdl_launch, pdl_wait
from tandem_kernels.reshape_and_cache import (
    FP8_KV_DTYPE,
    reshape_and_cache_ref,
    store_cache_tile,
)
from tandem_kernels.rotary import rotary_embedding_ref, rotate_heads, rotate_neox


def rotary_kv_setting() -> bool:
    """TANDEM_ROTARY_KV: "fused", the rotary embedding and the K/V write in this module's one
    kernel; unset or "separate", the two kernels (the default: with the in-kernel decode
    merge, batch-1 FP8 decode with PDL took 3.56 ms against 3.55 without either on an H100,
    session 21)."""
    flag = os.environ.get("TANDEM_ROTARY_KV", "separate")
    if flag not in ("fused", "separate"):
        raise ValueError(f"TANDEM_ROTARY_KV={flag!r}: expected 'fused' or 'separate'")
    return flag == "fused"


@triton.jit
def _rotary_and_cache_kernel(
    positions_ptr,
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_qkv_tok,
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_cos,
    stride_sin,
    stride_c_block,
    stride_c_kv,
    stride_c_off,
    stride_c_head,
    num_heads,
    num_kv_heads,
    num_slots,
    k_scale,
    v_scale,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=dmask, other=0.0).to(tl.float32)
    row = qkv_ptr + tok * stride_qkv_tok
    k_row = row + num_heads * HEAD_SIZE
    v_row = k_row + num_kv_heads * HEAD_SIZE
    # Partial rotary: dims [2 * HALF, HEAD_SIZE) pass through unrotated.
    offs_r = 2 * HALF + tl.arange(0, BLOCK_REST)
    rmask = offs_r < HEAD_SIZE

    # Q: the rotary kernel's own per-token step, the projection's row as its source.
    rotate_heads(
        qkv_ptr, q_out_ptr, tok, stride_qkv_tok, HEAD_SIZE, stride_qo_tok, stride_qo_head,
        num_heads, c, s, HALF, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    if 2 * HALF < HEAD_SIZE:
        offs_h = tl.arange(0, BLOCK_H)
        q_rmask = (offs_h[:, None] < num_heads) & rmask[None, :]
        q_rest = tl.load(row + offs_h[:, None] * HEAD_SIZE + offs_r[None, :], mask=q_rmask)
        q_dst = q_out_ptr + tok * stride_qo_tok + offs_h[:, None] * stride_qo_head
        tl.store(q_dst + offs_r[None, :], q_rest, mask=q_rmask)

    offs_hkv = tl.arange(0, BLOCK_HKV)
    k_mask = (offs_hkv[:, None] < num_kv_heads) & dmask[None, :]
    k_src = k_row + offs_hkv[:, None] * HEAD_SIZE
    k1 = tl.load(k_src + offs_d[None, :], mask=k_mask, other=0.0)
    k2 = tl.load(k_src + HALF + offs_d[None, :], mask=k_mask, other=0.0)
    r1, r2 = rotate_neox(k1, k2, c, s)
    r1 = r1.to(k1.dtype)
    r2 = r2.to(k1.dtype)
    k_dst = k_out_ptr + tok * stride_ko_tok + offs_hkv[:, None] * stride_ko_head
    tl.store(k_dst + offs_d[None, :], r1, mask=k_mask)
    tl.store(k_dst + HALF + offs_d[None, :], r2, mask=k_mask)
    k_rmask = (offs_hkv[:, None] < num_kv_heads) & rmask[None, :]
    if 2 * HALF < HEAD_SIZE:
        k_rest = tl.load(k_src + offs_r[None, :], mask=k_rmask)
        tl.store(k_dst + offs_r[None, :], k_rest, mask=k_rmask)

    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=-1).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = cache_ptr + block * stride_c_block + off * stride_c_off
        dst += offs_hkv[:, None] * stride_c_head
        store_cache_tile(dst + offs_d[None, :], r1, k_mask, k_scale, FP8)
        store_cache_tile(dst + HALF + offs_d[None, :], r2, k_mask, k_scale, FP8)
        if 2 * HALF < HEAD_SIZE:
            store_cache_tile(dst + offs_r[None, :], k_rest, k_rmask, k_scale, FP8)
        offs_v = tl.arange(0, BLOCK_D)
        v_mask = (offs_hkv[:, None] < num_kv_heads) & (offs_v[None, :] < HEAD_SIZE)
        v = tl.load(v_row + offs_hkv[:, None] * HEAD_SIZE + offs_v[None, :], mask=v_mask)
        store_cache_tile(dst + stride_c_kv + offs_v[None, :], v, v_mask, v_scale, FP8)


def rotary_and_cache(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the Q and K of `qkv` `[T, (H + 2 Hkv) * D]` at `positions` `[T]` and write K and
    V into `kv_cache` `[num_blocks, 2, block_size, Hkv, D]` at `slot_mapping` `[<= T]` (see the
    module docstring). Returns `(query [T, H, D], key [T, Hkv, D], value [T, Hkv, D])`:
    query and key new tensors, value a view of `qkv`.

    `cos_cache`/`sin_cache`: `[max_pos, rotary_dim // 2]` as `rotary_embedding` takes them.
    An FP8 cache is written quantized with `k_scale` / `v_scale`, any other has the dtype of
    `qkv` and both scales 1.0. Allocates by shape only, no host sync: CUDA-graph capturable.
    """
    assert qkv.dim() == 2 and qkv.stride(-1) == 1, (qkv.shape, qkv.stride())
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    assert qkv.shape[1] == q_size + 2 * kv_size, (qkv.shape, num_heads, num_kv_heads, head_size)
    assert qkv.dtype in (torch.bfloat16, torch.float16, torch.float32), qkv.dtype
    assert positions.shape == (num_tokens,) and not positions.dtype.is_floating_point
    assert cos_cache.shape == sin_cache.shape and cos_cache.dim() == 2
    half = cos_cache.shape[1]
    assert 0 < 2 * half <= head_size, (cos_cache.shape, head_size)
    assert cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
    _, _, block_size, cache_kv_heads, cache_head_size = kv_cache.shape
    assert (cache_kv_heads, cache_head_size) == (num_kv_heads, head_size), kv_cache.shape
    assert kv_cache.stride(-1) == 1, kv_cache.stride()
    fp8 = kv_cache.dtype == FP8_KV_DTYPE
    assert fp8 or kv_cache.dtype == qkv.dtype, (qkv.dtype, kv_cache.dtype)
    assert fp8 or (k_scale == 1.0 and v_scale == 1.0), (k_scale, v_scale)
    assert slot_mapping.dim() == 1 and slot_mapping.dtype in (torch.int32, torch.int64)
    assert slot_mapping.shape[0] <= num_tokens, (slot_mapping.shape, num_tokens)
    assert qkv.device == kv_cache.device == slot_mapping.device == positions.device

    query = torch.empty(num_tokens, num_heads, head_size, dtype=qkv.dtype, device=qkv.device)
    key = torch.empty(num_tokens, num_kv_heads, head_size, dtype=qkv.dtype, device=qkv.device)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_size)
    if num_tokens == 0:
        return query, key, value
    rest = head_size - 2 * half
    use_pdl = pdl_launch(qkv.device)
    _rotary_and_cache_kernel[(num_tokens,)](
        positions,
        qkv,
        cos_cache,
        sin_cache,
        query,
        key,
        kv_cache,
        slot_mapping,
        qkv.stride(0),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_heads,
        num_kv_heads,
        slot_mapping.shape[0],
        k_scale,
        v_scale,
        HEAD_SIZE=head_size,
        HALF=half,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 1,
        BLOCK_D=triton.next_power_of_2(head_size),
        FP8=fp8,
        USE_PDL=use_pdl,
        num_warps=4,
        **launch_options(use_pdl),
    )
    return query, key, value


def rotary_and_cache_ref(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `rotary_and_cache`: `rotary_embedding_ref`, then
    `reshape_and_cache_ref` of the rotated key (in place on `kv_cache`)."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split(
        [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1
    )
    query = q.view(num_tokens, num_heads, head_size)
    key = k.view(num_tokens, num_kv_heads, head_size)
    value = v.view(num_tokens, num_kv_heads, head_size)
    query, key = rotary_embedding_ref(positions, query, key, cos_cache, sin_cache)
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    return query, key, value
