"""Mixture-of-experts layers: the router's top-k (router.py) and the experts (layer.py)."""

from tandem.layers.moe.layer import FusedMoE, SparseMoeBlock, take_expert_load
from tandem.layers.moe.router import select_experts

__all__ = ["FusedMoE", "SparseMoeBlock", "select_experts", "take_expert_load"]
