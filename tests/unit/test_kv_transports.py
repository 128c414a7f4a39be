"""KV transport choice per pair, a worker's bundle of connectors, and the CUDA IPC copy plan
(run here on CPU tensors: the same ops the GPU path enqueues)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from typing import Any

import pytest
import torch

from tandem.kv_transfer.base import KVDestination, KVTransferError, block_runs, check_runs
from tandem.kv_transfer.cuda_ipc import (
    LONG_STRETCH,
    MAX_COPIES,
    _rows,
    block_mapping,
    copy_runs,
    plan_copies,
    wait_event,
)
from tandem.kv_transfer.inproc import InProcessKVConnector, InProcessKVHub
from tandem.kv_transfer.mover import KVMover
from tandem.kv_transfer.placement import (
    NoKVTransportError,
    WorkerPlacement,
    choose_transport,
    normalize_transport,
)
from tandem.kv_transfer.transports import local_transports
from tandem_services.worker.kv_sessions import RemoteKVConnector
from tandem_services.worker.kv_transports import KVTransports

SHAPE = (48, 2, 2, 4, 2, 8)
ALL = ("tcp", "cuda_ipc", "nccl")


def _w(host: str, pid: int, device: str, transports: tuple[str, ...] = ALL) -> WorkerPlacement:
    return WorkerPlacement(host, pid, device, transports)


def test_auto_choice_follows_where_the_workers_are() -> None:
    gpu_a, gpu_a2, gpu_b = _w("a", 1, "cuda"), _w("a", 2, "cuda"), _w("b", 3, "cuda")
    cpu_a, cpu_b = _w("a", 4, "cpu", ("tcp", "nccl")), _w("b", 5, "cpu", ("tcp", "nccl"))
    assert choose_transport(gpu_a, gpu_a2) == "cuda_ipc"
    assert choose_transport(gpu_a, gpu_b) == "nccl"
    assert choose_transport(cpu_a, cpu_b) == "tcp"  # gloo only when asked for
    assert choose_transport(cpu_a, _w("a", 6, "cpu", ("tcp", "nccl"))) == "tcp"
    assert choose_transport(gpu_a, cpu_a) == "tcp"
    # One process, both speak inproc.
    both = ("inproc", *ALL)
    assert choose_transport(_w("a", 7, "cuda", both), _w("a", 7, "cuda", both)) == "inproc"
    assert choose_transport(_w("a", 7, "cuda", both), _w("a", 8, "cuda", both)) == "cuda_ipc"
    # A worker without NCCL on another host: TCP.
    assert choose_transport(gpu_a, _w("b", 9, "cuda", ("tcp", "cuda_ipc"))) == "tcp"
    # Unknown host ids never count as one host.
    assert choose_transport(_w("", 1, "cuda"), _w("", 2, "cuda")) == "nccl"
    with pytest.raises(NoKVTransportError, match="share no"):
        choose_transport(_w("a", 1, "cpu", ("nccl",)), _w("a", 2, "cpu", ("tcp",)))


def test_forced_choice_is_strict() -> None:
    gpu_a, gpu_a2, gpu_b = _w("a", 1, "cuda"), _w("a", 2, "cuda"), _w("b", 3, "cuda")
    cpu = _w("a", 4, "cpu", ("tcp", "nccl"))
    assert choose_transport(gpu_a, gpu_a2, "tcp") == "tcp"
    assert choose_transport(gpu_a, gpu_a2, "nccl") == "nccl"
    assert choose_transport(gpu_a, gpu_a2, "cuda-ipc") == "cuda_ipc"
    assert choose_transport(cpu, _w("b", 5, "cpu", ("tcp", "nccl")), "nccl") == "nccl"
    with pytest.raises(NoKVTransportError, match="one host"):
        choose_transport(gpu_a, gpu_b, "cuda-ipc")
    with pytest.raises(NoKVTransportError, match="asked for"):
        choose_transport(gpu_a, cpu, "cuda-ipc")
    with pytest.raises(ValueError, match="unknown KV transport"):
        choose_transport(gpu_a, gpu_b, "rdma")


def test_normalize_transport() -> None:
    assert normalize_transport("cuda-ipc") == "cuda_ipc"
    assert normalize_transport("AUTO") == "auto"
    assert normalize_transport("nccl") == "nccl"


def test_local_transports_on_cpu() -> None:
    names = local_transports(torch.zeros(SHAPE))
    assert names[0] == "tcp" and "cuda_ipc" not in names
    assert ("nccl" in names) == torch.distributed.is_gloo_available()


def test_check_runs() -> None:
    assert check_runs([(4, 2), (9, 1)], [4, 5, 9, 10], "r") == 3
    with pytest.raises(KVTransferError, match="not reserved"):
        check_runs([(4, 3)], [4, 5, 9], "r")
    with pytest.raises(KVTransferError, match="not reserved"):
        check_runs([(4, 1), (4, 1)], [4, 5], "r")  # the same block twice
    with pytest.raises(KVTransferError, match="not reserved"):
        check_runs([(4, 0)], [4], "r")


def _stretches(src: list[int], runs: list[Any]) -> tuple[tuple[int, int, int], ...]:
    """Every stretch (both sides consecutive) as one copy: the plan without the kernel."""
    return plan_copies(src, runs, use_kernel=False).copies


def test_stretches() -> None:
    src = [7, 8, 9, 3, 5, 6]
    runs = block_runs([20, 21, 22, 30, 31, 32], max_blocks=16)
    assert _stretches(src, runs) == ((7, 20, 3), (3, 30, 1), (5, 31, 2))
    # Consecutive destinations split into runs still make one stretch.
    assert _stretches([4, 5, 6], block_runs([10, 11, 12], max_blocks=2)) == ((4, 10, 3),)
    assert _stretches([9], [(0, 2, 1)]) == ((9, 2, 1),)
    assert _stretches([], []) == ()


def test_block_mapping() -> None:
    src = [7, 8, 9, 3]
    runs = block_runs([20, 21, 22, 30], max_blocks=16)
    pairs = block_mapping(src, runs)
    assert pairs.tolist() == [[7, 20], [8, 21], [9, 22], [3, 30]]


def test_plan_copies() -> None:
    # Few stretches: every one by copy_, nothing for the kernel.
    plan = plan_copies([7, 8, 9, 3], block_runs([20, 21, 22, 30], max_blocks=16))
    assert plan.copies == ((7, 20, 3), (3, 30, 1)) and plan.pairs.shape == (0, 2)
    # Many: the long stretch by copy_, the scattered blocks (in order) by the kernel.
    long = list(range(100, 100 + LONG_STRETCH))
    scattered_src = [2 * i for i in range(MAX_COPIES + 1)]
    scattered_dst = [60 - 3 * i for i in range(MAX_COPIES + 1)]
    src = scattered_src[:4] + long + scattered_src[4:]
    dst = scattered_dst[:4] + [200 + i for i in range(LONG_STRETCH)] + scattered_dst[4:]
    plan = plan_copies(src, block_runs(dst, max_blocks=len(dst)))
    assert plan.copies == ((100, 200, LONG_STRETCH),)
    assert plan.pairs.tolist() == [list(p) for p in zip(scattered_src, scattered_dst, strict=True)]
    # Across devices (no kernel): one copy_ per stretch, however many.
    plan = plan_copies(src, block_runs(dst, max_blocks=len(dst)), use_kernel=False)
    assert len(plan.copies) == MAX_COPIES + 2 and plan.pairs.shape == (0, 2)
    assert plan_copies([], []).copies == ()


def test_plan_copies_covers_every_pair_once() -> None:
    """Random sessions (consecutive or not, either side, runs cut short): copies and kernel
    pairs together are exactly the (source, destination) pairs; the kernel is used only when
    copy_ alone would take more than MAX_COPIES short stretches."""
    rng = random.Random(7)
    for _ in range(300):
        m = rng.randrange(1, 40)
        if rng.random() < 0.5:
            first = rng.randrange(0, 30)
            src = list(range(first, first + m))
        else:
            src = [rng.randrange(0, 60) for _ in range(m)]
        if rng.random() < 0.4:
            first = rng.randrange(0, 50)
            dst = list(range(first, first + m))
        else:
            dst = rng.sample(range(100), m)
        runs = block_runs(dst, max_blocks=rng.randrange(1, m + 1))
        for use_kernel in (True, False):
            plan = plan_copies(src, runs, use_kernel=use_kernel)
            moved = [(s + i, d + i) for s, d, n in plan.copies for i in range(n)]
            moved += [(s, d) for s, d in plan.pairs.tolist()]
            assert sorted(moved) == sorted(zip(src, dst, strict=True)), (src, dst, plan)
            if not use_kernel:
                assert len(plan.pairs) == 0
            elif len(plan.pairs):
                assert len(_stretches(src, runs)) > MAX_COPIES


@pytest.mark.parametrize("case", ["one_stretch", "scattered", "mixed", "per_run"])
def test_copy_runs_on_cpu(case: str) -> None:
    """The copy plan on CPU tensors (the kernel's blocks go through its torch reference)."""
    gen = torch.Generator().manual_seed(3)
    local = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
    remote = torch.zeros(SHAPE, dtype=torch.bfloat16)
    rng = random.Random(case)
    if case == "one_stretch":
        src, dst = [10, 11, 12, 13, 14], [30, 31, 32, 33, 34]
    else:  # scattered both ways
        src = rng.sample(range(SHAPE[0]), 20)
        dst = rng.sample(range(SHAPE[0]), 20)
    if case == "mixed":  # a long stretch among scattered blocks
        src = [b for b in src if b < 30][:10] + list(range(30, 40))
        dst = [b for b in dst if b < 30][: len(src) - 10] + list(range(38, 48))
    runs = block_runs(dst, max_blocks=len(dst))
    plan = copy_runs(_rows(local), _rows(remote), src, runs, same_device=case != "per_run")
    expected_copies = {"one_stretch": 1, "scattered": 0, "mixed": 1, "per_run": len(src)}
    assert len(plan.copies) == expected_copies[case], plan.copies
    assert len(plan.pairs) + sum(n for _, _, n in plan.copies) == len(src)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(remote[d].view(torch.int16), local[s].view(torch.int16)), (s, d)
    others = [b for b in range(SHAPE[0]) if b not in dst]
    assert not remote[others].view(torch.int16).any()


class _FakeEvent:
    """Completes after `polls` queries, or when synchronized; counts both."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.queries = 0
        self.synced: list[str] = []

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.polls

    def synchronize(self) -> None:
        self.synced.append(threading.current_thread().name)
        self.polls = 0


def test_wait_event_polls_on_the_loop_then_falls_back_to_a_thread() -> None:
    async def run() -> None:
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="waiter")
        try:
            # Done after a few polls: no thread involved, other tasks ran meanwhile.
            ticks = 0

            async def other() -> None:
                nonlocal ticks
                for _ in range(3):
                    ticks += 1
                    await asyncio.sleep(0)

            quick = _FakeEvent(polls=3)
            await asyncio.gather(wait_event(quick, executor), other())  # type: ignore[arg-type]
            assert quick.queries == 4 and quick.synced == [] and ticks == 3
            # Still running after the spin: one wait on the executor's thread.
            slow = _FakeEvent(polls=10**9)
            await wait_event(slow, executor, spin_s=0.0)  # type: ignore[arg-type]
            assert len(slow.synced) == 1 and slow.synced[0].startswith("waiter")
            # Cancelled while polling: the device work is waited for before the cancellation.
            stuck = _FakeEvent(polls=10**9)
            task = asyncio.ensure_future(wait_event(stuck, executor, spin_s=60.0))  # type: ignore[arg-type]
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stuck.synced == [threading.current_thread().name]
        finally:
            executor.shutdown(wait=True)

    asyncio.run(run())


def test_rows_use_wide_words() -> None:
    assert _rows(torch.zeros(SHAPE, dtype=torch.bfloat16)).dtype == torch.int64
    assert _rows(torch.zeros((4, 3), dtype=torch.bfloat16)).dtype == torch.int16
    assert _rows(torch.zeros((4, 3), dtype=torch.uint8)).dtype == torch.uint8


class _NoEngine:
    async def reserve(self, request: Any) -> Any:
        raise AssertionError("not used here")

    async def abort_requests(self, request_ids: Any) -> None:
        raise AssertionError("not used here")

    def kv_cache_ipc_handle(self) -> None:
        raise AssertionError("not used here")


def test_transports_send_by_the_hand_offs_transport() -> None:
    async def run() -> None:
        src = torch.randn(SHAPE)
        dst = torch.zeros(SHAPE)
        hub = InProcessKVHub()
        sender = KVTransports({"inproc": InProcessKVConnector(src, _NoEngine(), hub, "p")})
        InProcessKVConnector(dst, _NoEngine(), hub, "d")
        n = await sender.send_blocks("r", [3, 4], KVDestination("d", "d", (7, 9), "inproc"))
        assert n == 2 * sender.layout.bytes_per_block
        assert torch.equal(dst[7], src[3]) and torch.equal(dst[9], src[4])
        with pytest.raises(KVTransferError, match="does not speak KV transport 'nccl'"):
            await sender.send_blocks("r", [3], KVDestination("d", "d", (1,), "nccl"))
        with pytest.raises(KVTransferError, match="no connect/write sessions"):
            sender._remote("inproc")
        assert sender.names == ["inproc"]

    asyncio.run(run())


def _gloo_connector(cache: torch.Tensor, worker_id: str) -> RemoteKVConnector[Any]:
    """The NCCL mover's code over gloo, in its sessions (10 s timeouts)."""
    from tandem.kv_transfer.base import DirectEngine
    from tandem.kv_transfer.nccl import NcclMover

    mover = NcclMover(cache, DirectEngine(), worker_id, "gloo", group_timeout_s=10.0)
    return RemoteKVConnector(mover, 10.0)


def test_receiver_clears_the_mark_before_done_reaches_the_sender() -> None:
    """One process, both ends of a gloo pair: when send_blocks returns, the receiver's
    "being written" mark is already gone (AddPrefilled, sent next, must find it cleared)."""
    from tandem_services.worker.kv_standalone import start_receiver

    async def run() -> None:
        src = torch.randn(SHAPE)
        dst = torch.zeros(SHAPE)
        recv = _gloo_connector(dst, "d")
        server, address, receiver = await start_receiver(
            KVTransports({"nccl": recv}), {"r0": [5, 6, 9], "r1": [1, 2]}
        )
        send = _gloo_connector(src, "p")
        try:
            for rid, s, d in (("r0", [3, 4, 8], (5, 6, 9)), ("r1", [0], (1, 2))):
                n = await send.send_blocks(rid, s, KVDestination("d", address, d, "nccl"))
                assert n == len(s) * send.layout.bytes_per_block
                assert receiver.being_written == {}, rid
                for a, b in zip(s, d, strict=False):
                    assert torch.equal(dst[b], src[a])
            assert not dst[[0, 2, 3, 4, 7, 8]].any()
            assert [r.request_id for r in send.history] == ["r0", "r1"]
        finally:
            await send.close()
            await server.stop(0)
            await recv.close()

    asyncio.run(run())


def test_one_session_carries_a_batch_with_refused_requests() -> None:
    """Three hand-offs queued at once go in one session; the receiver refuses two (no
    reservation; blocks outside it) and writes the third; every mark is cleared."""
    from tandem_services.worker.kv_standalone import start_receiver

    async def run() -> None:
        src = torch.randn(SHAPE)
        dst = torch.zeros(SHAPE)
        recv = _gloo_connector(dst, "d")
        server, address, receiver = await start_receiver(
            KVTransports({"nccl": recv}), {"ok": [5, 6, 9], "bad": [1, 2]}
        )
        send = _gloo_connector(src, "p")

        async def one(rid: str, s: list[int], d: tuple[int, ...]) -> int | str:
            try:
                return await send.send_blocks(rid, s, KVDestination("d", address, d, "nccl"))
            except KVTransferError as exc:
                return str(exc)

        try:
            await send.peer(KVDestination("d", address, (0,), "nccl"))
            ok, ghost, bad = await asyncio.gather(
                one("ok", [3, 4, 8], (5, 6, 9)), one("ghost", [1], (7,)), one("bad", [2], (3,))
            )
            assert ok == 3 * send.layout.bytes_per_block
            assert isinstance(ghost, str) and "no blocks are reserved" in ghost
            assert isinstance(bad, str) and "not reserved" in bad
            assert receiver.sessions == 1 and receiver.being_written == {}
            assert [(r.request_id, r.batch_size) for r in send.history] == [("ok", 3)]
            for a, b in zip([3, 4, 8], [5, 6, 9], strict=True):
                assert torch.equal(dst[b], src[a])
            assert not dst[[0, 1, 2, 3, 4, 7, 8]].any()
        finally:
            await send.close()
            await server.stop(0)
            await recv.close()

    asyncio.run(run())


def test_the_scheduler_side_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import tandem.kv_transfer.placement, tandem_services.scheduler.dispatcher\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _SharedCacheMover(KVMover[torch.Tensor]):
    """The CUDA IPC session protocol over CPU tensors in one process: the "opened" cache is
    the receiver's tensor itself; each write copies by the CUDA IPC plan, then stands for a
    device wait of `write_s`. Records how many writes overlap."""

    transport = "cuda_ipc"

    def __init__(
        self, cache: torch.Tensor, caches: dict[str, torch.Tensor], max_sessions: int
    ) -> None:
        from tandem.kv_transfer.base import DirectEngine

        super().__init__(cache, DirectEngine(), "shared", max_sessions)
        self.caches = caches
        self.writing = 0
        self.most_writing = 0
        self.write_s = 0.02

    async def handshake(self, prefill_worker_id: str) -> None:
        return None

    async def open(self, dst: KVDestination, handshake: object | None) -> torch.Tensor:
        return self.caches[dst.worker_id]

    async def write(self, peer: torch.Tensor, src: list[int], runs: list[Any]) -> None:
        copy_runs(_rows(self.cache.kv_cache), _rows(peer), src, runs)
        self.writing += 1
        self.most_writing = max(self.most_writing, self.writing)
        try:
            await asyncio.sleep(self.write_s)
        finally:
            self.writing -= 1


def _SharedCacheConnector(
    cache: torch.Tensor, caches: dict[str, torch.Tensor], max_sessions: int
) -> RemoteKVConnector[torch.Tensor]:
    return RemoteKVConnector(_SharedCacheMover(cache, caches, max_sessions))


@pytest.mark.parametrize("max_sessions", [1, 4])
def test_sessions_share_the_queue_and_overlap(max_sessions: int) -> None:
    """12 closed-loop senders, 3 hand-offs each, to one decode worker: with 4 sessions allowed,
    the queue is split (4 per session, 3 sessions writing at once); with one, each session
    takes every queued hand-off. Three hand-offs queued at once always share one session.
    Every block lands where it was sent."""
    from tandem_services.worker.kv_standalone import start_receiver

    async def run() -> None:
        src = torch.randn(SHAPE)
        dst = torch.zeros(SHAPE)
        recv = _SharedCacheConnector(dst, {}, max_sessions)
        server, address, receiver = await start_receiver(KVTransports({"cuda_ipc": recv}), None)
        send = _SharedCacheConnector(src, {"d": dst}, max_sessions)

        def dest(blocks: list[int]) -> KVDestination:
            return KVDestination("d", address, tuple(blocks), "cuda_ipc")

        try:
            await send.peer(dest([0]))
            # One step's three prefills: one session.
            await asyncio.gather(
                *(send.send_blocks(f"s{i}", [i], dest([40 + i])) for i in range(3))
            )
            assert [r.batch_size for r in send.history] == [3, 3, 3]

            async def sender(j: int) -> None:
                for k in range(3):
                    s = [(j * 3 + k) % SHAPE[0], (j * 7 + k) % SHAPE[0]]
                    await send.send_blocks(f"r{j}-{k}", s, dest([2 * j, 2 * j + 1]))

            send.history.clear()
            await asyncio.gather(*(sender(j) for j in range(12)))
            batches = [r.batch_size for r in send.history]
            if max_sessions == 1:
                assert set(batches) == {12} and send.mover.most_writing == 1, batches
            else:
                assert set(batches) == {4} and send.mover.most_writing == 3, batches
            for j in range(12):
                for i, s in enumerate([(j * 3 + 2) % SHAPE[0], (j * 7 + 2) % SHAPE[0]]):
                    assert torch.equal(dst[2 * j + i], src[s]), (j, i)
            for i in range(3):
                assert torch.equal(dst[40 + i], src[i])
            assert receiver.being_written == {}
        finally:
            await send.close()
            await server.stop(0)
            await recv.close()

    asyncio.run(run())


def test_sessions_reuse_their_write_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """One hand-off after another: every session runs on the first WriteKV stream (refused
    requests included); a stream parked past IDLE_STREAM_S is closed and the next session opens
    a new one; a session that broke takes its stream with it."""
    import tandem_services.worker.kv_sessions as session_mod
    from tandem_services.worker.kv_standalone import start_receiver

    monkeypatch.setattr(session_mod, "IDLE_STREAM_S", 0.2)

    async def run() -> None:
        src = torch.randn(SHAPE)
        dst = torch.zeros(SHAPE)
        recv = _SharedCacheConnector(dst, {}, 4)
        reservations: dict[str, Any] = {f"r{i}": [i] for i in range(12)}
        server, address, receiver = await start_receiver(
            KVTransports({"cuda_ipc": recv}), reservations
        )
        send = _SharedCacheConnector(src, {"d": dst}, 4)
        send.mover.write_s = 0.0

        def dest(blocks: list[int]) -> KVDestination:
            return KVDestination("d", address, tuple(blocks), "cuda_ipc")

        try:
            for i in range(6):
                await send.send_blocks(f"r{i}", [20 + i], dest([i]))
            with pytest.raises(KVTransferError, match="no blocks are reserved"):
                await send.send_blocks("ghost", [1], dest([30]))
            assert (receiver.streams, receiver.sessions) == (1, 7)
            for i in range(6):
                assert torch.equal(dst[i], src[20 + i])
            await asyncio.sleep(0.5)  # parked past IDLE_STREAM_S: closed
            await send.send_blocks("r6", [26], dest([6]))
            assert (receiver.streams, receiver.sessions) == (2, 8)
            assert sum(len(lane.idle) for lane in send._lanes.values()) == 1

            async def broken(peer: Any, src_ids: list[int], runs: list[Any]) -> None:
                raise RuntimeError("device lost")

            send.mover.write = broken  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="device lost"):
                await send.send_blocks("r7", [27], dest([7]))
            assert sum(len(lane.idle) for lane in send._lanes.values()) == 0
            for _ in range(50):  # the receiver ends the broken stream's marks
                if not receiver.being_written:
                    break
                await asyncio.sleep(0.01)
            assert receiver.being_written == {}
            del send.mover.write
            await send.send_blocks("r8", [28], dest([8]))
            assert receiver.streams == 3 and torch.equal(dst[8], src[28])
        finally:
            await send.close()
            await server.stop(0)
            await recv.close()

    asyncio.run(run())


