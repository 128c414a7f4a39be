"""Qwen3 dense (`Qwen3ForCausalLM`): the Llama layout with an RMSNorm over each head's Q and K
(`q_norm`, `k_norm`, one weight of `head_dim` shared by the heads) between the projection and
the rotary embedding, and no Q/K/V bias unless `attention_bias`.

    qkv_proj -> split -> q_norm(q), k_norm(k) per head -> rotary -> attention -> o_proj
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.layers.attention.backend import AttentionMetadata
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.interface import ModelContext
from tandem.models.llama import LlamaAttention, LlamaForCausalLM, LlamaShape


class Qwen3Shape(LlamaShape):
    """Qwen3's config: bias only with `attention_bias` (on Q/K/V/O, as in transformers); no
    sliding-window layers."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        self.qkv_bias = self.o_bias = bool(getattr(hf_config, "attention_bias", False))
        self.mlp_bias = False
        window = getattr(hf_config, "sliding_window", None)
        if getattr(hf_config, "use_sliding_window", False) and window:
            raise ValueError(
                f"use_sliding_window (sliding_window {window}) is not supported: tandem's "
                "attention spans the whole context"
            )


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, cfg: LlamaShape, ctx: ModelContext, rotary_emb: RotaryEmbedding, prefix: str
    ) -> None:
        super().__init__(cfg, ctx, rotary_emb, prefix)
        eps, head = cfg.rms_norm_eps, cfg.head_size
        self.q_norm = RMSNorm(head, eps, ctx.dtype, ctx.device, ctx.cpu_kernels)
        self.k_norm = RMSNorm(head, eps, ctx.dtype, ctx.device, ctx.cpu_kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.attn.split_qkv(self.qkv_proj(hidden_states))
        q = self._head_norm(self.q_norm, q)
        k = self._head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))

    @staticmethod
    def _head_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head `[T, H, D]` over D (as `[T * H, D]` rows)."""
        num_tokens, heads, head = x.shape
        return norm(x.reshape(num_tokens * heads, head)).view(num_tokens, heads, head)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense (see the module docstring)."""

    shape_cls = Qwen3Shape

    @classmethod
    def make_attention(
        cls, cfg: Any, ctx: ModelContext, rotary_emb: RotaryEmbedding, prefix: str
    ) -> nn.Module:
        return Qwen3Attention(cfg, ctx, rotary_emb, prefix)
