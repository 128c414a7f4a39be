"""The router's choice of experts, as the families define it.

    probs = softmax(router_logits) in float32; (weights, ids) = top-k of probs;
    renormalize: weights /= sum(weights)   (Mixtral always; Qwen3-MoE with `norm_topk_prob`)

Renormalised top-k of the softmax equals the softmax over the top-k logits.
"""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights [T, k] float32, topk_ids [T, k] int32)` from `router_logits [T, E]`."""
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, num_experts {num_experts}]")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)
