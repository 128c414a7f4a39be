"""The CPU step path's decoder stack: a Llama model's decoder layers in one C++ call.

On the CPU a decode step of a small model is a few hundred short kernels, and the Python
between them (module calls, each linear's kernel choice, the attention backend's dispatch) was
5-6 ms of a 113 ms step of SmolLM2-135M at 64 rows. `tandem_kernels.cpu.decoder_stack` runs
the same kernels, in the same order and with the same arguments as the layer modules, from one
call: the same bits, without that Python.

`CpuDecoderStack.build` takes the layers when every one of them is the plain form that call
knows, and returns None otherwise (the modules then run as before):
- a `LlamaDecoderLayer` with a `LlamaAttention` and a `LlamaMLP` (exactly: Qwen3's q/k norms,
  an MoE block, Gemma's layers are other classes): the Llama model checks that before it asks
  (`tandem.models.llama._is_plain_llama_layer`), so this module needs no model class;
- float32 norms on the CPU kernels, feeding unquantized input;
- every projection on `CpuPackedLinearMethod` with the `panel` kernel for every token class,
  without bias, on one tensor-parallel rank;
- the CPU attention backend (by its name: models import no backend) without a sliding window.
`run` adds what only a step can tell: one KV cache group, no graph splitter, float32 caches,
every row a real token. Where any of it fails it returns None and the modules run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from tandem.layers.attention.backend import AttentionMetadata
from tandem.layers.quantization.cpu import CpuPackedLinearMethod
from tandem_kernels.cpu import DecoderStackWeights

logger = logging.getLogger(__name__)


def _panel_weight(linear: nn.Module) -> torch.Tensor | None:
    """The panel-packed weight of a bias-free single-rank linear whose every token class runs
    the `panel` kernel; None for anything else."""
    plan = getattr(linear, "cpu_gemm_plan", None)
    if (
        type(getattr(linear, "quant_method", None)) is not CpuPackedLinearMethod
        or plan is None
        or getattr(linear, "bias", None) is not None
        or getattr(linear, "tp_size", 1) != 1
        or any(name != "panel" for name in plan.kernel_names)
    ):
        return None
    return plan.packed.get("panel")


class CpuDecoderStack:
    """A run of plain Llama decoder layers as `tandem_kernels.cpu.decoder_stack` reads them."""

    def __init__(self, weights: DecoderStackWeights) -> None:
        self.weights = weights

    @classmethod
    def build(cls, layers: Sequence[nn.Module]) -> CpuDecoderStack | None:
        """The stack of `layers` (see the module doc), or None where any layer is not the
        plain form (the layer classes checked by the caller)."""
        from tandem_kernels import cpu

        if not layers or not cpu.available():
            return None
        lists: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("input_norms", "qkv", "o", "post_norms", "gate_up", "down")
        }
        first_attn = None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            inner = attn.attn
            if inner.backend.name != "cpu" or inner.sliding_window:
                return None
            if mlp.act_fn.input_quant is not None or not mlp.act_fn.cpu_kernels:
                return None
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if (
                    not norm.cpu_kernels
                    or norm.input_quant is not None
                    or norm.weight.dtype != torch.float32
                ):
                    return None
            packed = [
                _panel_weight(p)
                for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            if any(p is None for p in packed) or mlp.gate_up_proj.weight.shape[0] % 64:
                return None
            if first_attn is None:
                first_attn = attn
            elif (
                attn.rotary_emb is not first_attn.rotary_emb
                or (inner.num_heads, inner.num_kv_heads, inner.head_size, inner.scale)
                != (
                    first_attn.attn.num_heads,
                    first_attn.attn.num_kv_heads,
                    first_attn.attn.head_size,
                    first_attn.attn.scale,
                )
                or layer.input_layernorm.eps != layers[0].input_layernorm.eps
                or layer.post_attention_layernorm.eps != layers[0].input_layernorm.eps
            ):
                return None
            qkv, o, gate_up, down = packed
            lists["input_norms"].append(layer.input_layernorm.weight.data)
            lists["post_norms"].append(layer.post_attention_layernorm.weight.data)
            lists["qkv"].append(qkv)
            lists["o"].append(o)
            lists["gate_up"].append(gate_up)
            lists["down"].append(down)
        assert first_attn is not None
        rotary = first_attn.rotary_emb
        cos = getattr(rotary, "cos_cache", None)
        sin = getattr(rotary, "sin_cache", None)
        if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
            return None
        if cos.dtype != torch.float32 or cos.shape[-1] * 2 != first_attn.attn.head_size:
            return None
        inner = first_attn.attn
        logger.info("CPU decoder stack: %d layers in one call", len(layers))
        return cls(
            DecoderStackWeights(
                **lists,
                cos_cache=cos,
                sin_cache=sin,
                num_heads=inner.num_heads,
                num_kv_heads=inner.num_kv_heads,
                head_size=inner.head_size,
                eps=float(layers[0].input_layernorm.eps),
                scale=float(inner.scale),
            )
        )

    def run(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(hidden, residual)` after every layer, as the modules would give them; None where
        this step is not one the call takes (see the module doc)."""
        from tandem_kernels import cpu

        tokens = hidden.shape[0]
        if (
            metadata.kv_groups is not None
            or metadata.graph_splitter is not None
            or metadata.num_actual_tokens != tokens
            or tokens == 0
            or hidden.dim() != 2
            or hidden.dtype != torch.float32
            or hidden.device.type != "cpu"
            or hidden.stride(-1) != 1
            or (residual is not None and residual.stride(-1) != 1)
            or positions.dtype != torch.int64
            or not positions.is_contiguous()
            or any(c.numel() == 0 or c.dtype != torch.float32 for c in kv_caches)
        ):
            return None
        r = metadata.num_reqs
        return cpu.decoder_stack(
            self.weights,
            hidden,
            residual,
            positions,
            kv_caches,
            metadata.slot_mapping,
            metadata.block_table[:r],
            metadata.seq_lens[:r],
            metadata.query_start_loc[: r + 1],
        )
