"""The KV connector interface and the block-run arithmetic every transport shares.

The KV cache is indexed `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`.
On a GPU it is stored so: one block's KV over all layers is one contiguous span, and so is a
run of consecutive block ids. The CPU engine stores it layer-major (the tensor is a transposed
view, `tandem.worker.cpu_memory.layer_major_kv_cache`): a block is one piece per layer, and
what moves blocks gathers and scatters them. On the wire a block is always its
`KVLayout.block_shape` in C order, whatever the storage. A transfer copies the prompt's
blocks of the prefill engine, in block table order, into the blocks the decode engine
reserved::

    prefill block table   [ 7  3  4 12 ]      (held after the prefill finished)
    decode reservation    [20 21 22 30 ]      -> runs (20, 3 blocks) and (30, 1 block)

A run is defined by its destination blocks; its source blocks are gathered.

Ownership: the engine (in its own process) owns block allocation; `reserve` and `release` go
through its client. The bytes of held blocks (prefill side) and reserved blocks (decode side)
belong to no running request, so this process reads and writes them in the shared KV cache
while the engine keeps stepping.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tandem.request import EngineCoreRequest

# Bytes per transfer message; a run longer than this is split (one block at least).
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class KVTransferError(RuntimeError):
    """A transfer failed or was refused; the message says why."""


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one KV cache block; sender and receiver must agree.

    An engine of several ranks (tensor / pipeline parallel) has one cache per rank, each
    holding its share of every block (its KV heads, its stage's layers); `num_ranks` > 1 says
    a block's bytes are those shares in rank order, each of `block_shape`."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    num_ranks: int = 1

    @classmethod
    def of(cls, kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> KVLayout:
        caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else list(kv_cache)
        first = caches[0]
        if first.dim() != 6 or first.shape[2] != 2:
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_size], got {tuple(first.shape)}"
            )
        for other in caches[1:]:
            if other.shape != first.shape or other.dtype != first.dtype:
                raise ValueError(
                    "the ranks' KV caches differ in shape or dtype "
                    f"({tuple(first.shape)} {first.dtype} vs {tuple(other.shape)} "
                    f"{other.dtype}): their blocks cannot move as one"
                )
        _, num_layers, _, block_size, num_kv_heads, head_size = first.shape
        return cls(
            num_layers,
            block_size,
            num_kv_heads,
            head_size,
            str(first.dtype).split(".")[-1],
            num_ranks=len(caches),
        )

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One rank's share of a block."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_size)

    @functools.cached_property
    def rank_bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return int(np.prod(self.block_shape)) * itemsize

    @functools.cached_property
    def bytes_per_block(self) -> int:
        # Cached: a session asks once per request (cached_property writes the instance's
        # __dict__, so the frozen dataclass's fields, equality and hash are untouched).
        return self.rank_bytes_per_block * self.num_ranks


@dataclass(frozen=True)
class KVDestination:
    """The decode engine's reserved blocks for one request, and how to reach them."""

    worker_id: str
    address: str
    block_ids: tuple[int, ...]
    # The transport the scheduler chose for the pair ("tcp", "cuda_ipc", "nccl", "inproc").
    transport: str = "tcp"


@dataclass(frozen=True)
class BlockRun:
    """`num_blocks` consecutive destination blocks from `first_block_id`, as raw bytes."""

    request_id: str
    first_block_id: int
    num_blocks: int
    data: bytes


