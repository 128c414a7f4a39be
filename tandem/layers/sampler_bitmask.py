"""Grammar bitmasks applied to logits on the device (structured outputs).

A bitmask row is `ceil(V / 32)` int32 words; bit j of word w allows token `32 w + j`. A row's
disallowed tokens get -inf, so greedy and random sampling (and the reported logprobs) only
ever see the grammar's tokens. `apply_token_bitmask` is the torch reference (any device);
`tandem_kernels.bitmask` holds a Triton kernel for CUDA that gives the same result.
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[B, W]` int32 words -> `[B, vocab_size]` bool (True: allowed)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {bitmask.dim()}-D"
        )
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"a bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, "
            f"fewer than the logits' {vocab_size}"
        )
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        _SHIFTS[bitmask.device] = shifts
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits with the tokens each bitmask row disallows set to -inf (a new tensor).

    `bitmask[i]` applies to `logits[rows[i]]` (to `logits[i]` when `rows` is None); rows
    without a bitmask row are unchanged."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError("a bitmask without rows needs one row per logits row")
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[rows] = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return out
