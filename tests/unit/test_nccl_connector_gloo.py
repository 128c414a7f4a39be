"""The NCCL connector's code over gloo: two real processes move KV blocks byte-exact.

A decode process serves ConnectKV / WriteKV for a zeroed CPU cache and a table of
reservations; a prefill process sends shuffled, non-contiguous blocks of a random FP8 (e4m3)
cache (`--kv-cache-dtype fp8`; the mover moves its bytes) for several requests (one alone,
three at once, bad requests, a session abandoned after READY, one more after reconnecting).
The parent checks every destination block bit for bit, that no other block changed, and that
every "being written" mark was cleared. Both caches block-major, and both layer-major (the
CPU engine's: a block is not one span, so the mover gathers and scatters).
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.kv_pair import run_kv_pair

pytestmark = pytest.mark.timeout(180)

SHAPE = (64, 3, 2, 4, 2, 8)  # blocks, layers, k/v, block_size, kv heads, head size
DTYPE = torch.float8_e4m3fn
SEED = 11
GROUP_TIMEOUT_S = 5.0
# request id -> (source block ids, destination block ids: the reservation, one block longer)
Job = tuple[list[int], list[int]]


def source_cache(layer_major: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    cache = torch.randn(SHAPE, generator=gen).to(DTYPE)
    return cache.transpose(0, 1).contiguous().transpose(0, 1) if layer_major else cache


def make_jobs() -> dict[str, Job]:
    rng = random.Random(SEED)
    free = list(range(SHAPE[0]))
    rng.shuffle(free)
    jobs: dict[str, Job] = {}
    # Two consecutive destination stretches (3 + 2 blocks) from scattered sources.
    jobs["alone"] = (rng.sample(range(SHAPE[0]), 5), [40, 41, 42, 10, 11, 12])
    used = {40, 41, 42, 10, 11, 12}
    free = [b for b in free if b not in used]
    for rid, n in (("c0", 7), ("c1", 4), ("c2", 9), ("after", 6)):
        dst, free = free[: n + 1], free[n + 1 :]
        jobs[rid] = (rng.sample(range(SHAPE[0]), n), dst)
    # Consecutive sources into a scattered reservation, and the reverse.
    dst, free = free[:4], free[4:]
    jobs["seq_src"] = ([20, 21, 22], dst)
    return jobs


# ----------------------------------------------------------------------------- processes


def decode_main(
    conn: Connection, reservations: dict[str, list[int]], out: str, layer_major: bool = False
) -> None:
    asyncio.run(_decode(conn, reservations, out, layer_major))


async def _decode(
    conn: Connection, reservations: dict[str, list[int]], out: str, layer_major: bool
) -> None:
    from tandem.kv_transfer.base import DirectEngine
    from tandem.kv_transfer.nccl import NcclMover
    from tandem.kv_transfer.placement import NCCL
    from tandem_services.worker.kv_sessions import RemoteKVConnector
    from tandem_services.worker.kv_standalone import start_receiver
    from tandem_services.worker.kv_transports import KVTransports

    torch.set_num_threads(1)
    cache = torch.zeros(SHAPE, dtype=DTYPE)
    if layer_major:
        cache = cache.transpose(0, 1).contiguous().transpose(0, 1)
    mover = NcclMover(
        cache, DirectEngine(), "decode-0", backend="gloo", group_timeout_s=GROUP_TIMEOUT_S
    )
    connector = RemoteKVConnector(mover, 20.0)
    transports = KVTransports({NCCL: connector})
    server, address, receiver = await start_receiver(transports, reservations)
    conn.send(address)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, conn.recv)  # the prefill side finished
    deadline = time.monotonic() + 3 * GROUP_TIMEOUT_S
    while receiver.being_written and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    torch.save(cache, out)
    conn.send({"being_written": dict(receiver.being_written), "sessions": receiver.sessions})
    await server.stop(0)
    await transports.close()


def prefill_main(
    conn: Connection, address: str, jobs: dict[str, Job], layer_major: bool = False
) -> None:
    conn.send(asyncio.run(_prefill(address, jobs, layer_major)))


async def _prefill(address: str, jobs: dict[str, Job], layer_major: bool) -> dict[str, Any]:
    from tandem.kv_transfer.base import DirectEngine, KVDestination, KVTransferError
    from tandem.kv_transfer.nccl import NcclMover
    from tandem_protos.v1 import worker_pb2, worker_pb2_grpc
    from tandem_services.worker.kv_sessions import BEGIN, READY, RemoteKVConnector

    torch.set_num_threads(1)
    mover = NcclMover(
        source_cache(layer_major),
        DirectEngine(),
        "prefill-0",
        backend="gloo",
        group_timeout_s=5.0,
    )
    connector = RemoteKVConnector(mover, 20.0)

    def dest(dst: list[int]) -> KVDestination:
        return KVDestination("decode-0", address, tuple(dst), transport="nccl")

    result: dict[str, Any] = {"bytes": {}, "errors": {}}

    async def send(rid: str, src: list[int], dst: list[int]) -> None:
        try:
            result["bytes"][rid] = await connector.send_blocks(rid, src, dest(dst))
        except KVTransferError as exc:
            result["errors"][rid] = str(exc)

    await send("alone", *jobs["alone"])
    first_pair = connector._peers[address].name
    await asyncio.gather(*(send(rid, *jobs[rid]) for rid in ("c0", "c1", "c2")))
    await send("seq_src", *jobs["seq_src"])
    # Refused: no reservation; blocks outside the reservation (block 0 is nobody's).
    await send("ghost", [1, 2], [50, 51, 52])
    await send("c0", [1], [0, 1])
    # A session abandoned after READY: the receiver has posted its receives; nothing comes.
    peer = await connector.peer(dest([0]))
    result["pair_after_errors"] = peer.name
    channel = connector._channel(address)
    call = worker_pb2_grpc.WorkerStub(channel).WriteKV()
    await call.write(
        worker_pb2.KVWriteMessage(
            phase=BEGIN,
            request_id="abandoned",
            transport="nccl",
            group_name=peer.name,
            first_block_ids=[jobs["after"][1][0]],
            num_blocks=[1],
        )
    )
    reply = await call.read()
    result["abandoned_ready"] = reply.phase == READY
    call.cancel()
    connector._forget_peer(address, peer)
    await send("after", *jobs["after"])
    result["pairs"] = [first_pair, connector._peers[address].name]
    result["data_s"] = [r.data_s for r in connector.history]
    result["batches"] = {r.request_id: r.batch_size for r in connector.history}
    await connector.close()
    return result


# ----------------------------------------------------------------------------- test


@pytest.mark.parametrize("layer_major", [False, True], ids=["block_major", "layer_major"])
def test_gloo_pair_moves_blocks_byte_exact(tmp_path: Path, layer_major: bool) -> None:
    jobs = make_jobs()
    reservations = {rid: dst for rid, (_, dst) in jobs.items() if rid != "ghost"}
    reservations["abandoned"] = list(jobs["after"][1])  # the same blocks, later reused
    out = tmp_path / "decode_cache.pt"
    result, decode_report = run_kv_pair(
        functools.partial(decode_main, layer_major=layer_major),
        functools.partial(prefill_main, layer_major=layer_major),
        reservations,
        jobs,
        out,
        start_timeout_s=60,
        finish_timeout_s=120,
    )

    src = source_cache()
    dst = torch.load(out)
    assert dst.is_contiguous() != layer_major
    bytes_per_block = src[0].numel() * src.element_size()
    good = ("alone", "c0", "c1", "c2", "seq_src", "after")
    assert set(result["bytes"]) == set(good), result["errors"]
    assert "no blocks are reserved" in result["errors"]["ghost"]
    assert "not reserved" in result["errors"]["c0"]
    assert result["abandoned_ready"]
    # Refused requests leave the pair in step; the abandoned session retired it.
    assert result["pair_after_errors"] == result["pairs"][0]
    assert result["pairs"][0] != result["pairs"][1]
    # c0, c1, c2 were queued at once: one session carried all three.
    assert result["batches"]["c0"] == result["batches"]["c1"] == result["batches"]["c2"] == 3

    written: set[int] = set()
    for rid in good:
        src_ids, dst_ids = jobs[rid]
        assert result["bytes"][rid] == len(src_ids) * bytes_per_block
        for s, d in zip(src_ids, dst_ids, strict=False):
            same = torch.equal(dst[d].view(torch.int16), src[s].view(torch.int16))
            assert same, f"{rid}: block {d} differs from source block {s}"
            written.add(d)
    untouched = [b for b in range(SHAPE[0]) if b not in written]
    assert not dst[untouched].view(torch.int16).any(), "blocks outside the runs changed"
    assert decode_report["being_written"] == {}
    # alone, c0+c1+c2, seq_src, ghost, refused c0, abandoned, after.
    assert decode_report["sessions"] == 7
