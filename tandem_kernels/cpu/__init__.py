"""CPU kernels of the step path, a C++ extension built on first use (JIT, the system compiler).

`cpu_ops.cpp` registers torch ops in the `tandem_cpu` namespace; the wrappers below state their
contracts. `available()` builds (or loads the cached build of) the extension once per process
and says whether it can be used; without a C++ compiler the engine keeps the pure-torch path.

- `rms_norm(x [T, H], weight, eps)` and `fused_add_rms_norm(x, residual, weight, eps)`
  (residual += x in place, returns the normed rows): as `tandem.layers.norm`;
- `rotary_qkv_cache(qkv [T, (H + 2 KVH) D], positions, cos, sin, kv_cache, slot_mapping, ...)`:
  splits the fused projection, rotates Q and K (as `tandem.layers.rotary`), writes K/V of every
  token with a slot >= 0 into the paged cache, returns (q, k, v) contiguous;
- `paged_attention(query [T, H, D], kv_cache, block_table, seq_lens, query_start_loc, scale)`:
  causal attention of each request's query rows over its cached context, read where the blocks
  are (no gather, no padding); see `tandem.layers.attention.backend` for the layout;
- `pack_linear_weight(weight [N, K] float32)` and `packed_linear(x [M, K], packed, bias, n)`:
  `F.linear` through MKL's packed sgemm, the weight packed once (MKL's plain sgemm repacks the
  weight on every call, most of a decode-sized product's time); `has_packed_sgemm()` says
  whether this torch build exports MKL's packed API (x86 wheels do);
- `silu_and_mul(x [T, 2 D])`: `silu(gate) * up` in one pass, as `tandem.layers.activation`;
- `panel_pack_weight(weight)`, `panel_linear(x, packed, bias)`: the AVX-512 float32 panel
  GEMM (tandem.layers.cpu_gemm); `panel_linear_silu_mul(x, packed, bias)`: a `[gate | up]`
  weight's product with `silu_and_mul` applied as it is stored (bit for bit the two ops);
- `argmax_rows(x [N, V] float32)`: `torch.argmax(x, -1)` (first maximum; first NaN), rows
  split among the threads;
- `bind_threads(cores)`: one OpenMP thread per core, thread i bound to `cores[i]`.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.cpp")


_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# The build's marker, written (atomically) once a build has finished: a `.so` without it may be
# a link that was cut short.
_DONE = "tandem_build_done"


def _cpu_tag() -> str:
    """A short hash of this CPU's model and flags: builds with -march=native differ per CPU."""
    text = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        text += "".join(ln for ln in lines if ln.startswith(("model name", "flags")))[:4096]
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _flags() -> list[str]:
    flags = list(_FLAGS)
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return flags


def extension_name() -> str:
    """The build's name: one per CPU, source text, flags and torch version, so a cached build
    is loaded only where it was made from the same inputs."""
    text = "|".join([_cpu_tag(), _SOURCE.read_text(), " ".join(_flags()), torch.__version__])
    return f"tandem_cpu_ops_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Where the build of `name` lives, under the root of torch's extension builds
    (`TORCH_EXTENSIONS_DIR` or ~/.cache/torch_extensions)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache/torch_extensions")
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name


def _load_finished(name: str, where: Path) -> bool:
    """Load the finished build of `name` (no lock, no compiler run); False when there is none
    or its library will not load."""
    library = where / f"{name}.so"
    if not (where / _DONE).exists() or not library.exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        logger.warning("the cached CPU extension did not load (%s): linking it again", exc)
        return False
    return True


def _build(name: str, where: Path) -> None:
    """Build (or bring up to date) and load the extension, one process at a time.

    torch's `load()` guards its build with a lock *file* that every caller creates, even when
    the build is current, and that a process killed inside `load()` leaves behind: every later
    `load()` of the name then waits forever. Builders here hold an `flock` first (the kernel
    drops it when its holder dies), so a lock file found under the flock is a dead process's
    and is removed. The library is linked again from its objects (a cut-short or broken one
    goes)."""
    from torch.utils.cpp_extension import load

    where.mkdir(parents=True, exist_ok=True)
    with open(where / "tandem.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            if _load_finished(name, where):  # built while this process waited
                return
            (where / _DONE).unlink(missing_ok=True)
            (where / f"{name}.so").unlink(missing_ok=True)
            stale = where / "lock"
            if stale.exists():
                logger.warning("removing a stale build lock left by a killed process: %s", stale)
                stale.unlink(missing_ok=True)
            load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(where),
                is_python_module=False,
                verbose=False,
            )
            tmp = where / f"{_DONE}.{os.getpid()}"
            tmp.write_text(name)
            tmp.replace(where / _DONE)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


@functools.cache
def available() -> bool:
    """Build or load the extension (once per process); False, with a warning, if it cannot.

    A finished build is loaded directly; otherwise `_build`."""
    try:
        name = extension_name()
        where = build_directory(name)
        if not _load_finished(name, where):
            _build(name, where)
    except Exception as exc:  # no compiler, no headers, a failed build
        logger.warning("CPU kernels unavailable (%s): the pure-torch CPU path runs", exc)
        return False
    return True


