"""CUDA IPC KV connector: the prefill worker writes straight into the decode worker's KV cache.

The decode worker shares its cache tensor's CUDA IPC handle once per prefill worker
(`ConnectKV`, on the engine thread: sharing re-wraps the storage's data pointer); the prefill
worker opens it (same host, the GPU found by UUID) and keeps it open. Per write session (one
request, or every request bound for that decode worker that was ready at once), on the
connector's own CUDA stream:

    dst runs:      [20 21 22] [30]          src (held):  7 8 9 | 3
    block mapping  [(7,20) (8,21) (9,22) (3,30)]    numpy, pinned, one host-to-device copy
    both sides one consecutive stretch:   one copy_ of one contiguous span
    otherwise:                            one `kernels.block_copy.copy_blocks` launch

then one event; if it has not completed yet, one wait for it on the connector's thread (so the
event loop never waits on the device), then the session's DONE: no host round trip per block
or per run. The decode side does nothing per request but check and mark the reservation.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kv_transfer.base import EngineHandle, KVDestination, KVTransferError
from tandem.kv_transfer.placement import CUDA_IPC, host_id
from tandem.kv_transfer.session import RemoteKVConnector, Run, run_to_end
from tandem_protos.v1 import worker_pb2


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
    """The cache as [num_blocks, words] (see `kernels.block_copy.block_words`)."""
    from kernels.block_copy import block_words

    return block_words(cache)


def block_mapping(src: list[int], runs: list[Run]) -> np.ndarray:
    """`[num_blocks, 2]` int64 (source block, destination block) pairs: `src[i]` goes to the
    i-th destination block of `runs` (which cover `src` in order)."""
    pairs = np.empty((len(src), 2), dtype=np.int64)
    pairs[:, 0] = src
    col = pairs[:, 1]
    for pos, first, n in runs:
        col[pos : pos + n] = np.arange(first, first + n)
    return pairs


def one_stretch(pairs: np.ndarray) -> bool:
    """Both columns consecutive: the whole transfer is one contiguous span each side."""
    return len(pairs) < 2 or bool((np.diff(pairs, axis=0) == 1).all())


def copy_runs(
    local: torch.Tensor,
    remote: torch.Tensor,
    src: list[int],
    runs: list[Run],
    same_device: bool | None = None,
) -> list[torch.Tensor]:
    """Enqueue the copies of blocks `src` of cache `local` into `runs` of cache `remote` on the
    current stream; returns the temporaries to keep alive until the stream is synchronized.

    One stretch (both sides consecutive): one `copy_`. Otherwise, on one device: one
    `copy_blocks` launch for every block, in any order (its torch reference off CUDA), with the
    block mapping moved in one host-to-device copy from pinned memory. Across devices: a
    gather here and one copy per destination run.
    """
    from kernels.block_copy import copy_blocks, copy_blocks_ref

    if same_device is None:
        same_device = remote.device == local.device
    pairs = block_mapping(src, runs)
    if one_stretch(pairs):
        s, d, n = int(pairs[0, 0]), int(pairs[0, 1]), len(pairs)
        remote[d : d + n].copy_(local[s : s + n], non_blocking=True)
        return []
    keep: list[torch.Tensor] = []
    if same_device:
        if local.device.type == "cuda":
            host = torch.from_numpy(pairs).pin_memory()
            mapping = host.to(local.device, non_blocking=True)
            copy_blocks(local, remote, mapping)
            keep += [host, mapping]
        else:
            copy_blocks_ref(local, remote, torch.from_numpy(pairs))
        return keep
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
        num_dst = peer.tensor.shape[0]
        if any(first < 0 or first + n > num_dst for _, first, n in runs):
            raise KVTransferError("destination blocks outside the decode worker's cache")
        if min(src) < 0 or max(src) >= self.cache.num_blocks:
            raise KVTransferError("source block ids out of range")
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        # Enqueue here (one or two launches); wait on the connector's thread only if the copy
        # is still running.
        with torch.cuda.stream(self._stream):
            keep = copy_runs(self.cache.kv_cache, peer.tensor, src, runs)
            done = torch.cuda.Event()
            done.record(self._stream)
        if not done.query():
            await run_to_end(self._executor, done.synchronize)
        del keep

    def _close_peer(self, peer: OpenedCache) -> None:
        # Dropping the last reference closes the mapping (torch syncs and releases the
        # producer's ref count).
        peer.tensor = peer.rows = torch.empty(0)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)
