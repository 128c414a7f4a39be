"""The Llama family: Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM2.

One class covers them; the differences are config fields:

- Qwen2: bias on the Q/K/V projections (not on o_proj);
- Llama: `attention_bias` (Q/K/V/O) and `mlp_bias`;
- tied embeddings (`tie_word_embeddings`): the LM head reads the embedding weight;
- `head_dim` when the config gives one, else hidden_size // num_attention_heads;
- rope: default, linear or llama3 scaling;
- sliding windows where the config sets them (Mistral's `sliding_window`, Qwen2's
  `use_sliding_window` from `max_window_layers` on): `sliding_window_for_layer`.

    input_ids [T] -> embed -> N x (RMSNorm -> attention -> add&RMSNorm -> MLP) -> add&RMSNorm

Under tensor parallel each rank holds its heads and MLP columns (tandem.layers.linear); under
pipeline parallel a stage holds layers `layer_range` (the embedding on the first stage, the
final norm and LM head on the last) and hands the next stage `IntermediateTensors`.

Families with the same skeleton subclass `LlamaForCausalLM` and swap a part: Qwen3 its
attention (qwen3.py), Qwen3-MoE and Mixtral their MLP for a mixture of experts
(qwen3_moe.py, mixtral.py), Granite its layer and scales (granite.py). Phi-3 is this class:
its checkpoints store q/k/v and gate/up fused, which load whole into the fused layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.layers.activation import SiluAndMul
from tandem.layers.attention.backend import AttentionMetadata
from tandem.layers.attention.layer import Attention
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.quantization import QUANTIZATION_CONFIGS
from tandem.layers.rotary import (
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    compute_inv_freq,
    partial_rotary_order,
    rope_context_len,
    rope_parameters_from_config,
)
from tandem.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.weight_utils import LoadedWeight
from tandem.models.cpu_stack import CpuDecoderStack
from tandem.models.interface import IntermediateTensors, ModelContext
from tandem.models.utils import (
    STACKED_PARAMS,
    PPMissingLayer,
    load_checkpoint,
    make_layers,
    sliding_window_for_layer,
)


class LlamaShape:
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
        # The positions the rotary caches hold (YaRN's scaled context past the field).
        self.max_position_embeddings = rope_context_len(
            self.rope_parameters, self.max_position_embeddings
        )
        # The attention's softmax scale and the embedding's output scale (Granite sets both).
        self.attention_scale = self.head_size**-0.5
        self.embedding_multiplier = 1.0
        if model_type == "qwen2":
            self.qkv_bias, self.o_bias, self.mlp_bias = True, False, False
        else:
            attention_bias = bool(getattr(hf_config, "attention_bias", False))
            self.qkv_bias = self.o_bias = attention_bias
            self.mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (silu)")
        # Partial rotary: the first `rotary_dim` dims of each head rotate (rotary.py's
        # docstring: the model orders q and k's dims for it when it loads).
        partial = self.rope_parameters.get("partial_rotary_factor")
        partial = partial or getattr(hf_config, "partial_rotary_factor", None) or 1.0
        self.rotary_dim = int(self.head_size * float(partial))
        if not 0 < self.rotary_dim <= self.head_size or self.rotary_dim % 2 or self.head_size % 2:
            raise ValueError(
                f"partial_rotary_factor {partial} gives {self.rotary_dim} rotating dims of "
                f"{self.head_size}: an even number from 2 to the head size is needed"
            )
        rope_type = self.rope_parameters["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "longrope":  # both factor sets against the rotating dims, now
            for long_context in (False, True):
                compute_inv_freq(self.rotary_dim, self.rope_parameters, long_context)
        quant = getattr(hf_config, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            if method not in QUANTIZATION_CONFIGS:
                known = ", ".join(sorted(QUANTIZATION_CONFIGS)) or "none yet"
                raise ValueError(
                    f"quantization_config (quant_method {method!r}) is not supported "
                    f"(checkpoint quantization methods: {known}; GGUF files load dequantized)"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        # Each layer's window (None: full attention).
        self.sliding_windows = [
            sliding_window_for_layer(hf_config, i) for i in range(self.num_layers)
        ]

    def check_parallel(self, tp_size: int, pp_size: int) -> None:
        """A clear error when the model cannot be split `tp_size` x `pp_size` ways."""
        if self.num_heads % tp_size:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not divisible by "
                f"tensor_parallel_size {tp_size}"
            )
        kv, tp = self.num_kv_heads, tp_size
        if (tp < kv and kv % tp) or (tp >= kv and tp % kv):
            raise ValueError(
                f"num_key_value_heads {kv} and tensor_parallel_size {tp}: one must divide the "
                "other (KV heads are split, or replicated when the ranks outnumber them)"
            )
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"intermediate_size {self.intermediate_size} is not divisible by "
                f"tensor_parallel_size {tp_size}"
            )
        if pp_size > self.num_layers:
            raise ValueError(
                f"pipeline_parallel_size {pp_size} is larger than num_hidden_layers "
                f"{self.num_layers}: every stage needs at least one layer"
            )


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: LlamaShape, ctx: ModelContext, rotary_emb: RotaryEmbedding, prefix: str
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
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.qkv_proj.num_heads,
            cfg.head_size,
            self.qkv_proj.num_kv_heads,
            cfg.attention_scale,
            ctx.attn_backend,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        out = self.attn.forward_qkv(positions, qkv, self.rotary_emb, kv_cache, attn_metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaShape, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size] * 2,
            cfg.mlp_bias,
            ctx,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            cfg.mlp_bias,
            ctx,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul(cpu_kernels=ctx.cpu_kernels, quant_consumer=self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn.of(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    """`x -> norm -> self_attn -> add&norm -> mlp`, the attention and the MLP (dense or MoE)
    given; the MLP sits under `mlp_name` (the checkpoint's: "mlp", Mixtral's
    "block_sparse_moe"). Each sublayer's output is scaled by `residual_multiplier` before it
    joins the residual stream (1.0 here; Granite's layer sets its own)."""

    residual_multiplier: float = 1.0

    def __init__(
        self,
        cfg: LlamaShape,
        ctx: ModelContext,
        self_attn: nn.Module,
        mlp: nn.Module,
        mlp_name: str = "mlp",
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        eps, dim = cfg.rms_norm_eps, cfg.hidden_size
        # Each norm feeds the first linear of its block (none for an MoE block), which may
        # want its input quantized (tandem.layers.quantization.input_quant).
        self.input_layernorm = RMSNorm(
            dim, eps, ctx.dtype, ctx.device, ctx.cpu_kernels, getattr(self_attn, "qkv_proj", None)
        )
        self.post_attention_layernorm = RMSNorm(
            dim, eps, ctx.dtype, ctx.device, ctx.cpu_kernels, getattr(mlp, "gate_up_proj", None)
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
        scale = self.residual_multiplier
        if scale != 1.0:
            hidden_states = hidden_states * scale
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        out = getattr(self, self.mlp_name)(hidden_states)
        return (out * scale if scale != 1.0 else out), residual


class LlamaModel(nn.Module):
    """Embedding, this stage's decoder layers (`layer_fn(index, rotary_emb)`), final norm."""

    def __init__(
        self,
        cfg: LlamaShape,
        ctx: ModelContext,
        layer_fn: Callable[[int, RotaryEmbedding], nn.Module],
    ) -> None:
        super().__init__()
        pp = ctx.parallel.pp
        self.hidden_size = cfg.hidden_size
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, "model.embed_tokens")
            if pp.is_first_rank
            else PPMissingLayer()
        )
        rotary_emb = RotaryEmbedding(
            cfg.head_size,
            cfg.max_position_embeddings,
            cfg.rope_parameters,
            ctx.device,
            ctx.max_model_len,
            cfg.rotary_dim,
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_layers,
            pp.rank_in_group,
            pp.world_size,
            lambda i: layer_fn(i, rotary_emb),
        )
        self.norm: nn.Module = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.device, ctx.cpu_kernels)
            if pp.is_last_rank
            else PPMissingLayer()
        )
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.embedding_multiplier = cfg.embedding_multiplier
        # The CPU step path's decoder stack (tandem.models.cpu_stack), looked for at the first
        # forward (the loader has made the GEMM plans by then): None until then, False where
        # the layers are not its plain form. `use_cpu_decoder_stack` False keeps the modules.
        self.cpu_kernels = ctx.cpu_kernels
        self.use_cpu_decoder_stack = True
        self._cpu_stack: CpuDecoderStack | bool | None = None

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
            hidden_states, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier != 1.0:
                hidden_states = hidden_states * self.embedding_multiplier
        else:
            assert intermediate_tensors is not None, "a later stage takes intermediate tensors"
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        layers = self.layers[self.start_layer : self.end_layer]
        stack = self._decoder_stack(layers)
        stacked = (
            stack.run(positions, hidden_states, residual, kv_caches, attn_metadata)
            if stack is not None and len(kv_caches) == len(layers)
            else None
        )
        if stacked is not None:
            hidden_states, residual = stacked
        else:
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                hidden_states, residual = layer(
                    positions, hidden_states, residual, kv_cache, attn_metadata
                )
        assert residual is not None  # every stage holds at least one layer
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _decoder_stack(self, layers: Sequence[nn.Module]) -> CpuDecoderStack | None:
        """This stage's CPU decoder stack, built at the first forward on the CPU step path."""
        if not self.cpu_kernels or not self.use_cpu_decoder_stack or self._cpu_stack is False:
            return None
        if self._cpu_stack is None:
            plain = all(_is_plain_llama_layer(layer) for layer in layers)
            self._cpu_stack = (plain and CpuDecoderStack.build(layers)) or False
        return self._cpu_stack or None


