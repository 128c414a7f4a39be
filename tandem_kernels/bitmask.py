"""Grammar bitmasks on logits (structured outputs): one pass, in place, on CUDA.

`apply_token_bitmask_(logits, bitmask, rows)` sets `logits[rows[i], t]` to -inf wherever bit
`t % 32` of `bitmask[i, t // 32]` is clear, for t below the logits' width; rows not named are
untouched. The reference is `tandem.layers.sampler_bitmask.apply_token_bitmask` (a new
tensor; this one writes in place: callers pass their own copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab_size,
    stride_logits,
    stride_bitmask,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < vocab_size
    row = tl.load(rows_ptr + i).to(tl.int64)
    words = tl.load(bitmask_ptr + i * stride_bitmask + offs // 32, mask=valid, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    ptr = logits_ptr + row * stride_logits + offs
    tl.store(
        ptr,
        tl.full([BLOCK], float("-inf"), tl.float32).to(ptr.dtype.element_ty),
        mask=valid & banned,
    )


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Mask `logits` in place (see the module docstring); returns `logits`."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or logits.dim() != 2:
        raise ValueError("logits must be [B, V] and bitmask a [K, W] int32 tensor")
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover {vocab} tokens")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    k = bitmask.shape[0]
    if rows is None:
        if k != logits.shape[0]:
            raise ValueError("a bitmask without rows needs one row per logits row")
        rows = torch.arange(k, device=logits.device, dtype=torch.int64)
    if k == 0:
        return logits
    grid = (k, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](
        logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK
    )
    return logits
