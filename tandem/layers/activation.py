"""Gated activations on a fused [gate | up] projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` with `d = x.shape[-1] // 2`."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """On CUDA the fused Triton kernel (tandem_kernels/activation.py), else the torch function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tandem_kernels.activation import silu_and_mul as silu_and_mul_kernel

            return silu_and_mul_kernel(x)
        return silu_and_mul(x)
