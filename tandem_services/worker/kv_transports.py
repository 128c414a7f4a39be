"""The connectors a worker speaks, bundled: `KVTransports` sends through the connector each
hand-off names and dispatches the receiving RPCs; `worker_transports` builds a worker's set
(TCP, and a session connector around every byte mover `tandem.kv_transfer.transports.
worker_movers` gives). The choice of transport per pair is `placement.choose_transport`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from tandem.kv_transfer.base import (
    EngineHandle,
    KVConnector,
    KVDestination,
    KVTransferError,
)
from tandem.kv_transfer.placement import TCP
from tandem.kv_transfer.transports import worker_movers
from tandem_services.common.channels import PLAINTEXT, TlsConfig
from tandem_services.worker.kv_sessions import RemoteKVConnector


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

    def _remote(self, transport: str) -> RemoteKVConnector[Any]:
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
        begin: Callable[[list[str]], Awaitable[list[Sequence[int] | None]]],
        end: Callable[[list[str]], None],
    ) -> AsyncIterator[Any]:
        """WriteKV, by the transport its first message names (see `RemoteKVConnector`)."""
        it = messages.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise KVTransferError("a KV write session starts with BEGIN") from None
        connector = self._remote(first.transport)
        async with contextlib.aclosing(connector.serve_write(it, begin, end, first)) as replies:
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
    tls: TlsConfig = PLAINTEXT,
) -> KVTransports:
    """Every connector a prefill or decode worker with `kv_cache` can speak: `tcp` (given, so
    the caller may wrap it), CUDA IPC on CUDA, NCCL (gloo on CPU) where torch.distributed has
    the backend."""
    connectors: dict[str, KVConnector] = {TCP: tcp}
    for name, mover in worker_movers(kv_cache, engine, worker_id).items():
        connectors[name] = RemoteKVConnector(mover, rpc_timeout_s, tls=tls)
    return KVTransports(connectors)
