"""TCP KV connector: block runs streamed as protobuf bytes to the decode worker's `ReceiveKV`
(a gRPC protocol of its own, so it lives in the worker service; the byte packing, reading and
writing whole blocks of a cache, is `tandem.kv_transfer.base.KVCacheView`).

For CPU workers (and tests). One `KVBlockRun` message per destination run, split so that no
message exceeds `max_message_bytes`; the first message carries the sender's `KVLayout`, which
the receiver checks against its own before writing anything.

Copies of `COPY_OFF_LOOP_BYTES` or more (reading held blocks on the prefill side, writing
reserved blocks on the decode side) run on the connector's threads, not on the event loop: a
burst of hand-offs then has its streams written side by side (and the loop keeps serving the
other RPCs) instead of one copy after another on the loop. Smaller copies stay on the loop (a
thread hop would cost more than the copy). Every write of a stream has finished before the
stream's answer, so the reservation's mark is cleared only once nothing more can land.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from tandem.kv_transfer.base import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BlockRun,
    EngineHandle,
    KVConnector,
    KVDestination,
    KVLayout,
    KVTransferError,
    block_runs,
    check_fits,
)
from tandem_protos.v1 import worker_pb2, worker_pb2_grpc
from tandem_services.common.channels import PLAINTEXT, ChannelPool, TlsConfig

# Copies at least this large run on the connector's threads (see the module docstring).
COPY_OFF_LOOP_BYTES = 256 * 1024
# Threads for those copies (per connector).
COPY_THREADS = 4


def layout_to_proto(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
        num_ranks=layout.num_ranks,
    )


def layout_from_proto(msg: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(
        msg.num_layers,
        msg.block_size,
        msg.num_kv_heads,
        msg.head_size,
        msg.dtype,
        num_ranks=max(msg.num_ranks, 1),
    )


class TcpKVConnector(KVConnector):
    def __init__(
        self,
        kv_cache: object,
        engine: EngineHandle,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout_s: float = 60.0,
        tls: TlsConfig = PLAINTEXT,
    ) -> None:
        super().__init__(kv_cache, engine)  # type: ignore[arg-type]
        self.max_blocks_per_message = max(1, max_message_bytes // self.layout.bytes_per_block)
        self.timeout_s = timeout_s
        self._channels = ChannelPool(tls)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def _copier(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                COPY_THREADS, thread_name_prefix="kv-tcp"
            )
        return self._executor

    # ------------------------------------------------------------------ prefill side

    async def send_blocks(
        self, request_id: str, src_block_ids: Sequence[int], dst: KVDestination
    ) -> int:
        check_fits(src_block_ids, dst)
        if not src_block_ids:
            return 0
        stub = worker_pb2_grpc.WorkerStub(self._channel(dst.address))
        try:
            reply = await stub.ReceiveKV(
                self._messages(request_id, list(src_block_ids), list(dst.block_ids)),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise KVTransferError(
                f"sending KV of {request_id!r} to {dst.worker_id} failed: "
                f"{exc.code().name}: {exc.details()}"
            ) from exc
        return int(reply.num_bytes)

    async def _messages(
        self, request_id: str, src: list[int], dst: list[int]
    ) -> AsyncIterator[worker_pb2.KVBlockRun]:
        dst = dst[: len(src)]
        per_block = self.layout.bytes_per_block
        loop = asyncio.get_running_loop()
        for i, (pos, first, n) in enumerate(block_runs(dst, self.max_blocks_per_message)):
            ids = src[pos : pos + n]
            if n * per_block >= COPY_OFF_LOOP_BYTES:
                data = await loop.run_in_executor(self._copier(), self.cache.read, ids)
            else:
                data = self.cache.read(ids)
            msg = worker_pb2.KVBlockRun(
                request_id=request_id, first_block_id=first, num_blocks=n, data=data
            )
            if i == 0:
                msg.layout.CopyFrom(layout_to_proto(self.layout))
            yield msg

    def _channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def close(self) -> None:
        await self._channels.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ decode side

    async def receive_stream(
        self,
        messages: AsyncIterator[worker_pb2.KVBlockRun],
        reserved_for: Callable[[str], Awaitable[Sequence[int] | None]],
    ) -> worker_pb2.ReceiveKVResponse:
        """Write every run of one request's stream; `await reserved_for(request_id)` gives its
        reservation (None: unknown request). Raises KVTransferError."""
        request_id: str | None = None
        reserved: Sequence[int] = ()
        num_blocks = num_bytes = 0
        # A write on the connector's threads not awaited yet (at most one: the next message is
        # read while the last one is written).
        pending: concurrent.futures.Future[None] | None = None
        try:
            async for msg in messages:
                if request_id is None:
                    if not msg.HasField("layout"):
                        raise KVTransferError("the first KVBlockRun must carry the layout")
                    theirs = layout_from_proto(msg.layout)
                    if theirs != self.layout:
                        raise KVTransferError(
                            f"KV layouts differ: sender {theirs}, here {self.layout}"
                        )
                    request_id = msg.request_id
                    found = await reserved_for(request_id)
                    if found is None:
                        raise KVTransferError(f"no blocks are reserved for request {request_id!r}")
                    reserved = found
                elif msg.request_id != request_id:
                    raise KVTransferError("one ReceiveKV stream carries one request")
                run = BlockRun(msg.request_id, msg.first_block_id, msg.num_blocks, msg.data)
                if pending is not None:
                    await asyncio.wrap_future(pending)
                    pending = None
                if len(msg.data) >= COPY_OFF_LOOP_BYTES:
                    pending = self._copier().submit(self.receive, run, reserved)
                else:
                    self.receive(run, reserved)
                num_blocks += msg.num_blocks
                num_bytes += len(msg.data)
            if pending is not None:
                await asyncio.wrap_future(pending)
                pending = None
        finally:
            if pending is not None:
                # An error or a cancellation: the write ends before the caller can clear the
                # mark (a wait on the loop, on this rare path only).
                with contextlib.suppress(Exception):
                    pending.result()
        return worker_pb2.ReceiveKVResponse(num_blocks=num_blocks, num_bytes=num_bytes)