def test_handshakes_travel_in_connect_kv_field_for_field() -> None:
    """A mover's handshake dataclass and its ConnectKV message agree name for name: what the
    decode side's mover answers is what the prefill side's mover opens (the CUDA IPC one can
    only be opened on a GPU, so its fields are checked here)."""
    from tandem.kv_transfer.cuda_ipc import CudaIpcHandle
    from tandem.kv_transfer.nccl import NcclRendezvous
    from tandem_protos.v1 import worker_pb2
    from tandem_services.worker.kv_sessions import handshake_from_proto, handshake_to_proto

    ipc = CudaIpcHandle(
        host_id="boot-1",
        gpu_uuid="GPU-abc",
        mem_handle=b"\x00\x01mem",
        storage_size_bytes=1 << 33,
        storage_offset_bytes=512,
        ref_counter_handle=b"ref",
        ref_counter_offset=8,
        event_handle=b"",
        event_sync_required=True,
        shape=(48, 2, 2, 4, 2, 8),
        stride=(256, 128, 64, 16, 8, 1),
        storage_offset=3,
    )
    rendezvous = NcclRendezvous(store_port=29511, group_name="tandem-kv/d/p/0", backend="gloo")
    for handshake, field in ((ipc, "cuda_ipc"), (rendezvous, "nccl")):
        reply = handshake_to_proto(handshake)
        assert reply.WhichOneof("info") == field
        wire = worker_pb2.ConnectKVResponse.FromString(reply.SerializeToString())
        assert handshake_from_proto(wire) == handshake
    assert worker_pb2.ConnectKVResponse().WhichOneof("info") is None
    assert handshake_from_proto(handshake_to_proto(None)) is None
    fields = {f.name for f in worker_pb2.CudaIpcHandle.DESCRIPTOR.fields}
    assert fields == set(CudaIpcHandle.__dataclass_fields__)
    fields = {f.name for f in worker_pb2.NcclRendezvous.DESCRIPTOR.fields}
    assert fields == set(NcclRendezvous.__dataclass_fields__)