def block_runs(dst_block_ids: Sequence[int], max_blocks: int) -> list[tuple[int, int, int]]:
    """Split a destination block list into runs of consecutive ids, at most `max_blocks` long.

    Returns (position in `dst_block_ids`, first block id, number of blocks) per run.
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    n = len(dst_block_ids)
    if n == 0:
        return []
    first = dst_block_ids[0]
    if dst_block_ids[-1] - first == n - 1 and list(dst_block_ids) == list(range(first, first + n)):
        # One stretch (a fresh pool's reservation): compared in C, cut by max_blocks.
        return [(i, first + i, min(max_blocks, n - i)) for i in range(0, n, max_blocks)]
    runs: list[tuple[int, int, int]] = []
    start = 0
    prev = first
    for i in range(1, n):
        b = dst_block_ids[i]
        if b != prev + 1 or i - start == max_blocks:
            runs.append((start, dst_block_ids[start], i - start))
            start = i
        prev = b
    runs.append((start, dst_block_ids[start], n - start))
    return runs


def check_runs(runs: Sequence[tuple[int, int]], reserved: Sequence[int], request_id: str) -> int:
    """Raise KVTransferError unless every (first block id, number of blocks) run is non-empty,
    inside the reservation and apart from the others; returns the number of blocks."""
    whole = isinstance(reserved, range) and reserved.step == 1
    allowed: set[int] | None = None if whole else set(reserved)
    total = 0
    seen: set[int] = set()
    for first, n in runs:
        blocks = range(first, first + n)
        if allowed is None:
            inside = reserved[0] <= first and first + n <= reserved[-1] + 1 if reserved else False
        else:
            inside = allowed.issuperset(blocks)
        if n < 1 or not inside or (total and not seen.isdisjoint(blocks)):
            raise KVTransferError(
                f"blocks {first}..{first + n - 1} are not reserved for request {request_id!r}"
            )
        if len(runs) > 1:
            seen.update(blocks)
        total += n
    return total


class EngineHandle(Protocol):
    """What a connector needs from the engine's client (an AsyncMPClient): the block
    allocation calls, and how other processes open the engine's KV cache."""

    async def reserve(self, request: EngineCoreRequest) -> tuple[list[int], int] | None: ...

    async def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    def kv_cache_ipc_handle(self) -> tuple[Any, ...] | None: ...


class DirectEngine:
    """An `EngineHandle` with no engine, for benchmarks and tests: the cache belongs to this
    process (movers export it themselves), and there are no blocks to allocate."""

    async def reserve(self, request: EngineCoreRequest) -> tuple[list[int], int] | None:
        raise RuntimeError("a standalone connector has no engine to reserve blocks in")

    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        return None

    def kv_cache_ipc_handle(self) -> tuple[Any, ...] | None:
        return None


