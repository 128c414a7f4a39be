"""Mixtral (`MixtralForCausalLM`): Mistral's attention and, in every layer, a mixture of
experts under the checkpoint name `block_sparse_moe`.

    block_sparse_moe: gate [E, H] -> softmax -> top `num_experts_per_tok` -> renormalised
                      -> experts `experts.{i}.w1` (gate), `w3` (up), `w2` (down)
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from tandem.layers.moe import SparseMoeBlock
from tandem.models.interface import ModelContext
from tandem.models.llama import LlamaForCausalLM, LlamaShape


class MixtralShape(LlamaShape):
    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config)
        self.num_experts = int(hf_config.num_local_experts)
        self.top_k = int(hf_config.num_experts_per_tok)
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, num_local_experts "
                f"{self.num_experts}]"
            )


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral (see the module docstring)."""

    shape_cls = MixtralShape
    mlp_name: ClassVar[str] = "block_sparse_moe"

    @classmethod
    def make_mlp(cls, cfg: Any, ctx: ModelContext, layer_index: int, prefix: str) -> nn.Module:
        return SparseMoeBlock(
            cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, True, ctx, prefix
        )
