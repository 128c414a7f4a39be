"""A KV receiver without an engine, for benchmarks and tests: a gRPC Worker service that
answers ConnectKV, WriteKV and ReceiveKV for one cache and a table of reservations, and keeps
the same "being written" marks a decode worker keeps (an entry per session, cleared only after
the connector said nothing more can land). Its connectors' engine is a
`tandem.kv_transfer.base.DirectEngine`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc

from tandem.kv_transfer.base import KVTransferError
from tandem_protos.v1 import worker_pb2, worker_pb2_grpc
from tandem_services.common.channels import SERVER_OPTIONS
from tandem_services.worker.kv_transports import KVTransports


class StandaloneReceiver(worker_pb2_grpc.WorkerServicer):
    """`reservations`: request id -> reserved block ids (None: every block of the cache)."""

    def __init__(
        self, transports: KVTransports, reservations: dict[str, Sequence[int]] | None
    ) -> None:
        self.transports = transports
        self.reservations = reservations
        self.being_written: dict[str, int] = {}
        # WriteKV streams opened, and write sessions they carried (READY answers).
        self.streams = 0
        self.sessions = 0

    async def _begin(self, request_id: str) -> Sequence[int] | None:
        if self.reservations is None:
            reserved: Sequence[int] | None = range(self.transports.cache.num_blocks)
        else:
            reserved = self.reservations.get(request_id)
        if reserved is not None:
            self.being_written[request_id] = self.being_written.get(request_id, 0) + 1
        return reserved

    def _end(self, request_id: str) -> None:
        left = self.being_written.get(request_id, 0) - 1
        if left > 0:
            self.being_written[request_id] = left
        else:
            self.being_written.pop(request_id, None)

    async def ConnectKV(
        self, request: worker_pb2.ConnectKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ConnectKVResponse:
        try:
            return await self.transports.connect(request)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # not reached

    async def WriteKV(
        self,
        request_iterator: AsyncIterator[worker_pb2.KVWriteMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.KVWriteMessage]:
        # Requests this stream marked; each mark is cleared once.
        started: set[str] = set()

        async def begin(request_ids: list[str]) -> list[Sequence[int] | None]:
            found = [await self._begin(rid) for rid in request_ids]
            started.update(rid for rid, r in zip(request_ids, found, strict=True) if r is not None)
            return found

        def end(request_ids: list[str]) -> None:
            for request_id in request_ids:
                if request_id in started:
                    started.discard(request_id)
                    self._end(request_id)

        self.streams += 1
        try:
            async with contextlib.aclosing(
                self.transports.serve_write(request_iterator, begin, end)
            ) as replies:
                async for reply in replies:
                    if reply.phase == worker_pb2.KV_WRITE_PHASE_READY:
                        self.sessions += 1
                    yield reply
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            end(list(started))

    async def ReceiveKV(
        self,
        request_iterator: AsyncIterator[worker_pb2.KVBlockRun],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.ReceiveKVResponse:
        started: list[str] = []

        async def reserved_for(request_id: str) -> Sequence[int] | None:
            reserved = await self._begin(request_id)
            if reserved is not None:
                started.append(request_id)
            return reserved

        try:
            return await self.transports.receive_stream(request_iterator, reserved_for)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # not reached
        finally:
            for request_id in started:
                self._end(request_id)


async def start_receiver(
    transports: KVTransports,
    reservations: dict[str, Sequence[int]] | None,
    host: str = "127.0.0.1",
) -> tuple[grpc.aio.Server, str, StandaloneReceiver]:
    """Serve a `StandaloneReceiver` on a free port; returns (server, address, receiver)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    receiver = StandaloneReceiver(transports, reservations)
    worker_pb2_grpc.add_WorkerServicer_to_server(receiver, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, f"{host}:{port}", receiver