class KVCacheView:
    """Byte-level reads and writes of whole blocks of one KV cache tensor (on the host), or of
    several ranks' caches as one (see `KVLayout.num_ranks`): a run's bytes are each rank's
    bytes of the run, in rank order."""

    def __init__(self, kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> None:
        caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else list(kv_cache)
        self.layout = KVLayout.of(caches)
        self.kv_cache = caches[0]
        self.num_blocks = caches[0].shape[0]
        self.ranks = [_RankView(c, self.layout) for c in caches]

    def _check(self, block_ids: Sequence[int]) -> None:
        if any(b < 0 or b >= self.num_blocks for b in block_ids):
            raise KVTransferError(f"block ids out of range [0, {self.num_blocks}): {block_ids}")

    def read(self, block_ids: Sequence[int]) -> bytes:
        """The bytes of `block_ids`, concatenated in that order (per rank, in rank order)."""
        self._check(block_ids)
        if len(self.ranks) == 1:
            return self.ranks[0].read(block_ids)
        return b"".join(rank.read(block_ids) for rank in self.ranks)

    def write(self, first_block_id: int, num_blocks: int, data: bytes) -> None:
        """Overwrite blocks `first_block_id ..+num_blocks` with `data`."""
        self._check([first_block_id, first_block_id + num_blocks - 1])
        expected = num_blocks * self.layout.bytes_per_block
        if len(data) != expected:
            raise KVTransferError(
                f"a run of {num_blocks} blocks needs {expected} bytes, got {len(data)}"
            )
        share = num_blocks * self.layout.rank_bytes_per_block
        view = memoryview(data)
        for i, rank in enumerate(self.ranks):
            rank.write(first_block_id, num_blocks, view[i * share : (i + 1) * share])


class _RankView:
    """One rank's cache: its blocks' bytes, each block its `block_shape` in C order whatever
    the cache's strides (a layer-major CPU cache's block is gathered on read, scattered on
    write)."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.num_blocks = kv_cache.shape[0]
        # On the host: the cache's own memory as bytes, `[num_blocks, ..., head_size *
        # itemsize]` with the cache's strides. Never reshaped: numpy's reshape of a
        # non-contiguous array is a copy, and writes into it would be lost.
        self._bytes: np.ndarray | None = (
            kv_cache.view(torch.uint8).numpy() if kv_cache.device.type == "cpu" else None
        )

    def read(self, block_ids: Sequence[int]) -> bytes:
        if self._bytes is not None:
            first = block_ids[0]
            if list(block_ids) == list(range(first, first + len(block_ids))):
                return self._bytes[first : first + len(block_ids)].tobytes()
            return self._bytes[np.asarray(block_ids)].tobytes()
        idx = torch.as_tensor(list(block_ids), device=self.kv_cache.device)
        blocks = self.kv_cache.index_select(0, idx).contiguous().cpu()
        return blocks.view(torch.uint8).numpy().tobytes()

    def write(self, first_block_id: int, num_blocks: int, data: bytes | memoryview) -> None:
        if self._bytes is not None:
            dst = self._bytes[first_block_id : first_block_id + num_blocks]
            dst[...] = np.frombuffer(data, dtype=np.uint8).reshape(dst.shape)
            return
        src = np.frombuffer(data, dtype=np.uint8).reshape(num_blocks, -1)
        host = torch.from_numpy(src.copy()).view(self.kv_cache.dtype)
        self.kv_cache[first_block_id : first_block_id + num_blocks].copy_(
            host.view(num_blocks, *self.layout.block_shape)
        )


def check_fits(src_block_ids: Sequence[int], dst: KVDestination) -> None:
    """Every connector's first check of a send: the source blocks fit the reservation."""
    if len(src_block_ids) > len(dst.block_ids):
        raise KVTransferError(f"{len(src_block_ids)} blocks to send, {len(dst.block_ids)} reserved")


class KVConnector(abc.ABC):
    """Moves one request's prompt KV from a prefill engine's held blocks into the blocks a
    decode engine reserved for it.

    Decode side: `reserve` (blocks for the prompt, or None when the pool is short), then
    `receive` for every incoming run, then the worker adds the request to its running batch;
    `release` drops a reservation that will not be used. Prefill side: `send_blocks` after the
    prefill finished with its KV held, then `release` frees the held blocks.
    """

    def __init__(
        self, kv_cache: torch.Tensor | Sequence[torch.Tensor], engine: EngineHandle
    ) -> None:
        self.cache = KVCacheView(kv_cache)
        self.layout = self.cache.layout
        self.engine = engine

    async def reserve(self, request: EngineCoreRequest) -> list[int] | None:
        return await self.engine.reserve(request)

    def receive(self, run: BlockRun, reserved_block_ids: Sequence[int]) -> None:
        """Write one run into blocks that must belong to the request's reservation."""
        check_runs([(run.first_block_id, run.num_blocks)], reserved_block_ids, run.request_id)
        self.cache.write(run.first_block_id, run.num_blocks, run.data)

    async def release(self, request_id: str) -> None:
        """Free the request's held (prefill) or reserved (decode) blocks here."""
        await self.engine.abort_requests([request_id])

    @abc.abstractmethod
    async def send_blocks(
        self, request_id: str, src_block_ids: Sequence[int], dst: KVDestination
    ) -> int:
        """Copy `src_block_ids` (this engine's) into `dst.block_ids` in order; returns the
        bytes moved. Raises KVTransferError."""
