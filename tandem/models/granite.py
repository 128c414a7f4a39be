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
    """Llama's layer with Granite's `residual_multiplier` (a class of its own, so the CPU
    decoder stack, which knows only the plain Llama layer, leaves it to the modules)."""

    def __init__(self, cfg: GraniteShape, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.residual_multiplier = cfg.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x dense (see the module docstring)."""

    shape_cls = GraniteShape
    layer_cls = GraniteDecoderLayer

    def __init__(self, hf_config: Any, ctx: Any) -> None:
        super().__init__(hf_config, ctx)
        self.logits_scaling = GraniteShape(hf_config).logits_scaling

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling
