"""IBM Granite 3.x dense (`GraniteForCausalLM`): the Llama layout with four scales from the
config, each 1.0 for Llama:

    embed(ids) * embedding_multiplier
    softmax(q k^T * attention_multiplier) v            (instead of head_dim ** -0.5)
    residual + sublayer(x) * residual_multiplier       (after the attention and the MLP)
    lm_head(h) / logits_scaling

The residual scale multiplies each sublayer's output before the fused add-and-norm that
follows it, so the norms and their kernels are Llama's.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.layers.attention.backend import AttentionMetadata
from tandem.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaShape


class GraniteShape(LlamaShape):
    """Llama's fields and Granite's four scales."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        self.embedding_multiplier = float(getattr(hf_config, "embedding_multiplier", 1.0))
        self.attention_scale = float(getattr(hf_config, "attention_multiplier", 1.0))
        self.residual_multiplier = float(getattr(hf_config, "residual_multiplier", 1.0))
        self.logits_scaling = float(getattr(hf_config, "logits_scaling", 1.0))
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling must not be 0")


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with each sublayer's output scaled by `residual_multiplier` before it
    joins the residual stream."""

    def __init__(self, cfg: GraniteShape, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        out = getattr(self, self.mlp_name)(hidden_states)
        return out * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x dense (see the module docstring)."""

    shape_cls = GraniteShape
    layer_cls = GraniteDecoderLayer

    def __init__(self, hf_config: Any, ctx: Any) -> None:
        super().__init__(hf_config, ctx)
        self.logits_scaling = GraniteShape(hf_config).logits_scaling

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling
