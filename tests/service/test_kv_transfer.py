"""KV connectors: in-process and TCP move exactly the right blocks, refuse the wrong ones."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from tandem.kv_transfer.base import (
    BlockRun,
    KVCacheView,
    KVDestination,
    KVTransferError,
    block_runs,
)
from tandem.kv_transfer.inproc import InProcessKVConnector, InProcessKVHub
from tandem_protos.v1 import worker_pb2_grpc
from tandem_services.worker.kv_tcp import TcpKVConnector

SHAPE = (32, 3, 2, 4, 2, 8)  # blocks, layers, k/v, block_size, kv heads, head size


class _NoEngine:
    async def call(self, fn: Callable[[Any], Any]) -> Any:
        raise AssertionError("not used here")


def _caches(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(SHAPE, generator=gen).to(dtype)
    return src, torch.zeros(SHAPE, dtype=dtype)


def test_block_runs() -> None:
    assert block_runs([10, 11, 12, 20, 21, 5], max_blocks=8) == [(0, 10, 3), (3, 20, 2), (5, 5, 1)]
    assert block_runs([1, 2, 3, 4, 5], max_blocks=2) == [(0, 1, 2), (2, 3, 2), (4, 5, 1)]
    assert block_runs([], max_blocks=4) == []


def test_cache_view_round_trip_bfloat16() -> None:
    src, dst = _caches(torch.bfloat16)
    data = KVCacheView(src).read([7, 3])
    KVCacheView(dst).write(4, 2, data)
    assert torch.equal(dst[4], src[7]) and torch.equal(dst[5], src[3])
    with pytest.raises(KVTransferError, match="needs"):
        KVCacheView(dst).write(4, 1, data)


def test_inproc_copies_blocks_in_order() -> None:
    asyncio.run(_test_inproc_copies_blocks_in_order())


async def _test_inproc_copies_blocks_in_order() -> None:
    src, dst = _caches()
    before = dst.clone()
    hub = InProcessKVHub()
    sender = InProcessKVConnector(src, _NoEngine(), hub, "prefill")
    InProcessKVConnector(dst, _NoEngine(), hub, "decode")
    n = await sender.send_blocks("r", [5, 2, 3], KVDestination("d", "decode", (10, 11, 20, 21)))
    assert n == 3 * sender.layout.bytes_per_block
    for s, d in ((5, 10), (2, 11), (3, 20)):
        assert torch.equal(dst[d], src[s])
    untouched = [b for b in range(SHAPE[0]) if b not in (10, 11, 20)]
    assert torch.equal(dst[untouched], before[untouched])
    with pytest.raises(KVTransferError, match="no in-process KV receiver"):
        await sender.send_blocks("r", [1], KVDestination("x", "nowhere", (1,)))


class _Receiver(worker_pb2_grpc.WorkerServicer):
    def __init__(self, connector: TcpKVConnector, reservations: dict[str, list[int]]) -> None:
        self.connector = connector
        self.reservations = reservations

    async def _reserved(self, request_id: str) -> list[int] | None:
        return self.reservations.get(request_id)

    async def ReceiveKV(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await self.connector.receive_stream(request_iterator, self._reserved)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


async def _tcp_pair(
    dst: torch.Tensor, reservations: dict[str, list[int]], src: torch.Tensor, max_bytes: int
) -> tuple[grpc.aio.Server, str, TcpKVConnector]:
    server = grpc.aio.server()
    receiver = TcpKVConnector(dst, _NoEngine())
    worker_pb2_grpc.add_WorkerServicer_to_server(_Receiver(receiver, reservations), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", TcpKVConnector(src, _NoEngine(), max_bytes)


def test_tcp_streams_runs_into_reserved_blocks() -> None:
    asyncio.run(_test_tcp_streams_runs_into_reserved_blocks())


async def _test_tcp_streams_runs_into_reserved_blocks() -> None:
    src, dst = _caches()
    before = dst.clone()
    per_block = KVCacheView(src).layout.bytes_per_block
    # Two blocks per message at most: the 3-block run is split.
    server, address, sender = await _tcp_pair(dst, {"r": [10, 11, 12, 20]}, src, 2 * per_block)
    try:
        dest = KVDestination("d", address, (10, 11, 12, 20))
        n = await sender.send_blocks("r", [5, 2, 3, 9], dest)
        assert n == 4 * per_block
        for s, d in ((5, 10), (2, 11), (3, 12), (9, 20)):
            assert torch.equal(dst[d], src[s])
        untouched = [b for b in range(SHAPE[0]) if b not in (10, 11, 12, 20)]
        assert torch.equal(dst[untouched], before[untouched])

        with pytest.raises(KVTransferError, match="no blocks are reserved"):
            await sender.send_blocks("unknown", [1], KVDestination("d", address, (10,)))
        with pytest.raises(KVTransferError, match="not reserved"):
            await sender.send_blocks("r", [1], KVDestination("d", address, (13,)))
    finally:
        await sender.close()
        await server.stop(0)


def test_tcp_refuses_a_different_layout() -> None:
    asyncio.run(_test_tcp_refuses_a_different_layout())


async def _test_tcp_refuses_a_different_layout() -> None:
    src, _ = _caches()
    dst = torch.zeros(SHAPE, dtype=torch.bfloat16)
    server, address, sender = await _tcp_pair(dst, {"r": [1]}, src, 1 << 20)
    try:
        with pytest.raises(KVTransferError, match="layouts differ"):
            await sender.send_blocks("r", [0], KVDestination("d", address, (1,)))
        assert not dst.any()
    finally:
        await sender.close()
        await server.stop(0)


def test_receive_checks_the_reservation() -> None:
    src, dst = _caches()
    conn = TcpKVConnector(dst, _NoEngine())
    data = KVCacheView(src).read([0])
    with pytest.raises(KVTransferError, match="not reserved"):
        conn.receive(BlockRun("r", 3, 1, data), reserved_block_ids=[4])
    conn.receive(BlockRun("r", 4, 1, data), reserved_block_ids=[4])
    assert torch.equal(dst[4], src[0])


def test_tcp_large_copies_run_off_the_loop_side_by_side() -> None:
    asyncio.run(_test_tcp_large_copies_run_off_the_loop_side_by_side())


async def _test_tcp_large_copies_run_off_the_loop_side_by_side() -> None:
    """Blocks of 64 KiB: runs of 4 or more blocks are copied on the connectors' threads (read
    on the sender, written on the receiver). Four hand-offs at once land exactly; a run outside
    the reservation is still refused, with nothing written."""
    from tandem_services.worker.kv_tcp import COPY_OFF_LOOP_BYTES

    shape = (40, 4, 2, 16, 8, 16)  # float32: 64 KiB per block
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(shape, generator=gen)
    dst = torch.zeros(shape)
    per_block = KVCacheView(src).layout.bytes_per_block
    assert 4 * per_block >= COPY_OFF_LOOP_BYTES > per_block
    reservations = {f"r{i}": list(range(8 * i, 8 * i + 8)) for i in range(4)}
    reservations["bad"] = [39]
    server, address, sender = await _tcp_pair(dst, reservations, src, 4 * per_block)
    sources = {f"r{i}": [(7 * i + 3 * k) % 40 for k in range(8)] for i in range(4)}
    try:
        moved = await asyncio.gather(
            *(
                sender.send_blocks(rid, sources[rid], KVDestination("d", address, tuple(dst_ids)))
                for rid, dst_ids in reservations.items()
                if rid != "bad"
            )
        )
        assert moved == [8 * per_block] * 4
        for rid, s_ids in sources.items():
            for s, d in zip(s_ids, reservations[rid], strict=True):
                assert torch.equal(dst[d], src[s]), (rid, s, d)
        assert sender._executor is not None  # the large reads went through its threads
        with pytest.raises(KVTransferError, match="not reserved"):
            await sender.send_blocks(
                "bad", [0, 1, 2, 3], KVDestination("d", address, (35, 36, 37, 38))
            )
        assert not dst[32:40].any()
    finally:
        await sender.close()
        await server.stop(0)
