"""CUDA IPC KV connector: the prefill worker writes straight into the decode worker's KV cache.

The decode worker shares its cache tensor's CUDA IPC handle once per prefill worker
(`ConnectKV`, on the engine thread: sharing re-wraps the storage's data pointer); the prefill
worker opens it (same host, the GPU found by UUID) and keeps it open. Per write session (one
request, or every request bound for that decode worker that was ready at once), on the
connector's own CUDA stream:

    src (held):  7 8 9 | 3 | 12 13 14 15 ...     dst runs:  [20 21 22] [30] [40 41 42 43 ...]
    stretches (both sides consecutive):  (7->20, 3 blocks) (3->30, 1) (12->40, 4) ...
    at most MAX_COPIES stretches:        one copy_ per stretch (no kernel, no block mapping)
    more:   stretches of LONG_STRETCH blocks or more by copy_; the short ones (a pool after
            churn) in one `tandem_kernels.block_copy.copy_block_rows` launch, its block mapping
            moved in one host-to-device copy from pinned memory

then one event, polled from the event loop between its other work (no thread hop; a thread
waits only for a copy still running after `SPIN_S`), then the session's DONE: no host round
trip per block or per run. The decode side does nothing per request but check and mark the
reservation. Up to `MAX_SESSIONS` sessions per decode worker are in flight, so one session's
copies overlap the others' messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

import numpy as np
import torch

from tandem.channels import PLAINTEXT, TlsConfig
from tandem.kv_transfer.base import EngineHandle, KVDestination, KVTransferError
from tandem.kv_transfer.placement import CUDA_IPC, host_id
from tandem.kv_transfer.session import RemoteKVConnector, Run, run_to_end
from tandem_protos.v1 import worker_pb2

# Stretches moved by copy_ alone, with no kernel launch, when there are this few.
MAX_COPIES = 8
# Past MAX_COPIES, stretches this long still go by copy_; shorter ones go through the kernel.
LONG_STRETCH = 8
# Write sessions in flight per decode worker.
MAX_SESSIONS = 4
# How long the event loop polls a session's event before a thread waits for it.
SPIN_S = 0.005


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID ("" where torch does not report one)."""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")


