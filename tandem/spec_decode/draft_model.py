"""The draft-model proposer: a small model of the target's vocabulary drafts k tokens greedily.

Any registered architecture works as the draft (e.g. a 1B Llama for an 8B, or a model
drafting for itself, the p = 1 upper bound). It is built with the target's `ModelContext`
(device, dtype, attention backend, TP group: a draft runs on the target's ranks with the
target's tensor parallel size) and keeps a KV cache of its own in step with the target's
(`tandem.spec_decode.model_proposer`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from tandem.config import ConfigError
from tandem.layers.attention import AttentionMetadata
from tandem.layers.quantization import resolve_quant_config
from tandem.models.interface import CausalLM
from tandem.spec_decode.model_proposer import ModelProposer
from tandem.spec_decode.proposer import TargetInfo
from tandem.worker.cuda_graph import DecodeCudaGraphs
from tandem.worker.input_batch import StepInputs
from tandem.worker.mixed_graph import MixedCudaGraphs
from tandem.worker.staging import PinnedStaging

logger = logging.getLogger(__name__)


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
        # The draft steps (one token per request) as decode CUDA graphs, captured on the
        # draft's cache in `initialize_kv_cache` (CUDA, unless --enforce-eager).
        device_config = target.config.device
        backend = target.model_context.attn_backend
        self.attn_backend = backend
        self.max_model_len = target.max_model_len
        sizes = decode_graph_sizes(target)
        use_graphs = bool(sizes)
        self.graphs = DecodeCudaGraphs(sizes, self.max_num_seqs, self.device)
        # The catch-up pass as whole mixed-step graphs (cudagraph_mode full, a backend that
        # runs them): up to the step's token budget plus one token per request.
        full = use_graphs and device_config.cudagraph_mode == "full" and backend.full_graph_mixed
        max_tokens = target.config.scheduler.max_num_batched_tokens + self.max_num_seqs
        self.mixed_graphs = MixedCudaGraphs(
            device_config.piecewise_cuda_graph_sizes if full else (),
            max_tokens,
            self.max_num_seqs,
            self.device,
        )
        self.staging = PinnedStaging(self.device)

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
        """The cache (see `ModelProposer`), then the decode kernel tuned on it and the draft
        steps' graphs captured (their block tables reach into the scratch blocks)."""
        super().initialize_kv_cache(num_blocks)
        if not self.graphs.sizes and not self.mixed_graphs.sizes:
            return
        assert self.model is not None
        self.attn_backend.tune(
            self.kv_caches[0],
            num_heads=self.model.num_heads,
            max_num_reqs=self.max_num_seqs,
            max_seq_len=self.max_model_len,
        )
        reach = self.max_model_len + (self.scratch_per_row + 1) * self.block_size
        self.graphs.capture(self.model, self.kv_caches, reach, self.block_size)
        self.mixed_graphs.capture(self.model, self.kv_caches, reach, self.block_size)
        logger.info(
            "draft model: draft steps as CUDA graphs for sizes %s, catch-up passes for %s tokens",
            self.graphs.sizes,
            self.mixed_graphs.sizes,
        )

    def catch_up(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        table: np.ndarray,
        req_index: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        hidden_states: torch.Tensor | None,
    ) -> torch.Tensor:
        """The catch-up pass through the mixed-step graph of its token count (eager past the
        largest, or with more requests than its slots)."""
        total, num_reqs = len(input_ids), len(seq_lens)
        size = self.mixed_graphs.size_for(total, num_reqs)
        if size is None:
            return super().catch_up(
                input_ids, positions, table, req_index, query_start_loc, seq_lens, hidden_states
            )
        bs = self.block_size
        inp = StepInputs(
            num_reqs=num_reqs,
            total=total,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=table[req_index, positions // bs] * bs + positions % bs,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=table,
            max_query_len=int(np.diff(query_start_loc).max()),
            sampled_rows=[],
            states=[],
        )
        return self.mixed_graphs.replay(inp, size, self.staging, lambda ids, step: None)

    def draft_step(
        self,
        table: np.ndarray,
        positions: np.ndarray,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A draft step through the decode graph of its batch size (eager past the largest)."""
        n = len(positions)
        size = self.graphs.size_for(n)
        if size is None:
            return super().draft_step(table, positions, input_ids, hidden_states)
        bs = self.block_size
        slots = table[np.arange(n), positions // bs] * bs + positions % bs
        inp = StepInputs(
            num_reqs=n,
            total=n,
            input_ids=np.zeros(n, dtype=np.int64),
            positions=positions,
            slot_mapping=slots,
            query_start_loc=np.arange(n + 1),
            seq_lens=positions + 1,
            block_table=table,
            max_query_len=1,
            sampled_rows=[],
            states=[],
        )

        def fill(static_ids: torch.Tensor, _: StepInputs) -> None:
            static_ids[:n].copy_(input_ids)

        return None, self.graphs.replay(inp, size, self.staging, fill)

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
        self.mixed_graphs.clear()
        self.staging.clear()
        super().shutdown()
        self.model = None


def decode_graph_sizes(target: TargetInfo) -> tuple[int, ...]:
    """The batch sizes whose draft steps a proposer replays as decode CUDA graphs: the
    target's `cuda_graph_sizes` on CUDA, unless --enforce-eager or the attention backend runs
    no decode graphs (then none: every draft step is eager)."""
    device_config = target.config.device
    use_graphs = (
        target.model_context.device.type == "cuda"
        and not device_config.enforce_eager
        and target.model_context.attn_backend.decode_cuda_graphs
    )
    return tuple(device_config.cuda_graph_sizes) if use_graphs else ()


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
