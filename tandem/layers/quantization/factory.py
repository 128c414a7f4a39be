"""Which linear method a layer gets: the one place that names the default methods, so the
interface (`base.py`) knows none of its implementations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from tandem.layers.quantization.base import LinearMethodBase
from tandem.layers.quantization.cpu import CpuPackedLinearMethod
from tandem.layers.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from tandem.models.interface import ModelContext


def get_quant_method(ctx: ModelContext, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
    """The method for a linear layer: the context's quantization config first, then the CPU
    step path's packed method (`ctx.cpu_kernels`), else unquantized."""
    if ctx.quant_config is not None:
        method = ctx.quant_config.get_quant_method(layer, prefix)
        if method is not None:
            if not isinstance(method, LinearMethodBase):
                raise TypeError(f"{type(method).__name__} is not a linear method ({prefix})")
            return method
    if ctx.cpu_kernels:
        return CpuPackedLinearMethod(ctx.cpu_gemm)
    return UnquantizedLinearMethod()
