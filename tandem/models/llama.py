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

from tandem.layers.activation import SiluAndMul
from tandem.layers.attention.backend import AttentionBackend, AttentionMetadata
from tandem.layers.attention.cpu_backend import CpuAttentionBackend
from tandem.layers.linear import Linear, MergedLinear, QKVLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from tandem.layers.vocab import LMHead, VocabEmbedding

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
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = head_size**-0.5
        self.qkv_proj = QKVLinear(
            hidden_size, num_heads, num_kv_heads, head_size, qkv_bias, dtype, device
        )
        self.o_proj = Linear(num_heads * head_size, hidden_size, o_bias, dtype, device)
        # Shared across layers; kept out of the module tree so it isn't registered N times.
        self._rotary_emb = [rotary_emb]
        self.attn_backend = attn_backend
        # CPU step path: one kernel splits Q/K/V, rotates Q and K and writes K/V into the
        # paged cache; attention then reads the cache in place (tandem_kernels/cpu).
        self.fused_cpu = isinstance(attn_backend, CpuAttentionBackend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.fused_cpu:
            qkv = self.qkv_proj(hidden_states)
            return self._forward_cpu(positions, qkv, kv_cache, attn_metadata)
        q, k, v = self.project_qkv(positions, hidden_states)
        return self.o_proj(self.attend(q, k, v, kv_cache, attn_metadata))

    def project_qkv(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q `[T, H, D]`, K and V `[T, Hkv, D]`, rotary applied (no KV cache access; the
        piecewise path; the fused CPU path is `_forward_cpu`)."""
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        q, k = self._rotary_emb[0](positions, q, k)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The backend's KV write and attention: `[T, H * D]`, before o_proj."""
        out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_size)

    def _forward_cpu(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        from tandem_kernels import cpu

        rotary = self._rotary_emb[0]
        backend = self.attn_backend
        assert isinstance(backend, CpuAttentionBackend)
        q, k, v = cpu.rotary_qkv_cache(
            qkv,
            positions,
            rotary.cos_cache,
            rotary.sin_cache,
            kv_cache,
            attn_metadata.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
        )
        out = backend.attend(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.view(qkv.shape[0], self.num_heads * self.head_size))


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
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
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
            attn_backend,
            dtype,
            device,
        )
        cpu_kernels = isinstance(attn_backend, CpuAttentionBackend)
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
    def __init__(
        self,
        cfg: _LlamaShape,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_size, cfg.max_position_embeddings, cfg.rope_parameters, device
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.rotary_emb, attn_backend, dtype, device)
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size,
            cfg.rms_norm_eps,
            dtype,
            device,
            cpu_kernels=isinstance(attn_backend, CpuAttentionBackend),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
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
    """Llama-family causal LM over a flattened batch and a paged KV cache.

    forward(input_ids [T] int64, positions [T] int64, kv_caches (one view per layer,
    `[num_blocks, 2, block_size, num_kv_heads, head_size]`), attn_metadata) -> [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] float32.
    """

    def __init__(
        self,
        hf_config: Any,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        cfg = _LlamaShape(hf_config)
        self.hf_config = hf_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_size = cfg.head_size
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.attn_backend = attn_backend
        self.model = LlamaModel(cfg, attn_backend, dtype, self.device)
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            self.device,
            tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV cache views, got {len(kv_caches)}")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden] -> [N, vocab]` float32."""
        return self.lm_head(hidden_states)

    # Pieces of the forward between attention calls (piecewise CUDA graphs): piece 0 is the
    # embedding up to layer 0's Q/K/V; piece i (1 <= i < num_layers) takes layer i-1's
    # attention output through its o_proj, norm and MLP up to layer i's Q/K/V; the last
    # piece ends with the final norm. With `LlamaAttention.attend` between them they run
    # exactly the ops of `forward`, in its order.

    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(q, k, v, residual)` of layer 0."""
        residual = self.model.embed_tokens(input_ids)
        layer = self.model.layers[0]
        hidden = layer.input_layernorm(residual)
        q, k, v = layer.self_attn.project_qkv(positions, hidden)
        return q, k, v, residual

    def middle_piece(
        self,
        index: int,
        positions: torch.Tensor,
        attn_out: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `index - 1` from its attention output on, then layer `index` up to its
        `(q, k, v)`; returns them and the residual."""
        hidden, residual = self._finish_layer(self.model.layers[index - 1], attn_out, residual)
        layer = self.model.layers[index]
        hidden, residual = layer.input_layernorm(hidden, residual)
        q, k, v = layer.self_attn.project_qkv(positions, hidden)
        return q, k, v, residual

    def last_piece(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer from its attention output on, and the final norm: `[T, hidden]`."""
        hidden, residual = self._finish_layer(self.model.layers[-1], attn_out, residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def attend(
        self,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Layer `index`'s KV write and attention (between two pieces): `[T, H * D]`."""
        return self.model.layers[index].self_attn.attend(q, k, v, kv_cache, attn_metadata)

    @staticmethod
    def _finish_layer(
        layer: LlamaDecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = layer.self_attn.o_proj(attn_out)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        return layer.mlp(hidden), residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        Q/K/V and gate/up parts go into their fused parameters. `lm_head.weight` is ignored
        when embeddings are tied; rotary `inv_freq` buffers are ignored. Raises on an
        unknown name, a shape mismatch, or a parameter no checkpoint tensor filled.
        """
        modules = dict(self.named_modules())
        expected = {name for name, _ in self.named_parameters(remove_duplicate=True)}
        loaded: set[str] = set()
        seen_shards: dict[str, set[str | int]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
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
        if isinstance(self.attn_backend, CpuAttentionBackend):
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