def _is_plain_llama_layer(layer: nn.Module) -> bool:
    """Exactly the layer form the CPU decoder stack knows: a `LlamaDecoderLayer` with a
    `LlamaAttention` and a `LlamaMLP` (Qwen3's q/k norms, an MoE block and Gemma's layers are
    other classes)."""
    return (
        type(layer) is LlamaDecoderLayer
        and layer.mlp_name == "mlp"
        and type(layer.self_attn) is LlamaAttention
        and type(layer.mlp) is LlamaMLP
    )


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flattened batch and a paged KV cache (the CausalLM
    protocol, tandem.models.interface).

    Families that differ from Llama only in their attention or MLP (Qwen3's q/k norms, the
    MoE blocks of Qwen3-MoE and Mixtral) subclass it and override `shape_cls`,
    `make_attention`, `make_mlp` and `mlp_name`.
    """

    shape_cls: ClassVar[type[LlamaShape]] = LlamaShape
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    mlp_name: ClassVar[str] = "mlp"

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        super().__init__()
        cfg = self.shape_cls(hf_config)
        cfg.check_parallel(ctx.parallel.tp_size, ctx.parallel.pp_size)
        self.hf_config = hf_config
        self.dtype = ctx.dtype
        self.device = ctx.device
        self.num_layers = cfg.num_layers
        self.head_size = cfg.head_size
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.rotary_dim = cfg.rotary_dim

        def layer_fn(index: int, rotary_emb: RotaryEmbedding) -> nn.Module:
            prefix = f"model.layers.{index}"
            return self.layer_cls(
                cfg,
                ctx,
                self.make_attention(cfg, ctx, rotary_emb, f"{prefix}.self_attn"),
                self.make_mlp(cfg, ctx, index, f"{prefix}.{self.mlp_name}"),
                self.mlp_name,
            )

        self.model = LlamaModel(cfg, ctx, layer_fn)
        self.layer_range = (self.model.start_layer, self.model.end_layer)
        for i in range(*self.layer_range):
            self.model.layers[i].self_attn.attn.sliding_window = cfg.sliding_windows[i]
        attn = self.model.layers[self.model.start_layer].self_attn.attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.lm_head: nn.Module = PPMissingLayer()
        if ctx.parallel.pp.is_last_rank:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, prefix="lm_head")
            if cfg.tie_word_embeddings and ctx.parallel.pp.is_first_rank:
                self.lm_head.tie_weights(self.model.embed_tokens)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Raise ValueError naming a variant or option of `hf_config` this class cannot run
        (before any weight is loaded)."""
        cls.shape_cls(hf_config)

    @classmethod
    def make_attention(
        cls, cfg: Any, ctx: ModelContext, rotary_emb: RotaryEmbedding, prefix: str
    ) -> nn.Module:
        return LlamaAttention(cfg, ctx, rotary_emb, prefix)

    @classmethod
    def make_mlp(cls, cfg: Any, ctx: ModelContext, layer_index: int, prefix: str) -> nn.Module:
        return LlamaMLP(cfg, ctx, prefix)

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
        """`[N, hidden] -> [N, vocab]` float32 on every TP rank of the last stage."""
        return self.lm_head.compute_logits(hidden_states)

    def make_empty_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        def zeros() -> torch.Tensor:
            return torch.zeros(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)

        return IntermediateTensors({"hidden_states": zeros(), "residual": zeros()})

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """Hand each checkpoint tensor (Hugging Face names) to its parameter's
        `weight_loader` (tandem.models.utils.load_checkpoint): q/k/v and gate/up go into their
        fused parameters, experts into their MoE layer's; a tied `lm_head.weight` is skipped."""
        load_checkpoint(self, weights, STACKED_PARAMS, self.tie_word_embeddings)
        if self.rotary_dim < self.head_size:
            self._order_partial_rotary()

    def _order_partial_rotary(self) -> None:
        """Each q and k head's rows of every qkv_proj in `partial_rotary_order` (with their
        bias and per-row scales: every parameter of the layer with one row per output), so
        the full-head rotary kernels rotate the partial pairs (rotary.py)."""
        order = partial_rotary_order(self.head_size, self.rotary_dim)
        for i in range(*self.layer_range):
            attn = self.model.layers[i].self_attn
            if type(attn) is not LlamaAttention:
                raise ValueError(
                    f"partial rotary is not supported with {type(attn).__name__} layers"
                )
            qkv = attn.qkv_proj
            d = self.head_size
            heads = qkv.num_heads + qkv.num_kv_heads
            rows = (torch.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
            total = qkv.weight.shape[0]
            index = torch.cat([rows, torch.arange(heads * d, total)])
            for name, param in qkv.named_parameters(recurse=False):
                if param.dim() and param.shape[0] == total:
                    param.data.copy_(param.data.index_select(0, index.to(param.device)))
                elif param.dim() > 1 or name in ("weight", "bias"):  # e.g. 128x128 block scales
                    raise ValueError(
                        f"partial rotary cannot reorder {name} {tuple(param.shape)} of "
                        f"{qkv.prefix or 'qkv_proj'} (one row per output dim is needed)"
                    )
