"""The FP8 linear method's activation quantizer (tandem.layers.quantization.input_quant): the
RMSNorm or SiLU-and-mul before an FP8 linear writes e4m3 with the scale the linear's scheme
uses, so the linear skips its own quantization pass.

    scheme's activations         fused op's scale       kernels (tandem_kernels.fp8_fused)
    dynamic per token (ptpc)     [T, 1], one pass       one program per row holds its max
    dynamic per tensor (fp8)     [], two passes         rows' max (atomic), then quantize
    static (checkpoint's)        the layer's input_scale, one pass

The scale is the one the linear would have computed from the unfused op's output, so the
product is the unfused path's (up to the order of the norm's fp32 sum). On CUDA the Triton
kernels; elsewhere (CPU tests of the FP8 reference path) the unfused torch ops, then the
torch quantizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tandem.layers.quantization.input_quant import ActivationQuantizer, QuantizedActivation

if TYPE_CHECKING:
    from tandem.layers.quantization.fp8 import Fp8Scheme
    from tandem_kernels.fp8_fused import QuantStrategy


def _fused_ops() -> Any:
    """tandem_kernels.fp8_fused, imported when first used (it loads Triton; see fp8.py)."""
    from tandem_kernels import fp8_fused

    return fp8_fused


class Fp8ActivationQuantizer(ActivationQuantizer):
    """e4m3 input for `layer` (an FP8 linear) under `scheme`; a static scale is read from
    `layer.input_scale` at each call (it is made after loading)."""

    def __init__(self, layer: nn.Module, scheme: Fp8Scheme) -> None:
        self.layer = layer
        self.strategy: QuantStrategy = (
            "static" if scheme.activation_scheme == "static" else scheme.activation_strategy
        )

    def takes_quantized(self, x: torch.Tensor) -> bool:
        """Not where the linear runs its weight-only small-batch GEMM (W8A16, bf16 input)."""
        return self.layer.quant_method.w8a16_config(self.layer, x) is None

    def takes_gated(self, gate_up: torch.Tensor) -> bool:
        """Where the W8A16 GEMM serves a batch of at most `GATED_MAX_M` rows: it computes the
        SiLU-and-mul as it reads `gate_up` (tandem_kernels.fp8_w8a16)."""
        if not gate_up.is_cuda or self.layer.quant_method.w8a16_config(self.layer, gate_up) is None:
            return False
        from tandem_kernels.fp8_w8a16 import GATED_MAX_M

        return gate_up.shape[0] <= GATED_MAX_M

    def _static_scale(self) -> torch.Tensor | None:
        return self.layer.input_scale if self.strategy == "static" else None

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedActivation, torch.Tensor | None]:
        scale = self._static_scale()
        if x.is_cuda:
            q, s, residual_out = _fused_ops().rms_norm_fp8(
                x, residual, weight, eps, self.strategy, scale
            )
        else:
            from tandem.layers.norm import fused_add_rms_norm, rms_norm

            if residual is None:
                out, residual_out = rms_norm(x, weight, eps), None
            else:
                out, residual_out = fused_add_rms_norm(x, residual, weight, eps)
            q, s = _fused_ops().quantize_activation_ref(out, self.strategy, scale)
        return QuantizedActivation(q, s, x.dtype), residual_out

    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation:
        scale = self._static_scale()
        if x.is_cuda:
            q, s = _fused_ops().silu_and_mul_fp8(x, self.strategy, scale)
        else:
            from tandem.layers.activation import silu_and_mul

            q, s = _fused_ops().quantize_activation_ref(silu_and_mul(x), self.strategy, scale)
        return QuantizedActivation(q, s, x.dtype)
