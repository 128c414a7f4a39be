"""The CPU step path's linear method: the unquantized weight plus a GEMM plan for it
(tandem.layers.cpu_gemm: per token class, the kernel a fixed rule gives the weight on this CPU,
with the packed copy it reads), made once after loading and used for every product."""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.cpu_gemm import CpuGemmPlan
from tandem.layers.quantization.unquantized import UnquantizedLinearMethod


class CpuPackedLinearMethod(UnquantizedLinearMethod):
    """As unquantized, with `layer.cpu_gemm_plan` made after loading (until then, and for
    inputs no kernel reads, `F.linear`). `cpu_gemm` is `--cpu-gemm`: "auto" is the rule, a
    kernel name forces that kernel where it supports the weight."""

    def __init__(self, cpu_gemm: str = "auto") -> None:
        self.cpu_gemm = cpu_gemm

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.cpu_gemm_plan = CpuGemmPlan(
            layer.weight, getattr(layer, "bias", None) is not None, self.cpu_gemm
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        plan: CpuGemmPlan | None = getattr(layer, "cpu_gemm_plan", None)
        if plan is None:
            return super().apply(layer, x, bias)
        return plan.linear(x, layer.weight, bias)

    def apply_silu_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        plan: CpuGemmPlan | None = getattr(layer, "cpu_gemm_plan", None)
        if plan is None:
            return None
        return plan.linear_silu_mul(x, layer.weight, bias)
