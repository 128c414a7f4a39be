"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms per head) and, in its sparse
layers, a mixture of experts in place of the MLP.

    mlp = SparseMoeBlock: gate [E, H] -> softmax -> top `num_experts_per_tok`
          (renormalised when `norm_topk_prob`) -> experts of `moe_intermediate_size`

A layer is sparse when it is not in `mlp_only_layers` and `(index + 1) % decoder_sparse_step
== 0`; the others keep a dense MLP of `intermediate_size`. No shared experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tandem.layers.moe import SparseMoeBlock
from tandem.models.interface import ModelContext
from tandem.models.llama import LlamaMLP
from tandem.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape


class Qwen3MoeShape(Qwen3Shape):
    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        self.num_experts = int(hf_config.num_experts)
        self.top_k = int(hf_config.num_experts_per_tok)
        self.moe_intermediate_size = int(hf_config.moe_intermediate_size)
        self.norm_topk_prob = bool(getattr(hf_config, "norm_topk_prob", False))
        self.decoder_sparse_step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        self.mlp_only_layers = set(getattr(hf_config, "mlp_only_layers", None) or [])
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, num_experts {self.num_experts}]"
            )

    def is_sparse(self, layer_index: int) -> bool:
        return (
            layer_index not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (see the module docstring)."""

    shape_cls = Qwen3MoeShape

    @classmethod
    def make_mlp(cls, cfg: Any, ctx: ModelContext, layer_index: int, prefix: str) -> nn.Module:
        if not cfg.is_sparse(layer_index):
            return LlamaMLP(cfg, ctx, prefix)
        return SparseMoeBlock(
            cfg.num_experts,
            cfg.top_k,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            ctx,
            prefix,
        )
