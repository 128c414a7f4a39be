"""Gated activations on a fused [gate | up] projection output."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.quantization.input_quant import Activation, GatedActivation, input_quantizer

if TYPE_CHECKING:
    from tandem.layers.linear import MergedColumnParallelLinear


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` with `d = x.shape[-1] // 2`."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """On CUDA the fused Triton kernel (tandem_kernels/activation.py); with `cpu_kernels` (the
    CPU step path), 2-D CPU inputs in one C++ pass (tandem_kernels/cpu); else the torch
    function.

    `quant_consumer`: the linear layer this activation feeds (down_proj). When its method
    wants quantized input (an FP8 method), 2-D inputs come out as that `QuantizedActivation`,
    written by the activation's own kernel (input_quant.py); where it computes the activation
    itself as it reads its input (`takes_gated`), as a `GatedActivation` of the input
    untouched; else as usual. `of(gate_up_proj, x)` is `self(gate_up_proj(x))`, from the
    projection's own kernel where it applies the activation as it stores its product (the
    CPU panel GEMM)."""

    def __init__(self, cpu_kernels: bool = False, quant_consumer: nn.Module | None = None) -> None:
        super().__init__()
        self.cpu_kernels = cpu_kernels
        self.input_quant = input_quantizer(quant_consumer)
        if quant_consumer is not None and hasattr(quant_consumer, "gated_input"):
            quant_consumer.gated_input = True

    def forward(self, x: torch.Tensor) -> Activation:
        if self.input_quant is not None and x.dim() == 2 and x.stride(-1) == 1:
            if self.input_quant.takes_gated(x):
                return GatedActivation(x)
            if self.input_quant.takes_quantized(x):
                return self.input_quant.silu_and_mul(x)
        if x.is_cuda:
            from tandem_kernels.activation import silu_and_mul as silu_and_mul_kernel

            return silu_and_mul_kernel(x)
        if self.cpu_kernels and x.dim() == 2 and x.stride(-1) == 1:
            from tandem_kernels import cpu

            return cpu.silu_and_mul(x)
        return silu_and_mul(x)

    def of(self, gate_up_proj: MergedColumnParallelLinear, x: torch.Tensor) -> Activation:
        """`self(gate_up_proj(x))`; on the CPU step path, with plain input wanted by the
        consumer, in one kernel where the projection's method has one (the same bits)."""
        if self.cpu_kernels and self.input_quant is None:
            fused = gate_up_proj.forward_silu_mul(x)
            if fused is not None:
                return fused
        return self(gate_up_proj(x))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(x[..., :d]) * x[..., d:]` with `d = x.shape[-1] // 2` (Gemma's MLP)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """The tanh-approximated GELU gate (`gelu_pytorch_tanh`) on a fused [gate | up] output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)
