"""Activations handed to a linear layer already quantized by the op before it.

A quantized linear method (FP8) multiplies quantized activations; left alone it quantizes its
input itself, one more pass over the activations. Where the op that produces that input is a
kernel of its own (RMSNorm, SiLU-and-mul), it can write the quantized form instead:

    input_layernorm           --QuantizedActivation-->  qkv_proj       (FP8 method)
    post_attention_layernorm  --QuantizedActivation-->  gate_up_proj
    act_fn (SiLU-and-mul)     --QuantizedActivation-->  down_proj

The seam, in one question: a producer is built with the linear layer that consumes its output
(`quant_consumer`) and asks `input_quantizer(consumer)` once, at construction. The consumer's
method answers with an `ActivationQuantizer` (how it wants its input) or None: plain input,
the answer of every unquantized, CPU-packed and weight-only method, whose path is unchanged.
With a quantizer the producer runs the quantizer's fused op and returns a
`QuantizedActivation`, which the method's `apply` takes as is. Models only name the consumer;
no model code, runner or graph capture knows which form passed (a `QuantizedActivation` is two
tensors made on the device without a host sync, so it is captured in CUDA graphs like any
activation).

A consumer may also take SiLU-and-mul's input ungated (`takes_gated`): the activation then
returns a `GatedActivation` (its own input, `[T, 2I]`, untouched) and the consumer computes
`silu(gate) * up` as it reads it (the FP8 method's weight-only small-batch GEMV: one kernel
instead of two, and no `[T, I]` round trip).

Invariant: a producer hands a `QuantizedActivation` or `GatedActivation` only to the consumer
whose quantizer asked for it; that consumer's method, and only it, accepts one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation `[T, K]` in a quantized form: `data` (e.g. float8 e4m3, row-major) and
    its float32 `scale` (`[]` per tensor, `[T, 1]` per token), `x ~= data * scale`; `dtype`:
    the activation's dtype before quantization (the consumer's output dtype)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


@dataclass(frozen=True)
class GatedActivation:
    """`silu(gate_up[:, :I]) * gate_up[:, I:]` (`[T, I]`, in gate_up's dtype), not computed:
    the consumer computes it from `gate_up` `[T, 2I]` (row-major) as it reads its input."""

    gate_up: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.gate_up.shape[0], self.gate_up.shape[1] // 2))

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype


# What a producer (norm, activation) hands the next layer: plain, quantized for it, or (an
# activation) its gated input.
Activation = torch.Tensor | QuantizedActivation | GatedActivation


class ActivationQuantizer(ABC):
    """How one linear layer wants its input quantized, with the producers' ops fused into it.
    Each op takes the same inputs as the unfused op (2-D, unit stride along the last dim) and
    returns the quantized form of the unfused op's output."""

    def takes_quantized(self, x: torch.Tensor) -> bool:
        """Whether the consumer takes its input quantized for this input's batch (a function of
        its shape, device and dtype only, so fixed when a CUDA graph is captured); when not,
        the producer runs its plain op."""
        return True

    def takes_gated(self, gate_up: torch.Tensor) -> bool:
        """Whether the consumer takes SiLU-and-mul's input `gate_up` `[T, 2I]` ungated (a
        `GatedActivation`) for this batch (asked first; fixed at capture as
        `takes_quantized` is)."""
        return False

    @abstractmethod
    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedActivation, torch.Tensor | None]:
        """`(quantized rms_norm(x + residual), x + residual)`; without a residual,
        `(quantized rms_norm(x), None)`. Inputs are left untouched."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation:
        """Quantized `silu(x[:, :I]) * x[:, I:]` of `x` `[T, 2*I]`."""


def input_quantizer(consumer: nn.Module | None) -> ActivationQuantizer | None:
    """The quantizer `consumer` (a linear layer, or None) wants its input through, or None
    for plain input. A layer that reshapes its input before its method sees it (a row-parallel
    layer that splits a whole input: `splits_input`) always takes plain input."""
    from tandem.layers.quantization.base import LinearMethodBase

    method = getattr(consumer, "quant_method", None)
    if not isinstance(method, LinearMethodBase) or getattr(consumer, "splits_input", False):
        return None
    return method.input_quantizer(consumer)  # type: ignore[arg-type]
