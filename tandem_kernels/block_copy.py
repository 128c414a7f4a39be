"""Copy whole KV cache blocks between two caches, in any block order, in one launch.

Both caches are `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]` and
contiguous, so block b is the span `[b * block_numel, (b + 1) * block_numel)` of its cache.
`block_mapping` `[num_pairs, 2]` lists (source block, destination block) pairs::

    block_mapping  [[ 7, 20], [ 3, 30], [12, 5]]
    src  |..|..|..| 3|..|..|..| 7|..|..|..|..|12|        grid (pair, chunk): program (p, c)
    dst  |..|..|..|..|..|12|..|..| ... |20| ... |30|     moves words [c * CHUNK, (c + 1) *
                                                          CHUNK) of pair p's block

The bytes move as 8-byte words where the block's size allows (4, 2 or 1 otherwise): with the
block start 16-byte aligned, each thread loads and stores 16-byte vectors. A program moves
`chunk_bytes` (32 KiB by default) with 8 warps; its only 64-bit arithmetic is two scalar block
offsets, the per-element offsets are 32-bit. The destination may be a tensor opened from a CUDA
IPC handle (same device, another process's allocation). Block ids are not range-checked on the
device: the caller checks them on the host. Destination blocks must be distinct.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes per program by default.
CHUNK_BYTES = 32 * 1024


@triton.jit
def _block_copy_kernel(
    src_ptr,
    dst_ptr,
    block_mapping_ptr,
    words_per_block,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
):
    pair = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * CHUNK
    src_block = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    src = src_ptr + (src_block * words_per_block + start)
    dst = dst_ptr + (dst_block * words_per_block + start)
    offs = tl.arange(0, CHUNK)
    if EVEN:
        tl.store(dst + offs, tl.load(src + offs, cache_modifier=".cg"), cache_modifier=".cs")
    else:
        mask = offs < words_per_block - start
        words = tl.load(src + offs, mask=mask, cache_modifier=".cg")
        tl.store(dst + offs, words, mask=mask, cache_modifier=".cs")


def block_words(cache: torch.Tensor) -> torch.Tensor:
    """`cache` as `[num_blocks, words]` in the widest integer word (8, 4, 2 or 1 bytes) that
    divides a block's bytes and the data pointer. `cache` must be contiguous."""
    assert cache.is_contiguous(), "a KV cache for block copies must be contiguous"
    flat = cache.view(cache.shape[0], -1)
    row_bytes = flat.shape[1] * flat.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and cache.data_ptr() % size == 0:
            return flat.view(torch.uint8).view(dtype)
    return flat.view(torch.uint8)


def common_words(
    src_words: torch.Tensor, dst_words: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `block_words` views in one word: as they are when their words agree, else bytes on
    both sides (differently aligned data pointers)."""
    if src_words.dtype != dst_words.dtype:
        return src_words.view(torch.uint8), dst_words.view(torch.uint8)
    return src_words, dst_words


def _check(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    assert src_cache.dim() == 6 and src_cache.shape[2] == 2, src_cache.shape
    assert dst_cache.shape[1:] == src_cache.shape[1:], (src_cache.shape, dst_cache.shape)
    assert src_cache.dtype == dst_cache.dtype, (src_cache.dtype, dst_cache.dtype)
    assert src_cache.is_contiguous() and dst_cache.is_contiguous()
    _check_mapping(src_cache, dst_cache, block_mapping)


def _check_mapping(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    assert src.device == dst.device == block_mapping.device, (
        src.device,
        dst.device,
        block_mapping.device,
    )
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2, block_mapping.shape
    assert block_mapping.dtype in (torch.int32, torch.int64), block_mapping.dtype
    assert block_mapping.is_contiguous()


def copy_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """`dst_cache[d] = src_cache[s]` for every row (s, d) of `block_mapping`, in one launch on
    the current stream. Both caches `[num_blocks, num_layers, 2, block_size, num_kv_heads,
    head_size]`, contiguous, same dtype and device; `block_mapping` `[num_pairs, 2]` int32 or
    int64 on that device, ids in range, destination ids distinct."""
    _check(src_cache, dst_cache, block_mapping)
    src_words, dst_words = common_words(block_words(src_cache), block_words(dst_cache))
    copy_block_rows(src_words, dst_words, block_mapping, chunk_bytes)


def copy_block_rows(
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    block_mapping: torch.Tensor,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """`copy_blocks` on caches already viewed as `[num_blocks, words]` rows of one integer
    dtype (`block_words`), for callers that keep those views (fewer host-side checks per
    launch). Rows contiguous, same width, dtype and device."""
    assert src_rows.dim() == 2 and dst_rows.shape[1:] == src_rows.shape[1:], (
        src_rows.shape,
        dst_rows.shape,
    )
    assert src_rows.dtype == dst_rows.dtype and not src_rows.dtype.is_floating_point
    assert src_rows.is_contiguous() and dst_rows.is_contiguous()
    _check_mapping(src_rows, dst_rows, block_mapping)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    words_per_block = src_rows.shape[1]
    chunk = _chunk_words(words_per_block, src_rows.element_size(), chunk_bytes)
    num_chunks = triton.cdiv(words_per_block, chunk)
    assert num_chunks < 65536, "a block this large needs a larger chunk"
    _block_copy_kernel[(num_pairs, num_chunks)](
        src_rows,
        dst_rows,
        block_mapping,
        words_per_block,
        CHUNK=chunk,
        EVEN=words_per_block % chunk == 0,
        num_warps=8 if chunk >= 2048 else 4,
    )


def _chunk_words(words_per_block: int, word_bytes: int, chunk_bytes: int) -> int:
    """Words per program: a power of two, `chunk_bytes` at most, no more than the block."""
    assert chunk_bytes >= word_bytes and chunk_bytes & (chunk_bytes - 1) == 0, chunk_bytes
    return min(chunk_bytes // word_bytes, triton.next_power_of_2(words_per_block))


def copy_blocks_ref(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Pure-torch reference of `copy_blocks` (in place on `dst_cache`)."""
    _check(src_cache, dst_cache, block_mapping)
    copy_block_rows_ref(src_cache, dst_cache, block_mapping)


def copy_block_rows_ref(
    src_rows: torch.Tensor, dst_rows: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Pure-torch reference of `copy_block_rows` (any tensors whose dim 0 is the block)."""
    if block_mapping.shape[0] == 0:
        return
    ids = block_mapping.long()
    dst_rows.index_copy_(0, ids[:, 1], src_rows.index_select(0, ids[:, 0]))
