"""Mixture-of-experts in plain torch: the reference the fused Triton kernel (fused_moe.py) is
tested against, and the CPU path.

Each token `t` was routed to `top_k` experts `topk_ids[t]` with weights `topk_weights[t]`:

    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])
    expert_e(x) = (silu(x W1_e^T) * (x W3_e^T)) W2_e^T

with `w13[e] = [W1_e; W3_e]` (`[E, 2I, H]`, gate rows then up rows) and `w2[e] = W2_e`
(`[E, H, I]`). Ids >= E (another rank's experts) contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`[T, H]` in the input dtype (see the module docstring). Tokens are grouped by expert
    and each expert runs once on its rows; the weighted sum accumulates in float32.
    `w13_scale` `[E, 2I]` / `w2_scale` `[E, H]`: FP8 weights with a scale per expert and
    row; with `weight_block_size` `(bn, bk)`, `w13_scale` `[E, ceil(2I/bn), ceil(H/bk)]` /
    `w2_scale` `[E, ceil(H/bn), ceil(I/bk)]`: a scale per expert and tile. Either way the
    weights are dequantized to the input dtype first."""
    if w13_scale is not None and w2_scale is not None:
        dtype = hidden_states.dtype
        if weight_block_size is not None:
            w13 = dequantize_expert_blocks(w13, w13_scale, weight_block_size, dtype)
            w2 = dequantize_expert_blocks(w2, w2_scale, weight_block_size, dtype)
        else:
            w13 = dequantize_expert_rows(w13, w13_scale, dtype)
            w2 = dequantize_expert_rows(w2, w2_scale, dtype)
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, hidden_w = w13.shape
    assert hidden_w == hidden and w2.shape == (num_experts, hidden, two_inter // 2)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    top_k = topk_ids.shape[1]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(max=num_experts), minlength=num_experts + 1)
    inter = two_inter // 2
    start = 0
    for expert, count in enumerate(counts.tolist()[:num_experts]):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate_up = F.linear(hidden_states[tokens], w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[expert])
        weight = topk_weights.reshape(-1)[pairs].float().unsqueeze(1)
        out.index_add_(0, tokens, y.float() * weight)
    return out.to(hidden_states.dtype)


def dequantize_expert_rows(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """FP8 expert weights `[E, R, K]` with scales `[E, R]` back to `dtype` (the inverse of
    tandem_kernels.fp8's `quantize_expert_rows`; torch alone, as the CPU path needs)."""
    return (weight.float() * scale.unsqueeze(2)).to(dtype)


def dequantize_expert_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """FP8 expert weights `[E, R, K]` with block scales `[E, ceil(R/bn), ceil(K/bk)]` back to
    `dtype` (the inverse of tandem_kernels.fp8's `quantize_expert_blocks`; torch alone)."""
    num_experts, rows, cols = weight.shape
    bn, bk = block
    assert scale.shape == (num_experts, -(-rows // bn), -(-cols // bk)), (scale.shape, block)
    full = scale.repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]
    return (weight.float() * full).to(dtype)
