"""The CPU step path's GEMMs, picked per weight shape and token count by measurement.

A CPU linear layer's product can go through several libraries, and which is fastest depends
on the CPU, the weight's shape and the number of rows:

- `torch`: `F.linear` (MKL's sgemm for float32 on x86 wheels; it repacks the weight on every
  call, most of a decode-sized product's time);
- `mkl`: MKL's packed sgemm, the weight packed once (float32; tandem_kernels.cpu);
- `onednn`: oneDNN's inner product over a weight reordered once into its blocked layout
  (torch's `mkldnn._reorder_linear_weight` / `_linear_pointwise`; float32, and bf16 where
  oneDNN does bf16 natively: avx512_bf16 or AMX). Float32 stays float32 (no bf16 inside).

MKL dispatches by CPU vendor: on AMD it runs its generic AVX2 kernels, at 60-90 GFLOP/s a Zen 4
core at the embedded model's shapes, where oneDNN's AVX-512 brgemm kernels reach 95-110; on
Intel MKL runs its own AVX-512 / AMX kernels. So no fixed choice serves both, and each process
measures (`choose_cpu_gemm`): for each weight shape and each token class (`TOKEN_CLASSES`: one
row, a decode batch, a prefill chunk) every candidate runs a few products at the class's probe
row count on random data of the weight's shape; the fastest wins. Choices are cached for the
process by (shape, dtype, bias, thread count), so the 30 layers of one shape measure once, and
logged. `CpuGemmPlan` holds one weight's choices and the packed copies they need.

    load:  CpuPackedLinearMethod.process_weights_after_loading
             -> CpuGemmPlan(weight, has_bias)  -> choose_cpu_gemm(N, K, dtype, ...)   (cached)
             -> pack the weight once per chosen kernel
    step:  plan.linear(x, weight, bias) -> the kernel of x's token class (F.linear where the
           kernel cannot read x's layout)
"""

from __future__ import annotations

import functools
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# What `--cpu-gemm` may name: "auto" measures; a kernel name forces it where it applies.
CPU_GEMM_CHOICES = ("auto", "torch", "mkl", "onednn")


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


CPU_GEMMS: dict[str, CpuGemm] = {g.name: g for g in (TorchGemm(), MklPackedGemm(), OneDnnGemm())}