def test_ranked_cache_view_moves_each_ranks_share_to_the_same_rank() -> None:
    """Several ranks' caches move as one: a run's bytes are each rank's bytes of it in rank
    order, split again on the receiving side, rank to rank."""
    import torch

    from tandem.kv_transfer.base import KVCacheView, KVLayout, KVTransferError

    shape = (6, 2, 2, 4, 1, 8)  # 6 blocks, 2 layers, K/V, 4 tokens, 1 KV head a rank, dim 8
    src = [torch.randn(shape), torch.randn(shape)]
    dst = [torch.zeros(shape), torch.zeros(shape)]
    send, recv = KVCacheView(src), KVCacheView(dst)
    assert send.layout == recv.layout == KVLayout(2, 4, 1, 8, "float32", num_ranks=2)
    assert send.layout.bytes_per_block == 2 * send.layout.rank_bytes_per_block
    data = send.read([4, 1])  # out of order: block 4 then block 1
    recv.write(2, 2, data)
    for rank in range(2):
        assert torch.equal(dst[rank][2], src[rank][4])
        assert torch.equal(dst[rank][3], src[rank][1])
        assert dst[rank][[0, 1, 4, 5]].abs().sum() == 0
    # One rank's layout never equals two ranks' (a TP = 1 peer of a TP = 2 engine).
    assert KVCacheView(src[0]).layout != send.layout
    with pytest.raises(KVTransferError, match="needs"):
        recv.write(0, 1, data)
    with pytest.raises(ValueError, match="ranks' KV caches differ"):
        KVCacheView([torch.zeros(shape), torch.zeros((6, 1, 2, 4, 1, 8))])


