"""The default linear method: one `[out, in]` weight in the model's dtype, `F.linear`; on CUDA
(16-bit weights, unless TANDEM_W16A16=off) the batch buckets where tandem_kernels.fp8_w8a16's
small-batch kernels timed faster at load take those instead."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.quantization.base import LinearMethodBase, set_weight_attrs


class UnquantizedLinearMethod(LinearMethodBase):
    """`weight` `[sum(output_partition_sizes), input_size_per_partition]`, output_dim 0,
    input_dim 1."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        *,
        device: torch.device | None = None,
        **extra_weight_attrs: Any,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(
                sum(output_partition_sizes),
                input_size_per_partition,
                dtype=params_dtype,
                device=device,
            ),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CUDA, unless TANDEM_W16A16=off: time the small-batch kernels against `F.linear`
        on this weight (`tune_w16a16`, once per shape) and, where some batch bucket took them,
        keep a unit scale and a lock buffer for them (`layer.w16a16`; None: `apply` is plain
        `F.linear`). Not for an input embedding (its weight is looked up, not multiplied)."""
        from tandem.layers.vocab import ParallelLMHead, VocabParallelEmbedding

        layer.w16a16 = None
        if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
            return
        weight = layer.weight
        if not weight.is_cuda or weight.dtype not in (torch.bfloat16, torch.float16):
            return
        from tandem_kernels import fp8_w8a16

        if not fp8_w8a16.w16a16_setting():
            return
        scale = fp8_w8a16.unit_scale(weight.device)
        choices = fp8_w8a16.tune_w16a16(weight.data, scale)
        if any(config is not None for config in choices.values()):
            layer.w16a16 = (scale, fp8_w8a16.w8a16_locks(weight.shape[0], weight.device))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        tuned = getattr(layer, "w16a16", None)
        if tuned is not None:  # a CUDA weight, some bucket of which the kernels serve
            from tandem_kernels import fp8_w8a16

            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            n, k = layer.weight.shape
            config = fp8_w8a16.choose_w16a16(x2.shape[0], n, k, x.dtype)
            if config is not None and x2.stride(-1) == 1 and x.dtype == layer.weight.dtype:
                scale, locks = tuned
                out = fp8_w8a16.w8a16_gemm(x2, layer.weight, scale, config, locks)
                if bias is not None:
                    out = out + bias
                return out.reshape(*shape[:-1], n)
        return F.linear(x, layer.weight, bias)