@functools.cache
def onednn_bf16() -> bool:
    """Whether this torch's oneDNN runs bf16 matmuls natively on this CPU."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


# ---------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class TokenClass:
    """Products of at most `max_rows` rows (and more than the previous class's), measured at
    `probe_rows` rows (fewer where one probe product would pass `_PROBE_FLOPS`)."""

    name: str
    max_rows: int
    probe_rows: int


TOKEN_CLASSES: tuple[TokenClass, ...] = (
    TokenClass("single", 1, 1),  # one decode row: a matrix-vector product, memory bound
    TokenClass("decode", 128, 64),  # a decode batch
    TokenClass("prefill", 1 << 62, 256),  # prompt chunks, big batches
)

# The most floating-point operations one probe product may take (about 10 ms on one core): the
# LM head's probes run fewer rows than the class's.
_PROBE_FLOPS = 1 << 30
# Timed products per candidate and class, after one untimed one; the minimum counts (the least
# disturbed by other processes).
_PROBE_REPS = 3


def token_class_index(rows: int) -> int:
    """The index in `TOKEN_CLASSES` of a product of `rows` rows."""
    for i, cls in enumerate(TOKEN_CLASSES):
        if rows <= cls.max_rows:
            return i
    return len(TOKEN_CLASSES) - 1


@dataclass(frozen=True)
class GemmChoice:
    """The kernel each token class takes for one weight shape, and what was measured:
    `timings[i]` maps kernel name -> seconds per product at class i's probe rows."""

    out_features: int
    in_features: int
    dtype: torch.dtype
    kernels: tuple[str, ...]
    timings: tuple[dict[str, float], ...]
    probe_rows: tuple[int, ...]

    def describe(self) -> str:
        parts = []
        for cls, kernel, rows, times in zip(
            TOKEN_CLASSES, self.kernels, self.probe_rows, self.timings, strict=True
        ):
            measured = ", ".join(f"{k} {t * 1e3:.3f}" for k, t in sorted(times.items()))
            parts.append(f"{cls.name} ({rows} rows): {kernel} [{measured} ms]")
        return "; ".join(parts)


def probe_rows(cls: TokenClass, out_features: int, in_features: int) -> int:
    """The row count `cls` is measured at for an `[out_features, in_features]` weight."""
    cap = _PROBE_FLOPS // max(1, 2 * out_features * in_features)
    return max(1, min(cls.probe_rows, cap))


@functools.cache
def choose_cpu_gemm(
    out_features: int, in_features: int, dtype: torch.dtype, has_bias: bool, num_threads: int
) -> GemmChoice:
    """Measure every kernel that supports an `[out_features, in_features]` weight of `dtype`
    at each token class's probe rows and pick the fastest per class. Cached per process;
    `num_threads` (torch's, at the call) is part of the key, as the answer depends on it.

    The data is random (a private generator: the global RNG is not drawn from); candidates
    run in turn, round after round, so a burst of load from other processes falls on all."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if has_bias else None
    kernels = [g for g in CPU_GEMMS.values() if g.supports(weight)]
    packed = {g.name: g.pack(weight) for g in kernels}
    chosen: list[str] = []
    timings: list[dict[str, float]] = []
    rows_measured: list[int] = []
    for cls in TOKEN_CLASSES:
        rows = probe_rows(cls, out_features, in_features)
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        best = {g.name: float("inf") for g in kernels}
        for g in kernels:  # untimed: primitive creation, first touch of the packed weight
            g.linear(x, weight, packed[g.name], bias)
        for _ in range(_PROBE_REPS):
            for g in kernels:
                start = time.perf_counter()
                g.linear(x, weight, packed[g.name], bias)
                best[g.name] = min(best[g.name], time.perf_counter() - start)
        # Ties (within timer noise) go to the earlier kernel in CPU_GEMMS: torch first.
        chosen.append(min(kernels, key=lambda g: best[g.name]).name)
        timings.append(best)
        rows_measured.append(rows)
    choice = GemmChoice(
        out_features, in_features, dtype, tuple(chosen), tuple(timings), tuple(rows_measured)
    )
    logger.info(
        "CPU GEMM [%d, %d] %s%s, %d threads: %s",
        out_features,
        in_features,
        str(dtype).removeprefix("torch."),
        " + bias" if has_bias else "",
        num_threads,
        choice.describe(),
    )
    return choice


# ---------------------------------------------------------------------------- per weight


class CpuGemmPlan:
    """One CPU weight's product: the kernel per token class (measured, `choose_cpu_gemm`, or
    forced by `cpu_gemm`) and the packed copies those kernels read. Made after loading; the
    weight itself is passed at each call (the plan keeps only packed copies)."""

    def __init__(self, weight: torch.Tensor, has_bias: bool, cpu_gemm: str = "auto") -> None:
        if cpu_gemm not in CPU_GEMM_CHOICES:
            raise ValueError(f"unknown CPU GEMM {cpu_gemm!r}; known: {CPU_GEMM_CHOICES}")
        self.choice: GemmChoice | None = None
        names: tuple[str, ...]
        if weight.device.type != "cpu" or weight.dim() != 2:
            names = ("torch",) * len(TOKEN_CLASSES)
        elif cpu_gemm == "auto":
            self.choice = choose_cpu_gemm(
                weight.shape[0], weight.shape[1], weight.dtype, has_bias, torch.get_num_threads()
            )
            names = self.choice.kernels
        else:
            forced = cpu_gemm if CPU_GEMMS[cpu_gemm].supports(weight) else "torch"
            names = (forced,) * len(TOKEN_CLASSES)
        self.kernels: tuple[CpuGemm, ...] = tuple(CPU_GEMMS[n] for n in names)
        self.packed: dict[str, torch.Tensor | None] = {
            g.name: g.pack(weight) for g in {g.name: g for g in self.kernels}.values()
        }

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
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        kernel = self.kernels[token_class_index(x.shape[0])]
        if not kernel.takes(x):
            return F.linear(x, weight, bias)
        return kernel.linear(x, weight, self.packed[kernel.name], bias)
