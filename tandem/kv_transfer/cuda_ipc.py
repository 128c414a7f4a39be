"""CUDA IPC KV connector: the prefill worker writes straight into the decode worker's KV cache.

The decode worker shares its cache tensor's CUDA IPC handle once per prefill worker
(`ConnectKV`, on the engine thread: sharing re-wraps the storage's data pointer); the prefill
worker opens it (same host, the GPU found by UUID) and keeps it open. Per request, on the
connector's own CUDA stream:

    dst runs:      [20 21 22] [30]          src (held):  7 8 9 | 3
    stretches where source and destination are both consecutive: (7->20, 3) (3->30, 1)
    one copy per stretch   (a stretch of blocks is one contiguous span of the cache)
    many short stretches:  one gather + one scatter instead (same GPU)

then one wait for an event recorded after them (on the connector's thread, so the event loop
never waits on the device), then the session's DONE: no host round trip per block. The decode
side does nothing per request but check and mark the reservation.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from tandem.kv_transfer.base import EngineHandle, KVDestination, KVTransferError
from tandem.kv_transfer.placement import CUDA_IPC, host_id
from tandem.kv_transfer.session import RemoteKVConnector, Run, run_to_end
from tandem_protos.v1 import worker_pb2

# A request moved as at most this many copies (or in stretches of 4+ blocks on average) is
# copied stretch by stretch; beyond, by one gather and one scatter.
MAX_COPIES = 8


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


def stretches(src: list[int], runs: list[Run]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, number of blocks) for every stretch where
    both the source and the destination blocks are consecutive, in order."""
    out: list[tuple[int, int, int]] = []
    for pos, first, n in runs:
        start = 0
        for i in range(1, n + 1):
            if i == n or src[pos + i] != src[pos + i - 1] + 1:
                out.append((src[pos + start], first + start, i - start))
                start = i
    return out


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [num_blocks, words]: 8-byte words where a block allows (wider elements
    make gathers and scatters cheaper)."""
    flat = cache.view(cache.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 8 == 0:
        return flat.view(torch.int64)
    return flat.view(torch.uint8)


def copy_runs(
    local: torch.Tensor,
    remote: torch.Tensor,
    src: list[int],
    runs: list[Run],
    same_device: bool | None = None,
) -> list[torch.Tensor]:
    """Enqueue the copies of blocks `src` (rows of `local`) into `runs` (rows of `remote`) on
    the current stream; returns the temporaries to keep alive until the stream is synchronized.

    Few stretches (see `stretches`): one copy each. Many on one device: one gather and one
    scatter. Many across devices: a gather here and one copy per destination run.
    """
    if same_device is None:
        same_device = remote.device == local.device
    parts = stretches(src, runs)
    keep: list[torch.Tensor] = []
    if len(parts) <= MAX_COPIES or sum(n for _, _, n in parts) >= 4 * len(parts):
        for s, d, n in parts:
            remote[d : d + n].copy_(local[s : s + n], non_blocking=True)
    elif same_device:
        src_idx = torch.tensor(src, device=local.device)
        dst_idx = torch.tensor(
            [first + i for _, first, n in runs for i in range(n)], device=remote.device
        )
        gathered = local.index_select(0, src_idx)
        remote.index_copy_(0, dst_idx, gathered)
        keep += [src_idx, dst_idx, gathered]
    else:
        for pos, first, n in runs:
            idx = torch.tensor(src[pos : pos + n], device=local.device)
            gathered = local.index_select(0, idx)
            remote[first : first + n].copy_(gathered, non_blocking=True)
            keep += [idx, gathered]
    return keep


@dataclass
class OpenedCache:
    """The decode worker's KV cache, mapped into this process."""

    tensor: torch.Tensor
    rows: torch.Tensor


class CudaIpcKVConnector(RemoteKVConnector[OpenedCache]):
    transport = CUDA_IPC

    def __init__(
        self,
        kv_cache: torch.Tensor,
        engine: EngineHandle,
        worker_id: str = "",
        rpc_timeout_s: float = 30.0,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError("the CUDA IPC connector needs a KV cache on a CUDA device")
        super().__init__(kv_cache, engine, worker_id, rpc_timeout_s)
        self.device = kv_cache.device
        self._rows = _rows(kv_cache)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-ipc")
        self._stream: torch.cuda.Stream | None = None

    # ------------------------------------------------------------------ receiver

    async def _connect_info(
        self, request: worker_pb2.ConnectKVRequest
    ) -> worker_pb2.ConnectKVResponse:
        cache = self.cache.kv_cache
        storage = cache.untyped_storage()
        # On the engine thread: `_share_cuda_` swaps the storage's data pointer wrapper (same
        # address), which must not race with the engine reading it.
        shared = await self.engine.call(lambda _engine: storage._share_cuda_())
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
            return OpenedCache(tensor, _rows(tensor))

        try:
            return await run_to_end(self._executor, open_handle)
        except RuntimeError as exc:
            raise KVTransferError(f"opening the KV cache of {dst.worker_id} failed: {exc}") from exc

    async def _write(self, peer: OpenedCache, src: list[int], runs: list[Run]) -> None:
        for _pos, first, n in runs:
            if first < 0 or first + n > peer.tensor.shape[0]:
                raise KVTransferError(f"blocks {first}..{first + n - 1} are outside the cache")
        if any(b < 0 or b >= self.cache.num_blocks for b in src):
            raise KVTransferError("source block ids out of range")
        # Enqueue here (a few launches), wait on the connector's thread: the thread wakes up
        # while the copies run.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            keep = copy_runs(self._rows, peer.rows, src, runs)
            done = torch.cuda.Event()
            done.record(self._stream)
        await run_to_end(self._executor, done.synchronize)
        del keep

    def _close_peer(self, peer: OpenedCache) -> None:
        # Dropping the last reference closes the mapping (torch syncs and releases the
        # producer's ref count).
        peer.tensor = peer.rows = torch.empty(0)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)
