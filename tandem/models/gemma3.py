"""Gemma 3 text (`Gemma3ForCausalLM`): interleaved sliding-window and global layers.

    input_ids -> embed * sqrt(hidden) -> N x layer -> norm -> LM head (tied) [-> softcap]

    layer:  x -> input_norm -> attention -> post_attention_norm -> + residual
              -> pre_feedforward_norm -> GELU-tanh MLP -> post_feedforward_norm -> + residual

What differs from Llama, each read from the config:

- every RMSNorm scales by `1 + weight` (the checkpoint stores the offset; the loader adds the
  one, so the model runs the common RMSNorm kernels);
- Q and K are RMS-normed per head (`q_norm`, `k_norm`) before the rotary embedding, and
  scores are scaled by `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`;
- `layer_types` (or `sliding_window_pattern`): "sliding_attention" layers attend to the last
  `sliding_window` positions and rotate with their own base (`rope_local_base_freq`, default
  rope); "full_attention" layers attend to everything and rotate with `rope_theta` and
  `rope_scaling` (transformers 5 keeps both under `rope_parameters[layer_type]`);
- `final_logit_softcapping` c: logits -> c * tanh(logits / c).

Refused by name (ConfigError): `attn_logit_softcapping` (Gemma 2's), bidirectional
attention, an unknown layer type, an activation other than GELU-tanh.

`Gemma3ForConditionalGeneration` (the multimodal checkpoints) runs its language model: the
text config is `text_config`, and the checkpoint's `language_model.` tensors are taken by
prefix; the vision tower and projector are skipped (image inputs are not supported).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tandem.config import ConfigError
from tandem.layers.activation import GeluTanhAndMul
from tandem.layers.attention.backend import AttentionMetadata
from tandem.layers.attention.layer import Attention
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import (
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    rope_parameters_from_config,
)
from tandem.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.weight_utils import LoadedWeight, full_weight
from tandem.models.interface import IntermediateTensors, ModelContext
from tandem.models.llama import LlamaShape
from tandem.models.utils import (
    STACKED_PARAMS,
    PPMissingLayer,
    load_checkpoint,
    make_layers,
    sliding_window_for_layer,
)

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_rope_parameters(hf_config: Any, layer_type: str) -> dict[str, Any]:
    """The rope of `layer_type` layers: transformers 5's `rope_parameters[layer_type]`, or
    (4.x configs, the checkpoints' own) `rope_local_base_freq` with default rope for sliding
    layers, `rope_theta` and `rope_scaling` for full ones."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        p = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        base = getattr(hf_config, "rope_local_base_freq", None) or 10000.0
        p = {"rope_type": "default", "rope_theta": float(base)}
    else:
        p = rope_parameters_from_config(hf_config)
    p["rope_type"] = p.get("rope_type", p.get("type", "default"))
    return p


class Gemma3Shape(LlamaShape):
    """Gemma 3's config fields, resolved once; raises ConfigError on what tandem cannot run."""

    def __init__(self, hf_config: Any) -> None:
        for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(hf_config, name, None):
                raise ConfigError(
                    f"{name}={getattr(hf_config, name)!r} is not supported for Gemma 3"
                )
        act = getattr(hf_config, "hidden_activation", None) or getattr(
            hf_config, "hidden_act", "gelu_pytorch_tanh"
        )
        if act not in GELU_TANH:
            raise ConfigError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        # LlamaShape reads the sizes and checks quantization and heads; its activation and
        # rope checks are Llama's, so it sees a SiLU, default-rope view of the config.
        super().__init__(_LlamaView(hf_config))
        self.qkv_bias = self.o_bias = bool(getattr(hf_config, "attention_bias", False))
        self.mlp_bias = False
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.query_pre_attn_scalar = float(
            getattr(hf_config, "query_pre_attn_scalar", None) or self.head_size
        )
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None
        self.sliding_windows = [
            sliding_window_for_layer(hf_config, i) for i in range(self.num_layers)
        ]
        self.rope = {kind: gemma_rope_parameters(hf_config, kind) for kind in LAYER_TYPES}
        for kind, params in self.rope.items():
            if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"rope type {params['rope_type']!r} of {kind} layers is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )


class _LlamaView:
    """`hf_config` as LlamaShape reads it: SiLU, default rope, no window (Gemma3Shape checks
    those itself)."""

    def __init__(self, hf_config: Any) -> None:
        self._config = hf_config

    def __getattr__(self, name: str) -> Any:
        if name == "hidden_act":
            return "silu"
        if name in ("rope_parameters", "rope_scaling", "sliding_window"):
            return None
        return getattr(self._config, name)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by `1 + w` for a checkpoint weight `w`: the loader stores `1 + w`, in
    float32 (transformers adds the one in float32: `1 + w` rounded to bf16 would move small
    offsets by up to 0.4%). On CUDA the RMSNorm kernel reads the float32 weight; on the CPU a
    16-bit model takes Gemma's own arithmetic (all in float32, one rounding at the end)."""

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext) -> None:
        super().__init__(hidden_size, eps, torch.float32, ctx.device, ctx.cpu_kernels)
        self.weight.weight_loader = self._load_offset  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda or x.dtype == self.weight.dtype:
            return super().forward(x, residual)
        if residual is not None:
            x = residual = (x.float() + residual.float()).to(x.dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (x32 * self.weight).to(x.dtype)
        return out if residual is None else (out, residual)

    def _load_offset(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        tensor = full_weight(loaded)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"norm weight: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
            )
        param.data.copy_(tensor.float() + 1.0)


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        cfg: Gemma3Shape,
        ctx: ModelContext,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.qkv_bias,
            ctx,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_size,
            cfg.hidden_size,
            cfg.o_bias,
            ctx,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = GemmaRMSNorm(cfg.head_size, cfg.rms_norm_eps, ctx)
        self.k_norm = GemmaRMSNorm(cfg.head_size, cfg.rms_norm_eps, ctx)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.qkv_proj.num_heads,
            cfg.head_size,
            self.qkv_proj.num_kv_heads,
            cfg.query_pre_attn_scalar**-0.5,
            ctx.attn_backend,
            sliding_window=sliding_window,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.attn.split_qkv(self.qkv_proj(hidden_states))
        q = _head_norm(self.q_norm, q)
        k = _head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


def _head_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm of each head `[T, H, D]` over D (as `[T * H, D]` rows)."""
    num_tokens, heads, head = x.shape
    return norm(x.reshape(num_tokens * heads, head)).view(num_tokens, heads, head)


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3Shape, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size] * 2,
            False,
            ctx,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, False, ctx, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """See the module docstring; the residual stream is carried between layers (the next
    layer's input norm adds it), as in the Llama layers."""

    def __init__(
        self,
        cfg: Gemma3Shape,
        ctx: ModelContext,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(
            cfg, ctx, rotary_emb, sliding_window, prefix=f"{prefix}.self_attn"
        )
        self.mlp = Gemma3MLP(cfg, ctx, prefix=f"{prefix}.mlp")
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps, ctx)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps, ctx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps, ctx)

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
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Gemma3Shape, ctx: ModelContext) -> None:
        super().__init__()
        pp = ctx.parallel.pp
        self.hidden_size = cfg.hidden_size
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, "model.embed_tokens")
            if pp.is_first_rank
            else PPMissingLayer()
        )
        # sqrt(hidden) in the model's dtype, as transformers rounds it.
        self.register_buffer(
            "normalizer",
            torch.tensor(cfg.hidden_size**0.5, dtype=ctx.dtype, device=ctx.device),
            persistent=False,
        )
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    cfg.head_size, cfg.max_position_embeddings, cfg.rope[kind], ctx.device
                )
                for kind in LAYER_TYPES
            }
        )

        def layer_fn(i: int) -> nn.Module:
            window = cfg.sliding_windows[i]
            rotary = self.rotary["sliding_attention" if window else "full_attention"]
            return Gemma3DecoderLayer(cfg, ctx, rotary, window, f"model.layers.{i}")

        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_layers, pp.rank_in_group, pp.world_size, layer_fn
        )
        self.norm: nn.Module = (
            GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
            if pp.is_last_rank
            else PPMissingLayer()
        )
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        residual: torch.Tensor | None
        if self.is_first_stage:
            assert input_ids is not None, "the first stage takes input_ids"
            hidden_states, residual = self.embed_tokens(input_ids) * self.normalizer, None
        else:
            assert intermediate_tensors is not None, "a later stage takes intermediate tensors"
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        layers = self.layers[self.start_layer : self.end_layer]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        assert residual is not None  # every stage holds at least one layer
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text over a flattened batch and a paged KV cache (the CausalLM protocol)."""

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        text_config = self.text_config(hf_config)
        cfg = Gemma3Shape(text_config)
        cfg.check_parallel(ctx.parallel.tp_size, ctx.parallel.pp_size)
        self.hf_config = hf_config
        self.dtype = ctx.dtype
        self.device = ctx.device
        self.num_layers = cfg.num_layers
        self.head_size = cfg.head_size
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.final_logit_softcapping = cfg.final_logit_softcapping
        self.model = Gemma3Model(cfg, ctx)
        self.layer_range = (self.model.start_layer, self.model.end_layer)
        attn = self.model.layers[self.model.start_layer].self_attn.attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.lm_head: nn.Module = PPMissingLayer()
        if ctx.parallel.pp.is_last_rank:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, prefix="lm_head")
            if cfg.tie_word_embeddings and ctx.parallel.pp.is_first_rank:
                self.lm_head.tie_weights(self.model.embed_tokens)

    @staticmethod
    def text_config(hf_config: Any) -> Any:
        """The language model's config (the whole config for the text-only model)."""
        return hf_config

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Raise ValueError (ConfigError) naming what of `hf_config` this class cannot run."""
        Gemma3Shape(cls.text_config(hf_config))

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        start, end = self.layer_range
        if len(kv_caches) != end - start:
            raise ValueError(f"expected {end - start} KV cache views, got {len(kv_caches)}")
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden] -> [N, vocab]` float32, soft-capped when the config says so."""
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def make_empty_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        def zeros() -> torch.Tensor:
            return torch.zeros(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)

        return IntermediateTensors({"hidden_states": zeros(), "residual": zeros()})

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """Each checkpoint tensor to its parameter's `weight_loader` (norms add their 1)."""
        load_checkpoint(self, self.text_weights(weights), STACKED_PARAMS, self.tie_word_embeddings)

    @staticmethod
    def text_weights(
        weights: Iterable[tuple[str, LoadedWeight]],
    ) -> Iterator[tuple[str, LoadedWeight]]:
        """The checkpoint's language-model tensors under the text model's names."""
        yield from weights


# The multimodal checkpoint's language model under these prefixes (transformers 4 saved
# `language_model.model.*`, transformers 5 saves `model.language_model.*`); the rest (vision
# tower, projector) is not used.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (text prompts only)."""

    @staticmethod
    def text_config(hf_config: Any) -> Any:
        text = getattr(hf_config, "text_config", None)
        if text is None:
            raise ConfigError("Gemma3ForConditionalGeneration: the config has no text_config")
        return text

    @staticmethod
    def text_weights(
        weights: Iterable[tuple[str, LoadedWeight]],
    ) -> Iterator[tuple[str, LoadedWeight]]:
        for name, tensor in weights:
            for prefix, replacement in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    yield replacement + name[len(prefix) :], tensor
                    break