def test_cache_view_reads_and_writes_a_layer_major_cpu_cache_in_place() -> None:
    """The CPU engine's cache is a transposed view (layer-major memory): whole-block reads and
    writes reach its memory (not a copy of it), and a block's bytes are the same as from a
    block-major cache (the wire format does not depend on the layout)."""
    from tandem.kv_transfer.base import KVCacheView
    from tandem.worker.cpu_memory import layer_major_kv_cache

    shape = (6, 3, 2, 4, 2, 8)  # blocks, layers, K/V, block size, KV heads, head size
    cache = layer_major_kv_cache(shape, torch.bfloat16)
    assert not cache.is_contiguous()
    src = torch.randn(shape).to(torch.bfloat16)  # block-major
    view = KVCacheView(cache)
    view.write(1, 3, KVCacheView(src).read([5, 0, 2]))
    for dst_block, src_block in ((1, 5), (2, 0), (3, 2)):
        assert torch.equal(cache[dst_block], src[src_block])
    assert not cache[[0, 4, 5]].view(torch.int16).any(), "blocks outside the run changed"
    # What the engine writes into its cache is what a read sends.
    cache[4].copy_(src[3])
    assert view.read([4]) == KVCacheView(src).read([3])
    assert view.read([2, 4, 1]) == KVCacheView(src).read([0, 3, 5])
    assert view.read([1, 2]) == KVCacheView(src).read([5, 0])
