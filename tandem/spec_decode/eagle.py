"""EAGLE-1 heads for Llama-family targets: drafts from the target's own hidden states.

The head (Li et al., 2024) predicts the target's next hidden state from the current one and
the next token; the target's LM head turns it into a draft::

    entry at position p:   f = layers(fc([embed(t_{p+1}), h_p]))   (h_p: the target's state)
                           logits(t_{p+2}) = target.lm_head(f)
    draft step j:          f_j = layers(fc([embed(d_{j-1}), f_{j-1}])) at position p + j

`layers` is one Llama decoder layer (or more) whose first layer has no input norm, without a
final norm. Its KV cache follows the target's block ids (`model_proposer`, `input_shift` 1:
position p's entry reads token p + 1, so the head's computed positions are the target's).

The checkpoint is the head's folder in its Hugging Face layout: config.json (a LlamaConfig of
the head: `num_hidden_layers` 1) and safetensors (or pytorch_model.bin) named `fc.weight`
(`fc.bias` optional), `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`, and
optionally `embed_tokens.weight` / `lm_head.weight` (the head's own; else the target's are
shared). `random:eagle-llama-3.1-8b`
is a random head of the 8B's shape, for measuring its cost.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tandem.config import ConfigError
from tandem.layers.attention import AttentionMetadata
from tandem.layers.linear import ReplicatedLinear
from tandem.layers.rotary import RotaryEmbedding
from tandem.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tandem.models.interface import CausalLM, ModelContext
from tandem.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaShape
from tandem.models.utils import STACKED_PARAMS, load_checkpoint
from tandem.spec_decode.draft_model import check_draft_config
from tandem.spec_decode.model_proposer import CatchUpPass, ModelProposer
from tandem.spec_decode.proposer import TargetInfo
from tandem.spec_decode.proposer_graphs import ProposerGraphs
from tandem.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

# Checkpoint names the head may carry of its own (else the target's are used).
_OWN_EMBED, _OWN_HEAD = "embed_tokens.weight", "lm_head.weight"


class EagleLlamaHead(nn.Module):
    """The EAGLE-1 head (see the module docstring); parameter names are the checkpoint's."""

    def __init__(
        self,
        hf_config: Any,
        ctx: ModelContext,
        fc_bias: bool,
        own_embed: bool,
        own_lm_head: bool,
    ) -> None:
        super().__init__()
        cfg = LlamaShape(hf_config)
        if cfg.rotary_dim != cfg.head_size:
            raise ValueError("an EAGLE head with partial rotary is not supported")
        hidden = cfg.hidden_size
        self.hidden_size = hidden
        self.head_size = cfg.head_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, fc_bias, ctx, prefix="fc")
        rotary = RotaryEmbedding(
            cfg.head_size,
            cfg.max_position_embeddings,
            cfg.rope_parameters,
            ctx.device,
            ctx.max_model_len,
        )
        layers = []
        for i in range(cfg.num_layers):
            prefix = f"layers.{i}"
            layer = LlamaDecoderLayer(
                cfg,
                ctx,
                LlamaAttention(cfg, ctx, rotary, f"{prefix}.self_attn"),
                LlamaMLP(cfg, ctx, f"{prefix}.mlp"),
            )
            if i == 0:
                layer.input_layernorm = nn.Identity()  # EAGLE-1: none before the first layer
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        attn = self.layers[0].self_attn.attn
        self.num_kv_heads = attn.num_kv_heads
        self.embed_tokens: nn.Module | None = None
        if own_embed:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden, ctx, "embed_tokens")
        self.lm_head: nn.Module | None = None
        if own_lm_head:
            self.lm_head = ParallelLMHead(cfg.vocab_size, hidden, ctx, prefix="lm_head")

    def forward(
        self,
        embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`[T, hidden]`: the predicted next hidden states of the T entries."""
        x = self.fc(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
        assert residual is not None
        return x + residual

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_checkpoint(self, weights, STACKED_PARAMS)


class EagleProposer(ModelProposer):
    """k greedy draft steps of an EAGLE head fed the target's hidden states."""

    needs_hidden_states = True
    input_shift = 1

    def __init__(self, head: EagleLlamaHead, hf_config: Any, target: TargetInfo) -> None:
        super().__init__(
            target.config.speculative.num_speculative_tokens,
            target.model_context.device,
            target.kv_dtype,
            target.config.cache.block_size,
            target.config.scheduler.max_num_seqs,
            int(hf_config.max_position_embeddings),
            len(head.layers),
            head.num_kv_heads,
            head.head_size,
        )
        self.disable_by_batch_size = target.config.speculative.disable_by_batch_size
        self.head: EagleLlamaHead | None = head
        self.target: CausalLM | None = target.model
        own = head.embed_tokens
        self.embed_tokens: nn.Module | None = own if own is not None else target_embedding(target)
        # As the draft model's (tandem.spec_decode.proposer_graphs): the draft steps read the
        # previous step's states, the catch-up pass the target's, from static buffers.
        self.graphs = ProposerGraphs(target, self.max_num_seqs, self.block_size)
        dtype, hidden = target.model_context.dtype, head.hidden_size
        decode_rows = max(self.graphs.decode.sizes, default=0)
        self.graph_step = _EagleGraphStep(self, decode_rows, hidden, dtype)
        catch_up_rows = max(self.graphs.mixed.sizes, default=0)
        self.catch_up_step = _EagleGraphStep(self, catch_up_rows, hidden, dtype)
        self.num_graph_draft_steps = 0
        self.num_eager_draft_steps = 0

    @classmethod
    def build(cls, target: TargetInfo) -> EagleProposer:
        """Load the head named by `config.speculative.model` (see the module docstring)."""
        from tandem.loader import load_hf_config, resolve_model_path
        from tandem.loader.hf_folder import iterate_weights
        from tandem.models.presets import has_random_weights

        spec = target.config.speculative
        path = resolve_model_path(spec.model, target.config.model.cache_dir or None)
        hf_config = load_hf_config(path)
        check_draft_config(hf_config, target)
        hidden = int(hf_config.hidden_size)
        if target_embedding(target) is None or hidden != target.model.hidden_size:
            raise ConfigError(
                f"speculative_config: EAGLE head {spec.model!r} needs a Llama-family target "
                f"of its hidden size {hf_config.hidden_size} (the target's: "
                f"{target.model.hidden_size})"
            )
        ctx = dataclasses.replace(target.model_context, quant_config=None)
        if has_random_weights(Path(path)):
            weights = list(random_eagle_weights(hf_config, ctx.dtype, ctx.device, 0))
        elif any(Path(path).glob("*.safetensors")):
            weights = list(iterate_weights(path))
        else:  # EAGLE-1 heads are often published as pytorch_model.bin
            weights = [
                (name, tensor)
                for file in sorted(Path(path).glob("*.bin"))
                for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items()
            ]
        names = {name for name, _ in weights}
        if "fc.weight" not in names:
            raise ConfigError(
                f"speculative_config: {spec.model!r} is not an EAGLE head in the HF layout "
                "(no fc.weight)"
            )
        dropped = [n for n in names if n.startswith("layers.0.input_layernorm.")]
        if dropped:
            logger.info("EAGLE head: %s unused (EAGLE-1's first layer has no input norm)", dropped)
        head = EagleLlamaHead(
            hf_config,
            ctx,
            fc_bias="fc.bias" in names,
            own_embed=_OWN_EMBED in names,
            own_lm_head=_OWN_HEAD in names,
        )
        head.load_weights((n, t) for n, t in weights if n not in dropped)
        return cls(head.eval(), hf_config, target)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The cache (see `ModelProposer`), then the graphs captured on it."""
        super().initialize_kv_cache(num_blocks)
        assert self.head is not None
        self.graphs.capture(
            self.graph_step,
            self.catch_up_step,
            self.kv_caches,
            self.head.layers[0].self_attn.attn.num_heads,
            self.scratch_per_row,
            "EAGLE head",
        )

    def catch_up(self, catch_up: CatchUpPass, hidden_states: torch.Tensor | None) -> torch.Tensor:
        """The catch-up pass through the mixed-step graph of its token count (eager past the
        largest, or with more requests than its slots)."""
        assert hidden_states is not None
        step, total = self.catch_up_step, len(catch_up.input_ids)

        def fill(_: torch.Tensor, __: StepInputs) -> None:
            step.hidden_in[:total].copy_(hidden_states)

        out = self.graphs.catch_up(catch_up, fill)
        return super().catch_up(catch_up, hidden_states) if out is None else out

    def draft_step(
        self,
        table: np.ndarray,
        positions: np.ndarray,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A draft step through the decode graph of its batch size (eager past the largest):
        the head's states (a view of the graph's output, valid until its next replay) and
        the logits."""
        assert hidden_states is not None
        step, n = self.graph_step, len(positions)

        def fill(static_ids: torch.Tensor, _: StepInputs) -> None:
            static_ids[:n].copy_(input_ids)
            step.hidden_in[:n].copy_(hidden_states)

        replayed = self.graphs.draft_step(table, positions, fill)
        if replayed is None:
            self.num_eager_draft_steps += 1
            return super().draft_step(table, positions, input_ids, hidden_states)
        self.num_graph_draft_steps += 1
        size, logits = replayed
        return step.outputs[size][:n], logits

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.head is not None and self.embed_tokens is not None
        assert hidden_states is not None, "an EAGLE head reads the target's hidden states"
        embeds = self.embed_tokens(input_ids)
        return self.head(embeds, hidden_states, positions, self.kv_caches, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.head is not None and self.target is not None
        if self.head.lm_head is not None:
            return self.head.lm_head.compute_logits(hidden_states)
        return self.target.compute_logits(hidden_states)

    def shutdown(self) -> None:
        self.graphs.clear()
        self.graph_step.outputs.clear()
        self.catch_up_step.outputs.clear()
        super().shutdown()
        self.head = self.target = self.embed_tokens = None


class _EagleGraphStep:
    """The head as a graph runs a model (`DecodeStepModel`): over the step's token rows
    (one per request in a draft step; the catch-up's rows in a mixed-step graph), reading
    the states it follows from the static `hidden_in` (the previous draft step's, or the
    target's; rows past the step's are stale: padding); each captured size's output states
    are kept in `outputs` (graph memory, rewritten by every replay of that size)."""

    def __init__(
        self, proposer: EagleProposer, max_rows: int, hidden_size: int, dtype: torch.dtype
    ) -> None:
        self.proposer = proposer
        self.hidden_in = torch.zeros(max_rows, hidden_size, dtype=dtype, device=proposer.device)
        self.outputs: dict[int, torch.Tensor] = {}

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        out = self.proposer.forward(input_ids, positions, self.hidden_in[:n], attn_metadata)
        self.outputs[n] = out
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proposer.compute_logits(hidden_states)


def target_embedding(target: TargetInfo) -> nn.Module | None:
    """The target's token embedding (a Llama-family model's `model.embed_tokens`)."""
    return getattr(getattr(target.model, "model", None), "embed_tokens", None)


def random_eagle_weights(
    hf_config: Any, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights of an EAGLE head of `hf_config`'s shape under the HF layout's names
    (the decoder layers of `tandem.models.presets.random_weights`, and `fc`); the target's
    embedding and LM head are shared."""
    from tandem.models.presets import random_weights

    for name, tensor in random_weights(hf_config, dtype, device, seed):
        if not name.startswith("model.layers.") or name.startswith("model.layers.0.input_"):
            continue
        yield name[len("model.") :], tensor
    hidden = int(hf_config.hidden_size)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + 999_983)
    fc = torch.empty(hidden, 2 * hidden, dtype=torch.float32, device=device)
    yield "fc.weight", fc.normal_(0.0, 0.02, generator=gen).to(dtype)
