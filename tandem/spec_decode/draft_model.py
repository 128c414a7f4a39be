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

import numpy as np
import torch

from tandem.config import ConfigError
from tandem.layers.attention import AttentionMetadata
from tandem.layers.quantization import resolve_quant_config
from tandem.models.interface import CausalLM
from tandem.spec_decode.model_proposer import CatchUpPass, ModelProposer
from tandem.spec_decode.proposer import TargetInfo
from tandem.spec_decode.proposer_graphs import ProposerGraphs
from tandem.worker.input_batch import StepInputs


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
        # The draft steps and the catch-up pass as CUDA graphs, captured on the draft's
        # cache in `initialize_kv_cache` (tandem.spec_decode.proposer_graphs).
        self.graphs = ProposerGraphs(target, self.max_num_seqs, self.block_size)

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

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The cache (see `ModelProposer`), then the graphs captured on it."""
        super().initialize_kv_cache(num_blocks)
        model = self.model
        assert model is not None
        self.graphs.capture(
            model, model, self.kv_caches, model.num_heads, self.scratch_per_row, "draft model"
        )

    def catch_up(self, catch_up: CatchUpPass, hidden_states: torch.Tensor | None) -> torch.Tensor:
        """The catch-up pass through the mixed-step graph of its token count (eager past the
        largest, or with more requests than its slots)."""
        out = self.graphs.catch_up(catch_up, lambda ids, step: None)
        return super().catch_up(catch_up, hidden_states) if out is None else out

    def draft_step(
        self,
        table: np.ndarray,
        positions: np.ndarray,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A draft step through the decode graph of its batch size (eager past the largest)."""
        n = len(positions)

        def fill(static_ids: torch.Tensor, _: StepInputs) -> None:
            static_ids[:n].copy_(input_ids)

        replayed = self.graphs.draft_step(table, positions, fill)
        if replayed is None:
            return super().draft_step(table, positions, input_ids, hidden_states)
        return None, replayed[1]

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
        self.graphs.clear()
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
