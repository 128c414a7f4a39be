"""The Llama family: Llama 2/3.x, Mistral (full attention), Qwen2/2.5, SmolLM2.

One class covers them; the differences are config fields:

- Qwen2: bias on the Q/K/V projections (not on o_proj);
- Llama: `attention_bias` (Q/K/V/O) and `mlp_bias`;
- tied embeddings (`tie_word_embeddings`): the LM head reads the embedding weight;
- `head_dim` when the config gives one, else hidden_size // num_attention_heads;
- rope: default, linear or llama3 scaling.

Q/K/V and gate/up are fused projections; `load_weights` maps checkpoint names into them.
The forward takes one flattened sequence of all scheduled tokens (no padding between
requests); attention goes through the backend, which owns the paged KV cache layout.

    input_ids [T] -> embed -> N x (RMSNorm -> attention -> add&RMSNorm -> MLP) -> add&RMSNorm
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem.distributed import get_pp_indices
from tandem.layers.activation import SiluAndMul
from tandem.layers.attention.backend import AttentionMetadata
from tandem.layers.attention.layer import Attention
from tandem.layers.linear import Linear, MergedLinear, QKVLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from tandem.layers.vocab import LMHead, VocabEmbedding
from tandem.models.interface import IntermediateTensors, ModelContext

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        qkv_bias: bool,
        o_bias: bool,
        rotary_emb: RotaryEmbedding,
        ctx: ModelContext,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        dtype, device = ctx.dtype, ctx.device
        self.qkv_proj = QKVLinear(
            hidden_size, num_heads, num_kv_heads, head_size, qkv_bias, dtype, device
        )
        self.o_proj = Linear(num_heads * head_size, hidden_size, o_bias, dtype, device)
        # Shared across layers; kept out of the module tree so it isn't registered N times.
        self._rotary_emb = [rotary_emb]
        self.attn = Attention(num_heads, head_size, num_kv_heads, head_size**-0.5, ctx.attn_backend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        out = self.attn.forward_qkv(positions, qkv, self._rotary_emb[0], kv_cache, attn_metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        cpu_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, dtype, device
        )
        self.act_fn = SiluAndMul(cpu_kernels=cpu_kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: _LlamaShape,
        rotary_emb: RotaryEmbedding,
        ctx: ModelContext,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_size,
            cfg.qkv_bias,
            cfg.o_bias,
            rotary_emb,
            ctx,
        )
        cpu_kernels = ctx.cpu_kernels
        dtype, device = ctx.dtype, ctx.device
        self.mlp = LlamaMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device, cpu_kernels
        )
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cpu_kernels=cpu_kernels
        )
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cpu_kernels=cpu_kernels
        )

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
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class _LlamaShape:
    """The config fields the model reads, resolved once (with family defaults)."""

    def __init__(self, hf_config: Any) -> None:
        model_type = getattr(hf_config, "model_type", "llama")
        self.hidden_size = int(hf_config.hidden_size)
        self.intermediate_size = int(hf_config.intermediate_size)
        self.num_layers = int(hf_config.num_hidden_layers)
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or self.num_heads)
        self.head_size = int(
            getattr(hf_config, "head_dim", None) or self.hidden_size // self.num_heads
        )
        self.vocab_size = int(hf_config.vocab_size)
        self.max_position_embeddings = int(hf_config.max_position_embeddings)
        self.rms_norm_eps = float(hf_config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.rope_parameters = rope_parameters_from_config(hf_config)
        if model_type == "qwen2":
            self.qkv_bias, self.o_bias, self.mlp_bias = True, False, False
        else:
            attention_bias = bool(getattr(hf_config, "attention_bias", False))
            self.qkv_bias = self.o_bias = attention_bias
            self.mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (silu)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        sliding_window = getattr(hf_config, "sliding_window", None)
        use_sliding = getattr(hf_config, "use_sliding_window", model_type == "mistral")
        if use_sliding and sliding_window and sliding_window < self.max_position_embeddings:
            logger.warning(
                "sliding_window=%d is ignored: attention spans the whole context", sliding_window
            )


class LlamaModel(nn.Module):
    """The decoder stack of this pipeline stage: layers `layer_range` (others are empty
    placeholders, so checkpoint names keep their indices)."""

    def __init__(self, cfg: _LlamaShape, ctx: ModelContext, layer_range: tuple[int, int]) -> None:
        super().__init__()
        dtype, device = ctx.dtype, ctx.device
        self.layer_range = layer_range
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_size, cfg.max_position_embeddings, cfg.rope_parameters, device
        )
        start, end = layer_range
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.rotary_emb, ctx) if start <= i < end else nn.Identity()
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cpu_kernels=ctx.cpu_kernels
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None,
        is_last_stage: bool,
    ) -> torch.Tensor | IntermediateTensors:
        residual: torch.Tensor | None
        if intermediate_tensors is None:
            assert input_ids is not None
            hidden_states = self.embed_tokens(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        start, end = self.layer_range
        for layer, kv_cache in zip(self.layers[start:end], kv_caches, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        if not is_last_stage:
            assert residual is not None
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# Checkpoint (Hugging Face) projection name -> (fused module attribute, shard).
_STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flattened batch and a paged KV cache (the CausalLM
    protocol, tandem.models.interface).

    forward(input_ids [T] int64 (None on a stage that is not the first), positions [T] int64,
    kv_caches (one view per layer of this stage, `[num_blocks, 2, block_size, num_kv_heads,
    head_size]`), attn_metadata, intermediate_tensors) -> [T, hidden] on the last stage, else
    IntermediateTensors; compute_logits(hidden [N, hidden]) -> [N, vocab] float32.
    """

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        cfg = _LlamaShape(hf_config)
        parallel = ctx.parallel
        if parallel.tp_size > 1:
            raise ValueError(
                f"tensor_parallel_size {parallel.tp_size}: this Llama build has no parallel "
                "layers (one TP rank only)"
            )
        if parallel.pp_size > cfg.num_layers:
            raise ValueError(
                f"pipeline_parallel_size {parallel.pp_size} is larger than the model's "
                f"{cfg.num_layers} layers"
            )
        self.hf_config = hf_config
        self.ctx = ctx
        self.dtype = ctx.dtype
        self.device = ctx.device
        self.num_layers = cfg.num_layers
        self.layer_range = get_pp_indices(cfg.num_layers, parallel.pp_rank, parallel.pp_size)
        self.is_last_stage = parallel.pp.is_last_rank
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_size = cfg.head_size
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.model = LlamaModel(cfg, ctx, self.layer_range)
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            ctx.dtype,
            ctx.device,
            tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
        )

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
        return self.model(
            input_ids,
            positions,
            kv_caches,
            attn_metadata,
            intermediate_tensors,
            self.is_last_stage,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden] -> [N, vocab]` float32."""
        return self.lm_head(hidden_states)

    def make_empty_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        """Zeroed `[num_tokens, hidden]` buffers of what a stage hands the next."""
        return IntermediateTensors(
            {
                key: torch.zeros(
                    (num_tokens, self.hidden_size), dtype=self.dtype, device=self.device
                )
                for key in ("hidden_states", "residual")
            }
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        Q/K/V and gate/up parts go into their fused parameters. `lm_head.weight` is ignored
        when embeddings are tied; rotary `inv_freq` buffers are ignored. Raises on an
        unknown name, a shape mismatch, or a parameter no checkpoint tensor filled.
        """
        modules = dict(self.named_modules())
        start, end = self.layer_range
        expected = {name for name, _ in self.named_parameters(remove_duplicate=True)}
        loaded: set[str] = set()
        seen_shards: dict[str, set[str | int]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name.startswith("model.layers."):
                index = int(name.split(".", 3)[2])
                if not start <= index < end:
                    continue  # another pipeline stage's layer
            module_path, _, kind = name.rpartition(".")
            parent_path, _, proj = module_path.rpartition(".")
            if proj in _STACKED_PARAMS:
                fused_attr, shard = _STACKED_PARAMS[proj]
                fused_path = f"{parent_path}.{fused_attr}"
                module = modules.get(fused_path)
                if module is None:
                    raise ValueError(f"checkpoint tensor {name!r} matches no layer of the model")
                if isinstance(module, QKVLinear):
                    module.load_qkv_shard(str(shard), kind, tensor)
                else:
                    assert isinstance(module, MergedLinear)
                    module.load_shard(int(shard), kind, tensor)
                param_name = f"{fused_path}.{kind}"
                seen_shards.setdefault(param_name, set()).add(shard)
                num_shards = 3 if isinstance(module, QKVLinear) else 2
                if len(seen_shards[param_name]) == num_shards:
                    loaded.add(param_name)
                continue
            module = modules.get(module_path)
            if module is None or not hasattr(module, kind) or name not in expected:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            param = getattr(module, kind)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                    f"parameter shape {tuple(param.shape)}"
                )
            if tensor.dtype == param.dtype and tensor.device == param.device:
                # Take the checkpoint tensor as is: no second copy of the bytes.
                param.data = tensor.contiguous()
            else:
                param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} parameters: {shown}")
        if self.ctx.cpu_kernels:
            self.pack_cpu_weights()

    def pack_cpu_weights(self) -> int:
        """CPU step path: every projection and the LM head keep a prepacked copy of their
        weight (MKL's for float32, oneDNN's for bf16: tandem.layers.linear); made again after
        each `load_weights`. Returns how many were packed (0 in other dtypes, or without the
        libraries)."""
        packed = 0
        for module in self.modules():
            if isinstance(module, Linear | LMHead):
                packed += module.pack_for_cpu()
        return packed
