"""RMSNorm, with the residual add folded in (the fused kernel's shape).

`rms_norm` and `fused_add_rms_norm` are plain functions so a device kernel can stand in for
them; both compute in float32 and round once to the input dtype, as Hugging Face does.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.quantization.input_quant import Activation, input_quantizer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim."""
    input_dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual <- x + residual`, then `(rms_norm(residual), residual)`."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. Called with a residual, it adds it first and returns both.

    With `cpu_kernels` (the model runs the CPU step path), 2-D CPU inputs go through one C++
    pass (tandem_kernels/cpu): the residual is then updated in place.

    `quant_consumer`: the linear layer this norm feeds (qkv_proj, gate_up_proj). When its
    method wants quantized input (an FP8 method), 2-D inputs come out as that
    `QuantizedActivation`, written by the norm's own kernel (input_quant.py); else as usual.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        cpu_kernels: bool = False,
        quant_consumer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.cpu_kernels = cpu_kernels
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.input_quant = input_quantizer(quant_consumer)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Activation | tuple[Activation, torch.Tensor]:
        if (
            self.input_quant is not None
            and x.dim() == 2
            and x.stride(-1) == 1
            and self.input_quant.takes_quantized(x)
        ):
            out, residual_out = self.input_quant.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual_out)
        if x.is_cuda:
            from tandem_kernels import rms_norm as k

            if residual is None:
                return k.rms_norm(x, self.weight, self.eps)
            return k.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if self.cpu_kernels and x.dim() == 2 and x.stride(-1) == 1:
            from tandem_kernels import cpu

            if residual is None:
                return cpu.rms_norm(x, self.weight, self.eps)
            return cpu.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
