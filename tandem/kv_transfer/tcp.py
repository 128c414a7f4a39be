"""TCP KV connector: block runs streamed as protobuf bytes to the decode worker's `ReceiveKV`.

For CPU workers (and tests). One `KVBlockRun` message per destination run, split so that no
message exceeds `max_message_bytes`; the first message carries the sender's `KVLayout`, which
the receiver checks against its own before writing anything.
"""

from __future__ import annotations

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

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


def layout_to_proto(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
    )


def layout_from_proto(msg: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(msg.num_layers, msg.block_size, msg.num_kv_heads, msg.head_size, msg.dtype)


class TcpKVConnector(KVConnector):
    def __init__(
        self,
        kv_cache: object,
        engine: EngineHandle,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(kv_cache, engine)  # type: ignore[arg-type]
        self.max_blocks_per_message = max(1, max_message_bytes // self.layout.bytes_per_block)
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

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
        for i, (pos, first, n) in enumerate(block_runs(dst, self.max_blocks_per_message)):
            msg = worker_pb2.KVBlockRun(
                request_id=request_id,
                first_block_id=first,
                num_blocks=n,
                data=self.cache.read(src[pos : pos + n]),
            )
            if i == 0:
                msg.layout.CopyFrom(layout_to_proto(self.layout))
            yield msg

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

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
        async for msg in messages:
            if request_id is None:
                if not msg.HasField("layout"):
                    raise KVTransferError("the first KVBlockRun must carry the layout")
                theirs = layout_from_proto(msg.layout)
                if theirs != self.layout:
                    raise KVTransferError(f"KV layouts differ: sender {theirs}, here {self.layout}")
                request_id = msg.request_id
                found = await reserved_for(request_id)
                if found is None:
                    raise KVTransferError(f"no blocks are reserved for request {request_id!r}")
                reserved = found
            elif msg.request_id != request_id:
                raise KVTransferError("one ReceiveKV stream carries one request")
            self.receive(
                BlockRun(msg.request_id, msg.first_block_id, msg.num_blocks, msg.data), reserved
            )
            num_blocks += msg.num_blocks
            num_bytes += len(msg.data)
        return worker_pb2.ReceiveKVResponse(num_blocks=num_blocks, num_bytes=num_bytes)
