"""The CPU step path's GEMMs, picked per weight by a fixed rule (the same in every process).

A CPU linear layer's product can go through several kernels, and which is fastest depends on
the CPU, the weight's shape and the number of rows:

- `torch`: `F.linear` (MKL's sgemm for float32 on x86 wheels; it repacks the weight on every
  call, most of a decode-sized product's time);
- `mkl`: MKL's packed sgemm, the weight packed once (float32; tandem_kernels.cpu);
- `onednn`: oneDNN's inner product over a weight reordered once into its blocked layout
  (torch's `mkldnn._reorder_linear_weight` / `_linear_pointwise`; float32, and bf16 where
  oneDNN does bf16 natively: avx512_bf16 or AMX). Float32 stays float32 (no bf16 inside);
- `panel`: tandem's own AVX-512 float32 kernel (tandem_kernels.cpu `panel_linear`): the
  weight packed once in panels of 32 output features, the next panel prefetched while one is
  computed.

At a decode batch every weight is read once per step from DRAM (the model's weights are many
times the L3), and the libraries' kernels stall on it. Measured on an AMD EPYC (Zen 4, 2
cores; weights cold as in a step: a loop over 30 copies of each), 64 rows at SmolLM2-135M's
shapes, ms per product, panel / onednn / mkl / torch: qkv 0.35 / 0.48 / 0.68 / 0.69, o 0.22 /
0.30 / 0.43 / 0.41, gate_up 1.15 / 1.17 / 1.97 / 1.75, down 0.58 / 0.68 / 0.96 / 0.81 (about
200 GFLOP/s for panel, near the two cores' peak). With the weight in cache (one thread, 64 to
2048 rows) panel and onednn both run at 102-112 GFLOP/s, within 3% of each other; in the
engine, prefill chunks (2048 rows, two threads) ran 5-8% faster on onednn, and so did the
113 MB LM head at decode (18.2 ms against 20.2). The LM head stays on onednn; prefill chunks
take panel all the same: with them on onednn, a prompt prefilled by a disaggregated prefill
worker in small batches (panel) and by the offline engine in one large batch (onednn) got
different bits, and a service test saw an early greedy flip against the offline reference.

The choice is a fixed rule of the weight's dtype and shape, the token class and what this
build and CPU have (`rule_cpu_gemm`), never a timing: every process on a machine (a prefill
worker, a decode worker, an offline reference) multiplies the same weights by the same kernel
and gets the same numbers. Timing at load was tried and dropped: a choice that differed
between processes gave a disaggregated service a greedy flip against the offline engine.
(`panel`'s own result for a row does not depend on the other rows or the thread count: each
output sums k in a fixed order.)

    load:  CpuPackedLinearMethod.process_weights_after_loading
             -> CpuGemmPlan(weight, has_bias) -> rule_cpu_gemm(weight) per token class
             -> pack the weight once per chosen kernel
    step:  plan.linear(x, weight, bias) -> the kernel of x's token class (F.linear where the
           kernel cannot read x's layout); for an MLP's [gate | up] weight,
           plan.linear_silu_mul(x, weight, bias) -> silu(gate) * up from the kernel's fused
           form (`panel`: the two ops' bits, the [M, 2 d] product never written), None where
           it has none
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# What `--cpu-gemm` may name: "auto" is the rule; a kernel name forces it where it applies.
CPU_GEMM_CHOICES = ("auto", "torch", "mkl", "onednn", "panel")


# ---------------------------------------------------------------------------- kernels


class CpuGemm(ABC):
    """One way to compute `F.linear(x, weight, bias)` for a CPU `[N, K]` weight."""

    name: ClassVar[str]

    @abstractmethod
    def supports(self, weight: torch.Tensor) -> bool:
        """Whether this kernel can multiply by `weight` (its dtype, this build, this CPU)."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight in this kernel's layout, made once after loading (None: it reads the
        plain weight)."""
        return None

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` (2-D, the weight's dtype, on the CPU) has a layout this kernel reads."""
        return True

    @abstractmethod
    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, `packed` being `self.pack(weight)`."""

    def linear_silu_mul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """`silu_and_mul(self.linear(...))` for a `[gate | up]` weight, bit for bit, in one
        kernel; None where this kernel has no such form (the caller runs the two)."""
        return None


class TorchGemm(CpuGemm):
    """`F.linear`: the reference every other kernel is tested against."""

    name = "torch"

    def supports(self, weight: torch.Tensor) -> bool:
        return True

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)


class MklPackedGemm(CpuGemm):
    """MKL's packed sgemm (float32), where torch links MKL's packed API (x86 wheels)."""

    name = "mkl"

    def supports(self, weight: torch.Tensor) -> bool:
        if weight.dtype != torch.float32:
            return False
        from tandem_kernels import cpu

        return cpu.has_packed_sgemm()

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        from tandem_kernels import cpu

        return cpu.pack_linear_weight(weight.detach())

    def takes(self, x: torch.Tensor) -> bool:
        return x.stride(-1) == 1

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        from tandem_kernels import cpu

        assert packed is not None
        return cpu.packed_linear(x, packed, bias, weight.shape[0])


# The row count oneDNN is told to expect when it picks the float32 weight's blocked layout (a
# hint: the layout serves any count; measured as good as the 2048-row one at 8..2048 rows).
_ONEDNN_FP32_PACK_ROWS = 64


class OneDnnGemm(CpuGemm):
    """oneDNN's inner product over its blocked weight layout: float32 everywhere oneDNN is
    built in, bf16 where it runs bf16 natively."""

    name = "onednn"

    def supports(self, weight: torch.Tensor) -> bool:
        if weight.dtype == torch.bfloat16:
            return onednn_bf16()
        return weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        rows = _ONEDNN_FP32_PACK_ROWS if weight.dtype == torch.float32 else None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] > 0 and x.is_contiguous()

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PanelGemm(CpuGemm):
    """tandem's AVX-512 float32 panel kernel (decode-sized batches; see the module doc)."""

    name = "panel"

    def supports(self, weight: torch.Tensor) -> bool:
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[0] % 32:
            return False
        from tandem_kernels import cpu

        return cpu.has_panel_gemm()

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        from tandem_kernels import cpu

        return cpu.panel_pack_weight(weight.detach())

    def takes(self, x: torch.Tensor) -> bool:
        return x.stride(-1) == 1

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        from tandem_kernels import cpu

        assert packed is not None
        return cpu.panel_linear(x, packed, bias)

    def linear_silu_mul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor | None:
        from tandem_kernels import cpu

        assert packed is not None
        if weight.shape[0] % 64:  # gate and up each a whole number of panels
            return None
        return cpu.panel_linear_silu_mul(x, packed, bias)