def _ops() -> object:
    if not available():
        raise RuntimeError("the tandem CPU extension could not be built (see the log)")
    return torch.ops.tandem_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops().rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` in place; returns `(rms_norm(residual), residual)`."""
    return _ops().fused_add_rms_norm(x, residual, weight, eps), residual


def rotary_qkv_cache(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D], rows contiguous
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [P, D / 2] float32
    sin_cache: torch.Tensor,  # [P, D / 2] float32
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D] or empty (no write)
    slot_mapping: torch.Tensor,  # [>= T] int64; slot < 0: not written
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _ops().rotary_qkv_cache(
        qkv, positions, cos_cache, sin_cache, kv_cache, slot_mapping,
        num_heads, num_kv_heads, head_size,
    )  # fmt: skip
    return q, k, v


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged attention read in place (query row j of request r at position
    `seq_lens[r] - q_len + j`); with `sliding_window` W it sees the last W positions only and
    reads no block left of them."""
    return _ops().paged_attention(
        query, kv_cache, block_table, seq_lens, query_start_loc, scale, sliding_window or 0
    )


@functools.cache
def has_packed_sgemm() -> bool:
    """Whether MKL's packed sgemm is there (the extension built, torch linked with MKL)."""
    return available() and bool(_ops().has_packed_sgemm())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (float32 `[N, K]`, an `nn.Linear` weight) in MKL's packed form: an opaque
    float32 buffer that only `packed_linear` reads (about the weight's own size)."""
    return _ops().sgemm_pack_weight(weight.contiguous())


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 `x [M, K]` (rows contiguous), `packed` made by
    `pack_linear_weight(weight)`."""
    return _ops().packed_linear(x, packed, bias, out_features)


def has_panel_gemm() -> bool:
    """Whether the panel GEMM (`panel_linear`, AVX-512) was built for this CPU."""
    return available() and bool(_ops().has_panel_gemm())


def panel_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (float32 `[N, K]`, N a multiple of 32) as `[N / 32, K, 32]` panels of 32 output
    features, the layout `panel_linear` reads."""
    return _ops().panel_pack_weight(weight)


def panel_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 `x [M, K]` (rows contiguous), `packed` made by
    `panel_pack_weight(weight)`: each output one multiply-add chain over k in order."""
    return _ops().panel_linear(x, packed, bias)


def panel_linear_silu_mul(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`silu_and_mul(panel_linear(x, packed, bias))` bit for bit, in one pass that never writes
    the `[M, 2 d]` product: `packed` is a `[gate | up]` weight `[2 d, K]` (d a multiple of 32)
    made by `panel_pack_weight`."""
    return _ops().panel_linear_silu_mul(x, packed, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[:, :d]) * x[:, d:]` for `x [T, 2 d]` with rows contiguous, one pass."""
    return _ops().silu_and_mul(x)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)` (int64 `[N]`) for float32 `x [N, V]`, rows contiguous."""
    return _ops().argmax_rows(x)


@dataclass(frozen=True)
class DecoderStackWeights:
    """What `decoder_stack` reads of each layer, one entry per layer: the two norms' weights,
    and the panel-packed (`panel_pack_weight`) bias-free projections (`gate_up` a
    `[gate | up]` weight); `cos_cache` / `sin_cache` float32 `[P, D / 2]`."""

    input_norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_size: int
    eps: float
    scale: float


def decoder_stack(
    w: DecoderStackWeights,
    hidden: torch.Tensor,  # [T, hidden] float32, rows contiguous
    residual: torch.Tensor | None,  # None before the first layer (it is then `hidden`)
    positions: torch.Tensor,  # [T] int64
    kv_caches: list[torch.Tensor],  # one [num_blocks, 2, block_size, KVH, D] per layer
    slot_mapping: torch.Tensor,  # [>= T] int64
    block_table: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32, its last entry T
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama decoder layers (norm, fused QKV, rotary and K/V write, paged attention, output
    projection, add and norm, gate/up with SiLU, down) in one call: the same kernels, in the
    order and with the arguments the layer modules give them, so the same bits, without the
    Python between them. Returns `(hidden, residual)` after the last layer; `residual` is
    updated in place as `fused_add_rms_norm` does."""
    out = _ops().decoder_stack(
        hidden, residual, positions, w.cos_cache, w.sin_cache, w.input_norms, w.qkv, w.o,
        w.post_norms, w.gate_up, w.down, kv_caches, slot_mapping, block_table, seq_lens,
        query_start_loc, w.num_heads, w.num_kv_heads, w.head_size, w.eps, w.scale,
    )  # fmt: skip
    return out[0], out[1]


def bind_threads(cores: list[int]) -> list[int]:
    """Bind OpenMP thread i to `cores[i]` (the pool becomes `len(cores)` threads); returns the
    core each thread runs on afterwards."""
    return list(_ops().bind_threads(cores))