def local_device_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid` (None: not visible here). Without a UUID
    on either side, the only visible GPU is taken to be it."""
    count = torch.cuda.device_count()
    for i in range(count):
        if uuid and gpu_uuid(torch.device("cuda", i)) == uuid:
            return i
    if not uuid and count == 1:
        return 0
    return None


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [num_blocks, words] (see `tandem_kernels.block_copy.block_words`)."""
    from tandem_kernels.block_copy import block_words

    return block_words(cache)


def block_mapping(src: list[int], runs: list[Run]) -> np.ndarray:
    """`[num_blocks, 2]` int64 (source block, destination block) pairs: `src[i]` goes to the
    i-th destination block of `runs` (which cover `src` in order)."""
    pairs = np.empty((len(src), 2), dtype=np.int64)
    pairs[:, 0] = src
    if not runs:
        return pairs
    # [3, num_runs]: positions, first blocks, lengths (one list each: numpy converts a flat
    # list of ints far faster than a list of tuples).
    table = np.array(
        [r[0] for r in runs] + [r[1] for r in runs] + [r[2] for r in runs], dtype=np.int64
    ).reshape(3, -1)
    positions, firsts, lengths = table
    assert positions[0] == 0 and (positions[1:] == np.cumsum(lengths)[:-1]).all(), runs
    assert lengths.sum() == len(src), (len(src), runs)
    # Row i of run r (which starts at row positions[r]) goes to firsts[r] + i - positions[r].
    pairs[:, 1] = np.repeat(firsts - positions, lengths) + np.arange(len(src))
    return pairs


def _stretch_bounds(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start row and length of every stretch of `pairs` (both columns step by one)."""
    steps = np.diff(pairs, axis=0)
    cuts = np.flatnonzero((steps != 1).any(axis=1)) + 1
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [len(pairs)])))
    return starts, lengths


def _as_copies(
    pairs: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> tuple[tuple[int, int, int], ...]:
    firsts = pairs[starts].tolist()
    return tuple((s, d, n) for (s, d), n in zip(firsts, lengths.tolist(), strict=True))


@dataclass(frozen=True)
class CopyPlan:
    """How a session's blocks move: `copies` one `copy_` each (first source block, first
    destination block, number of blocks); `pairs` `[k, 2]` (source, destination) in one kernel
    launch (k may be 0)."""

    copies: tuple[tuple[int, int, int], ...]
    pairs: np.ndarray


_NO_PAIRS = np.empty((0, 2), dtype=np.int64)


def _copies_if_runs_are_stretches(
    src: list[int], runs: list[Run]
) -> tuple[tuple[int, int, int], ...] | None:
    """The stretches, when the source blocks of every destination run are consecutive too
    (the common case, found without numpy); None otherwise."""
    copies: list[tuple[int, int, int]] = []
    for pos, first, n in runs:
        s = src[pos]
        if src[pos : pos + n] != list(range(s, s + n)):
            return None
        if copies:
            ps, pd, pn = copies[-1]
            if ps + pn == s and pd + pn == first:
                copies[-1] = (ps, pd, pn + n)
                continue
        copies.append((s, first, n))
    return tuple(copies)


def plan_copies(src: list[int], runs: list[Run], use_kernel: bool = True) -> CopyPlan:
    """Stretches by copy_ when there are at most MAX_COPIES of them (or `use_kernel` is off);
    otherwise the long ones by copy_ and the blocks of the short ones by the kernel."""
    copies = _copies_if_runs_are_stretches(src, runs)
    if copies is not None and (
        len(copies) <= MAX_COPIES or not use_kernel or min(n for _, _, n in copies) >= LONG_STRETCH
    ):
        return CopyPlan(copies, _NO_PAIRS)
    pairs = block_mapping(src, runs)
    if len(pairs) == 0:
        return CopyPlan((), pairs)
    starts, lengths = _stretch_bounds(pairs)
    if len(starts) <= MAX_COPIES or not use_kernel:
        by_copy = np.ones(len(starts), dtype=bool)
    else:
        by_copy = lengths >= LONG_STRETCH
    copies = _as_copies(pairs, starts[by_copy], lengths[by_copy])
    return CopyPlan(copies, pairs[np.repeat(~by_copy, lengths)])


def copy_runs(
    local: torch.Tensor,
    remote: torch.Tensor,
    src: list[int],
    runs: list[Run],
    same_device: bool | None = None,
) -> CopyPlan:
    """Enqueue the copies of blocks `src` of `local` into `runs` of `remote` on the current
    stream; returns the plan it followed. Both caches as `[num_blocks, words]` rows of one
    integer dtype (`_rows`). On one device the plan may use the kernel (its torch reference
    off CUDA); across devices, one copy_ per stretch."""
    from tandem_kernels.block_copy import copy_block_rows, copy_block_rows_ref

    if same_device is None:
        same_device = remote.device == local.device
    plan = plan_copies(src, runs, use_kernel=same_device)
    for s, d, n in plan.copies:
        remote[d : d + n].copy_(local[s : s + n], non_blocking=True)
    if len(plan.pairs):
        host = torch.from_numpy(plan.pairs)
        if local.device.type == "cuda":
            # The caching host allocator keeps the pinned block until the copy has run.
            mapping = host.pin_memory().to(local.device, non_blocking=True)
            copy_block_rows(local, remote, mapping)
        else:
            copy_block_rows_ref(local, remote, host)
    return plan


def check_block_ids(
    src: list[int], runs: list[Run], num_src_blocks: int, num_dst_blocks: int
) -> None:
    """Raise KVTransferError unless a session's source blocks and destination runs lie in
    their caches (a slice past a cache's end would copy short; the kernel checks no ids)."""
    if any(first < 0 or first + n > num_dst_blocks for _, first, n in runs):
        raise KVTransferError("destination blocks outside the decode worker's cache")
    if min(src) < 0 or max(src) >= num_src_blocks:
        raise KVTransferError("source block ids out of range")


async def wait_event(
    event: torch.cuda.Event, executor: concurrent.futures.Executor, spin_s: float = SPIN_S
) -> None:
    """Return once `event` has completed: polled between the loop's other callbacks for up to
    `spin_s`, then waited for on `executor`. A cancelled wait still lets the device work end
    first (nobody may learn that the session ended while it can still write)."""
    deadline = time.perf_counter() + spin_s
    try:
        while not event.query():
            if time.perf_counter() > deadline:
                await run_to_end(executor, event.synchronize)
                return
            await asyncio.sleep(0)
    except asyncio.CancelledError:
        event.synchronize()
        raise


@dataclass
class OpenedCache:
    """The decode worker's KV cache, mapped into this process; `rows` and `local_rows` are it
    and this worker's cache as `[num_blocks, words]` rows of one integer dtype."""

    tensor: torch.Tensor
    rows: torch.Tensor
    local_rows: torch.Tensor


class CudaIpcKVConnector(RemoteKVConnector[OpenedCache]):
    transport = CUDA_IPC

    def __init__(
        self,
        kv_cache: torch.Tensor,
        engine: EngineHandle,
        worker_id: str = "",
        rpc_timeout_s: float = 30.0,
        max_sessions: int = MAX_SESSIONS,
        tls: TlsConfig = PLAINTEXT,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError("the CUDA IPC connector needs a KV cache on a CUDA device")
        super().__init__(kv_cache, engine, worker_id, rpc_timeout_s, tls=tls)
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.device = kv_cache.device
        self._rows = _rows(kv_cache)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-ipc")
        self._stream: torch.cuda.Stream | None = None

    # ------------------------------------------------------------------ receiver

    async def _connect_info(
        self, request: worker_pb2.ConnectKVRequest
    ) -> worker_pb2.ConnectKVResponse:
        cache = self.cache.kv_cache
        # An engine process exported its cache's storage once (this process holds an opened
        # view of it, which cannot be exported again): peers open the same handle. With no
        # such handle the cache was allocated here, and is exported here.
        shared = self.engine.kv_cache_ipc_handle() or tuple(cache.untyped_storage()._share_cuda_())
        (
            _device,
            mem_handle,
            storage_size_bytes,
            storage_offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = shared
        return worker_pb2.ConnectKVResponse(
            cuda_ipc=worker_pb2.CudaIpcHandle(
                host_id=host_id(),
                gpu_uuid=gpu_uuid(self.device),
                mem_handle=mem_handle,
                storage_size_bytes=storage_size_bytes,
                storage_offset_bytes=storage_offset_bytes,
                ref_counter_handle=ref_counter_handle,
                ref_counter_offset=ref_counter_offset,
                event_handle=event_handle or b"",
                event_sync_required=bool(event_sync_required),
                shape=list(cache.shape),
                stride=list(cache.stride()),
                storage_offset=cache.storage_offset(),
            )
        )

    # ------------------------------------------------------------------ sender

    async def _open(self, dst: KVDestination, info: worker_pb2.ConnectKVResponse) -> OpenedCache:
        if info.WhichOneof("info") != "cuda_ipc":
            raise KVTransferError(f"{dst.worker_id} sent no CUDA IPC handle")
        handle = info.cuda_ipc
        if handle.host_id != host_id():
            raise KVTransferError(
                f"{dst.worker_id} runs on another host; CUDA IPC needs both on one host"
            )
        index = local_device_index(handle.gpu_uuid)
        if index is None:
            raise KVTransferError(
                f"the GPU of {dst.worker_id} ({handle.gpu_uuid}) is not visible here"
            )
        from tandem_kernels.block_copy import common_words

        dtype = self.cache.kv_cache.dtype

        def open_handle() -> OpenedCache:
            with torch.cuda.device(index):
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    handle.mem_handle,
                    handle.storage_size_bytes,
                    handle.storage_offset_bytes,
                    handle.ref_counter_handle,
                    handle.ref_counter_offset,
                    handle.event_handle,
                    handle.event_sync_required,
                )
                tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index)).set_(
                    storage, handle.storage_offset, tuple(handle.shape), tuple(handle.stride)
                )
            if not tensor.is_contiguous():
                raise KVTransferError(f"the KV cache of {dst.worker_id} is not contiguous")
            rows, local_rows = common_words(_rows(tensor), self._rows)
            return OpenedCache(tensor, rows, local_rows)

        try:
            return await run_to_end(self._executor, open_handle)
        except RuntimeError as exc:
            raise KVTransferError(f"opening the KV cache of {dst.worker_id} failed: {exc}") from exc

    async def _write(self, peer: OpenedCache, src: list[int], runs: list[Run]) -> None:
        check_block_ids(src, runs, self.cache.num_blocks, peer.tensor.shape[0])
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        # Enqueue here (copies and at most one kernel launch), then one event for all of them.
        with torch.cuda.stream(self._stream):
            copy_runs(peer.local_rows, peer.rows, src, runs)
            done = torch.cuda.Event()
            done.record(self._stream)
        await wait_event(done, self._executor)

    def _close_peer(self, peer: OpenedCache) -> None:
        # Dropping the last reference closes the mapping (torch syncs and releases the
        # producer's ref count).
        peer.tensor = peer.rows = peer.local_rows = torch.empty(0)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)