CPU_GEMMS: dict[str, CpuGemm] = {
    g.name: g for g in (TorchGemm(), MklPackedGemm(), OneDnnGemm(), PanelGemm())
}


@functools.cache
def onednn_bf16() -> bool:
    """Whether this torch's oneDNN runs bf16 matmuls natively on this CPU."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


# ---------------------------------------------------------------------------- the rule


@dataclass(frozen=True)
class TokenClass:
    """Products of at most `max_rows` rows (and more than the previous class's)."""

    name: str
    max_rows: int


TOKEN_CLASSES: tuple[TokenClass, ...] = (
    TokenClass("single", 1),  # one decode row: a matrix-vector product, memory bound
    TokenClass("decode", 128),  # a decode batch: the weight read once, from DRAM
    TokenClass("prefill", 1 << 62),  # prompt chunks, big batches: the weight reused from cache
)


def token_class_index(rows: int) -> int:
    """The index in `TOKEN_CLASSES` of a product of `rows` rows."""
    for i, cls in enumerate(TOKEN_CLASSES):
        if rows <= cls.max_rows:
            return i
    return len(TOKEN_CLASSES) - 1


# The largest float32 weight `panel` takes (bytes): above it (an LM head over a large
# vocabulary) every class stays on oneDNN, measured faster there (SmolLM2's 113 MB tied LM
# head at a 64-row decode step: 18.2 ms against 20.2 in the engine).
_PANEL_MAX_BYTES = 64 << 20


def rule_cpu_gemm(weight: torch.Tensor) -> tuple[str, ...]:
    """The kernel of each token class for `weight` (see the module doc): a function of its
    dtype and shape and of what this build and CPU support, the same in every process.

    Float32: every class on `panel` where it is built (AVX-512), the weight has a multiple
    of 32 output features and is at most `_PANEL_MAX_BYTES`, so a row's product is the same
    whatever it is batched with (a prompt computed by a prefill worker and by the offline
    engine, in different batches, gives the same bits); the rest on `onednn`, `mkl` where
    oneDNN is missing, `torch` where both are. Bf16: `onednn` where it runs bf16 natively,
    else `torch`. Other dtypes: `torch`."""
    supported = {name for name, g in CPU_GEMMS.items() if g.supports(weight)}

    def first(*names: str) -> str:
        return next((n for n in names if n in supported), "torch")

    if weight.dtype != torch.float32:
        return (first("onednn"),) * len(TOKEN_CLASSES)
    large = first("onednn", "mkl")
    if weight.numel() * weight.element_size() > _PANEL_MAX_BYTES:
        return (large,) * len(TOKEN_CLASSES)
    return (first("panel", "onednn", "mkl"),) * len(TOKEN_CLASSES)


# ---------------------------------------------------------------------------- per weight


class CpuGemmPlan:
    """One CPU weight's product: the kernel per token class (`rule_cpu_gemm`, or forced by
    `cpu_gemm`) and the packed copies those kernels read. Made after loading; the weight
    itself is passed at each call (the plan keeps only packed copies)."""

    def __init__(self, weight: torch.Tensor, has_bias: bool, cpu_gemm: str = "auto") -> None:
        if cpu_gemm not in CPU_GEMM_CHOICES:
            raise ValueError(f"unknown CPU GEMM {cpu_gemm!r}; known: {CPU_GEMM_CHOICES}")
        names: tuple[str, ...]
        if weight.device.type != "cpu" or weight.dim() != 2:
            names = ("torch",) * len(TOKEN_CLASSES)
        elif cpu_gemm == "auto":
            names = rule_cpu_gemm(weight)
        else:
            forced = cpu_gemm if CPU_GEMMS[cpu_gemm].supports(weight) else "torch"
            names = (forced,) * len(TOKEN_CLASSES)
        self.kernels: tuple[CpuGemm, ...] = tuple(CPU_GEMMS[n] for n in names)
        self.packed: dict[str, torch.Tensor | None] = {
            g.name: g.pack(weight) for g in {g.name: g for g in self.kernels}.values()
        }
        logger.debug(
            "CPU GEMM %s %s%s: %s",
            list(weight.shape),
            str(weight.dtype).removeprefix("torch."),
            " + bias" if has_bias else "",
            ", ".join(f"{c.name} {n}" for c, n in zip(TOKEN_CLASSES, names, strict=True)),
        )

    @property
    def kernel_names(self) -> tuple[str, ...]:
        """The kernel of each token class, in `TOKEN_CLASSES` order."""
        return tuple(g.name for g in self.kernels)

    def kernel_for(self, rows: int) -> CpuGemm:
        return self.kernels[token_class_index(rows)]

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)` through the kernel of `x`'s token class; `F.linear`
        where `x` is not 2-D CPU rows of the weight's dtype in a layout the kernel reads."""
        kernel = self._kernel_taking(x, weight)
        if kernel is None:
            return F.linear(x, weight, bias)
        return kernel.linear(x, weight, self.packed[kernel.name], bias)

    def linear_silu_mul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`silu_and_mul(self.linear(x, weight, bias))` for a `[gate | up]` weight in one
        kernel, where the kernel of `x`'s token class has that form (`panel`: the same bits
        as the two ops, without the `[M, 2 d]` product); None elsewhere."""
        kernel = self._kernel_taking(x, weight)
        if kernel is None:
            return None
        return kernel.linear_silu_mul(x, weight, self.packed[kernel.name], bias)

    def _kernel_taking(self, x: torch.Tensor, weight: torch.Tensor) -> CpuGemm | None:
        """The kernel of `x`'s token class, if `x` is 2-D CPU rows of the weight's dtype in a
        layout it reads; None otherwise."""
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype != weight.dtype:
            return None
        kernel = self.kernels[token_class_index(x.shape[0])]
        return kernel if kernel.takes(x) else None
