"""The CPU step path's linear method: the unquantized weight plus a prepacked copy of it
(MKL's packed sgemm for float32, oneDNN's blocked layout for bf16: tandem.layers.cpu_gemm),
made once after loading and used for every product the packed GEMM takes."""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.cpu_gemm import pack_cpu_weight, packed_or_plain_linear
from tandem.layers.quantization.unquantized import UnquantizedLinearMethod


class CpuPackedLinearMethod(UnquantizedLinearMethod):
    """As unquantized, with `layer.cpu_packed_weight` (None where the weight's dtype or this
    machine has no packed GEMM: then `F.linear`)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.cpu_packed_weight = pack_cpu_weight(layer.weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = getattr(layer, "cpu_packed_weight", None)
        return packed_or_plain_linear(x, layer.weight, bias, packed)
