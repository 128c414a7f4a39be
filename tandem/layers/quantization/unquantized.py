"""The default linear method: one `[out, in]` weight in the model's dtype, `F.linear`."""

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

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
