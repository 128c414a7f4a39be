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
row, a decode batch, a prefill chunk) every candidate runs a few products, on one thread, at
the class's probe row count on random data of the weight's shape; the fastest wins. Choices
are cached for the process by (shape, dtype, bias), so the 30 layers of one shape measure
once, and logged. `CpuGemmPlan` holds one weight's choices and the packed copies they need.

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
    TokenClass("prefill", 1 << 62, 128),  # prompt chunks, big batches
)

# The most floating-point operations one probe product may take (about 5 ms on one core): the
# LM head's probes run fewer rows than the class's (and its classes share one probe).
_PROBE_FLOPS = 1 << 29
# Each probe times every candidate in turn, round after round, for at least `_PROBE_MIN_S`
# and `_PROBE_MIN_REPS` rounds, and stops at `_PROBE_MAX_REPS` rounds or past `_PROBE_MAX_S`
# (one round at least); the minimum counts, the product least disturbed by other processes.
_PROBE_MIN_REPS = 3
# A kernel within this factor of a class's fastest counts as as fast (see `pick_kernels`).
_NEAR = 1.1
_PROBE_MAX_REPS = 20
_PROBE_MIN_S = 0.02
_PROBE_MAX_S = 0.1


def token_class_index(rows: int) -> int:
    """The index in `TOKEN_CLASSES` of a product of `rows` rows."""
    for i, cls in enumerate(TOKEN_CLASSES):
        if rows <= cls.max_rows:
            return i
    return len(TOKEN_CLASSES) - 1


@dataclass(frozen=True)
class GemmChoice:
    """The kernel each token class takes for one weight shape, and what was measured:
    `timings[i]` maps kernel name -> seconds per product at `probe_rows[i]` rows."""

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
    out_features: int, in_features: int, dtype: torch.dtype, has_bias: bool
) -> GemmChoice:
    """Measure every kernel that supports an `[out_features, in_features]` weight of `dtype`
    at each token class's probe rows and pick the fastest per class. Cached per process.

    Measured on one thread: what differs between the libraries is their kernels' speed on
    this CPU's cores, and a product split over threads waits at its barrier for a thread
    another process has descheduled, which on a busy machine decides more than the kernel
    (measured: 25-90 ms for a 0.5 ms product at a load average of 10 on two cores); on one
    thread the product's CPU time is its own, descheduled or not. The data is random (a
    private generator: the global RNG is not drawn from); the candidates run in turn, round
    after round, so what other processes do to the caches falls on all of them."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.empty(out_features, in_features).uniform_(-0.05, 0.05, generator=gen)
    weight = weight.to(dtype)
    bias = torch.empty(out_features).uniform_(-1, 1, generator=gen).to(dtype) if has_bias else None
    kernels = [g for g in CPU_GEMMS.values() if g.supports(weight)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        packed = {g.name: g.pack(weight) for g in kernels}
        by_rows: dict[int, dict[str, float]] = {}
        for cls in TOKEN_CLASSES:
            rows = probe_rows(cls, out_features, in_features)
            if rows not in by_rows:
                x = torch.empty(rows, in_features).uniform_(-1, 1, generator=gen).to(dtype)
                by_rows[rows] = _probe(kernels, x, weight, packed, bias)
    finally:
        torch.set_num_threads(threads)
    rows_measured = tuple(probe_rows(c, out_features, in_features) for c in TOKEN_CLASSES)
    timings = tuple(by_rows[r] for r in rows_measured)
    chosen = pick_kernels(timings)
    choice = GemmChoice(out_features, in_features, dtype, chosen, timings, rows_measured)
    logger.info(
        "CPU GEMM [%d, %d] %s%s: %s",
        out_features,
        in_features,
        str(dtype).removeprefix("torch."),
        " + bias" if has_bias else "",
        choice.describe(),
    )
    return choice


def pick_kernels(timings: tuple[dict[str, float], ...]) -> tuple[str, ...]:
    """The kernel of each token class from its measured `timings` (kernel -> seconds).

    Each class takes its fastest kernel, except that a kernel within `_NEAR` of the fastest
    is taken instead when it costs no extra copy of the weight: `torch` (the plain weight) or
    a kernel a larger class already took. Classes are settled largest first (their products
    are most of the work). So a weight holds at most one packed copy unless a second one is
    worth more than `_NEAR`, and a near tie measured on a busy machine does not flip the
    choice from one process to the next."""
    chosen: list[str] = [""] * len(timings)
    held: set[str] = {"torch"}
    for i in reversed(range(len(timings))):
        times = timings[i]
        fastest = min(times, key=lambda name: (times[name], name != "torch"))
        near = [name for name in times if times[name] <= times[fastest] * _NEAR]
        cheap = [name for name in near if name in held]
        chosen[i] = min(cheap, key=times.__getitem__) if cheap else fastest
        held.add(chosen[i])
    return tuple(chosen)


def _probe(
    kernels: list[CpuGemm],
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: dict[str, torch.Tensor | None],
    bias: torch.Tensor | None,
) -> dict[str, float]:
    """Seconds per product of each kernel on `x` (the least of its timed runs), in this
    thread's CPU time: on one thread that is the product's own time, whatever else runs."""
    best = {g.name: float("inf") for g in kernels}
    for g in kernels:  # untimed: primitive creation, first touch of the packed weight
        g.linear(x, weight, packed[g.name], bias)
    start = time.perf_counter()
    for rep in range(_PROBE_MAX_REPS):
        elapsed = time.perf_counter() - start
        if rep > 0 and elapsed > _PROBE_MAX_S:
            break
        if rep >= _PROBE_MIN_REPS and elapsed > _PROBE_MIN_S:
            break
        for g in kernels:
            t0 = time.thread_time()
            g.linear(x, weight, packed[g.name], bias)
            best[g.name] = min(best[g.name], time.thread_time() - t0)
    return best


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
        supported = [g for g in CPU_GEMMS.values() if g.supports(weight)]
        if weight.device.type != "cpu" or weight.dim() != 2 or len(supported) == 1:
            names = ("torch",) * len(TOKEN_CLASSES)  # nothing to measure
        elif cpu_gemm == "auto":
            self.choice = choose_cpu_gemm(weight.shape[0], weight.shape[1], weight.dtype, has_bias)
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
