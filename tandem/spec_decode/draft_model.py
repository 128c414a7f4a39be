"""The draft-model proposer: a small model of the target's vocabulary drafts k tokens greedily.

Any registered architecture works as the draft (e.g. a 1B Llama for an 8B, or a model
drafting for itself, the p = 1 upper bound). It is built with the target's `ModelContext`
(device, dtype, attention backend, TP group: a draft runs on the target's ranks with the
target's tensor parallel size) and keeps a KV cache of its own in step with the target's
(`tandem.spec_decode.model_proposer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tandem.config import ConfigError
from tandem.layers.attention import AttentionMetadata
from tandem.layers.quantization import resolve_quant_config
from tandem.models.interface import CausalLM
from tandem.spec_decode.model_proposer import ModelProposer
from tandem.spec_decode.proposer import TargetInfo


class DraftModelProposer(ModelProposer):
    """k greedy steps of a draft model per engine step (see the module docstring)."""

    def __init__(self, model: CausalLM, target: TargetInfo) -> None:
        start, end = model.layer_range
        super().__init__(
            target.config.speculative.num_speculative_tokens,
            target.model_context.device,
            target.kv_dtype,
            target.config.cache.block_size,
            target.config.scheduler.max_num_seqs,
            int(model.hf_config.max_position_embeddings),
            end - start,
            model.num_kv_heads,
            model.head_size,
        )
        self.disable_by_batch_size = target.config.speculative.disable_by_batch_size
        self.model: CausalLM | None = model

    @classmethod
    def build(cls, target: TargetInfo) -> DraftModelProposer:
        """Load the draft named by `config.speculative.model` (ConfigError for a draft the
        target's workers cannot run: another vocabulary, TP or a shorter context)."""
        from tandem.loader import build_model, load_hf_config, resolve_model_path

        spec = target.config.speculative
        path = resolve_model_path(spec.model, target.config.model.cache_dir or None)
        hf_config = load_hf_config(path)
        check_draft_config(hf_config, target)
        ctx = dataclasses.replace(
            target.model_context,
            quant_config=resolve_quant_config(
                target.config.quantization.quantization, hf_config, target.model_context.device
            ),
        )
        model = build_model(path, ctx, seed=target.config.model.seed, hf_config=hf_config)
        return cls(model, target)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.model is not None
        out = self.model(input_ids, positions, self.kv_caches, metadata)
        assert isinstance(out, torch.Tensor)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model.compute_logits(hidden_states)

    def shutdown(self) -> None:
        super().shutdown()
        self.model = None


def check_draft_config(hf_config: Any, target: TargetInfo) -> None:
    """ConfigError naming what keeps a draft (or EAGLE head) from drafting for the target."""
    spec = target.config.speculative
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    if vocab != target.vocab_size:
        raise ConfigError(
            f"speculative_config: the draft model {spec.model!r} has a vocabulary of "
            f"{vocab} tokens, the target's has {target.vocab_size}"
        )
    max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if max_pos < target.max_model_len:
        raise ConfigError(
            f"speculative_config: the draft model {spec.model!r} has max_position_embeddings "
            f"{max_pos}, shorter than the engine's max_model_len {target.max_model_len}"
        )
