"""Which KV transport a prefill-decode pair uses, and the connectors a worker speaks.

A worker tells the scheduler where it runs (`WorkerPlacement`: host, process, KV device, the
transports it speaks); the scheduler picks one transport per pair with `choose_transport` and
puts it in the hand-off; the prefill worker's `KVTransports` sends through that connector.

    auto:  same process, both speak inproc          -> inproc
           same host, both KV caches on CUDA         -> cuda_ipc
           both KV caches on CUDA (and NCCL)         -> nccl
           otherwise                                 -> tcp
    forced (--kv-connector tcp | cuda-ipc | nccl): that transport when both workers speak it
           (cuda_ipc: and share a host); otherwise no transport (the request fails).

CPU workers speak nccl too (over gloo) but auto never picks it for them: TCP needs no group
set-up. Force it to run the NCCL code path on CPUs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed

from tandem.kv_transfer.base import (
    EngineHandle,
    KVConnector,
    KVDestination,
    KVTransferError,
)

TCP = "tcp"
CUDA_IPC = "cuda_ipc"
NCCL = "nccl"
INPROC = "inproc"
TRANSPORTS = (TCP, CUDA_IPC, NCCL, INPROC)
# Values of the scheduler's --kv-connector flag.
CONNECTOR_CHOICES = ("auto", "tcp", "cuda-ipc", "nccl")


class NoKVTransportError(ValueError):
    """No transport both workers of a pair speak (or the forced one does not fit)."""


def host_id() -> str:
    """Identifies this host: the kernel's boot id (shared by the containers of one host), else
    the host name."""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        if boot_id:
            return boot_id
    return socket.gethostname()


def normalize_transport(name: str) -> str:
    """'cuda-ipc' -> 'cuda_ipc'; 'auto' stays. Raises ValueError on an unknown name."""
    value = name.strip().lower().replace("-", "_")
    if value != "auto" and value not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; one of auto, {', '.join(TRANSPORTS)}")
    return value


@dataclass(frozen=True)
class WorkerPlacement:
    """Where a worker runs, as far as moving KV is concerned."""

    host_id: str
    process_id: int
    # "cuda" or "cpu"
    kv_device: str
    transports: tuple[str, ...]

    @classmethod
    def here(cls, kv_device: str, transports: Sequence[str]) -> WorkerPlacement:
        return cls(host_id(), os.getpid(), kv_device, tuple(transports))


def choose_transport(
    prefill: WorkerPlacement, decode: WorkerPlacement, preferred: str = "auto"
) -> str:
    """The transport for a pair (see the module docstring). Raises NoKVTransportError."""
    preferred = normalize_transport(preferred)
    common = set(prefill.transports) & set(decode.transports)
    same_host = bool(prefill.host_id) and prefill.host_id == decode.host_id
    both_cuda = prefill.kv_device == decode.kv_device == "cuda"
    if preferred != "auto":
        if preferred not in common:
            raise NoKVTransportError(
                f"KV transport {preferred} was asked for, but the workers speak "
                f"{sorted(prefill.transports)} and {sorted(decode.transports)}"
            )
        if preferred == CUDA_IPC and not (same_host and both_cuda):
            raise NoKVTransportError("CUDA IPC needs both workers on one host, caches on CUDA")
        if preferred == INPROC and not (same_host and prefill.process_id == decode.process_id):
            raise NoKVTransportError("the in-process transport needs both workers in one process")
        return preferred
    if same_host and prefill.process_id == decode.process_id and INPROC in common:
        return INPROC
    if same_host and both_cuda and CUDA_IPC in common:
        return CUDA_IPC
    if both_cuda and NCCL in common:
        return NCCL
    if TCP in common:
        return TCP
    raise NoKVTransportError(
        f"the workers share no KV transport: {sorted(prefill.transports)} and "
        f"{sorted(decode.transports)}"
    )


def local_transports(kv_cache: torch.Tensor) -> list[str]:
    """The transports a worker with `kv_cache` can speak (besides inproc)."""
    names = [TCP]
    dist_ok = torch.distributed.is_available()
    if kv_cache.device.type == "cuda":
        if sys.platform.startswith("linux"):
            names.append(CUDA_IPC)
        if dist_ok and torch.distributed.is_nccl_available():
            names.append(NCCL)
    elif kv_cache.device.type == "cpu" and dist_ok and torch.distributed.is_gloo_available():
        names.append(NCCL)
    return names


class KVTransports(KVConnector):
    """The connectors one worker speaks, by transport name. Sends go through the connector the
    hand-off names (`dst.transport`); the receiving side dispatches ReceiveKV to tcp and
    ConnectKV / WriteKV by the transport in the message."""

    def __init__(self, connectors: Mapping[str, KVConnector]) -> None:
        if not connectors:
            raise ValueError("KVTransports needs at least one connector")
        first = next(iter(connectors.values()))
        super().__init__(first.cache.kv_cache, first.engine)
        self.connectors = dict(connectors)

    @property
    def names(self) -> list[str]:
        return list(self.connectors)

    def get(self, transport: str) -> KVConnector:
        connector = self.connectors.get(transport or TCP)
        if connector is None:
            raise KVTransferError(
                f"this worker does not speak KV transport {transport!r} (it speaks {self.names})"
            )
        return connector

    def _remote(self, transport: str) -> Any:
        from tandem.kv_transfer.session import RemoteKVConnector

        connector = self.get(transport)
        if not isinstance(connector, RemoteKVConnector):
            raise KVTransferError(f"KV transport {transport!r} has no connect/write sessions")
        return connector

    async def send_blocks(
        self, request_id: str, src_block_ids: Sequence[int], dst: KVDestination
    ) -> int:
        return await self.get(dst.transport).send_blocks(request_id, src_block_ids, dst)

    async def receive_stream(
        self,
        messages: AsyncIterator[Any],
        reserved_for: Callable[[str], Awaitable[Sequence[int] | None]],
    ) -> Any:
        """ReceiveKV (TCP)."""
        tcp: Any = self.get(TCP)
        return await tcp.receive_stream(messages, reserved_for)

    async def connect(self, request: Any) -> Any:
        """ConnectKV. Raises KVTransferError."""
        return await self._remote(request.transport).connect(request)

    async def serve_write(
        self,
        messages: AsyncIterator[Any],
        begin: Callable[[str], Awaitable[Sequence[int] | None]],
    ) -> AsyncIterator[Any]:
        """WriteKV, by the transport its first message names (see `RemoteKVConnector`)."""
        it = messages.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise KVTransferError("a KV write session starts with BEGIN") from None
        connector = self._remote(first.transport)

        async def replay() -> AsyncIterator[Any]:
            yield first
            async for msg in it:
                yield msg

        async with contextlib.aclosing(connector.serve_write(replay(), begin)) as replies:
            async for reply in replies:
                yield reply

    async def close(self) -> None:
        for connector in self.connectors.values():
            close = getattr(connector, "close", None)
            if close is not None:
                await close()


def worker_transports(
    kv_cache: torch.Tensor,
    engine: EngineHandle,
    tcp: KVConnector,
    worker_id: str = "",
    rpc_timeout_s: float = 30.0,
) -> KVTransports:
    """Every connector a prefill or decode worker with `kv_cache` can speak: `tcp` (given, so
    the caller may wrap it), CUDA IPC on CUDA, NCCL (gloo on CPU) where torch.distributed has
    the backend."""
    connectors: dict[str, KVConnector] = {TCP: tcp}
    names = local_transports(kv_cache)
    if CUDA_IPC in names:
        from tandem.kv_transfer.cuda_ipc import CudaIpcKVConnector

        connectors[CUDA_IPC] = CudaIpcKVConnector(kv_cache, engine, worker_id, rpc_timeout_s)
    if NCCL in names:
        from tandem.kv_transfer.nccl import NcclKVConnector

        connectors[NCCL] = NcclKVConnector(kv_cache, engine, worker_id, rpc_timeout_s)
    return KVTransports(connectors)
