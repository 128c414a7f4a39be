"""CUDA IPC KV hand-off on one GPU, between processes.

1. Two processes: a decode process shares its (zeroed) bf16 cache through ConnectKV; a prefill
   process opens it and writes shuffled, non-contiguous blocks of several requests (copy_ per
   stretch, the block-copy kernel, both in one session, batched sessions, refusals, an
   abandoned session, a reconnect). Every destination block must equal its source bit for
   bit; no other block may change.
2. Disaggregated serving: scheduler + prefill worker + decode worker (separate processes on the
   GPU, --kv-connector cuda-ipc) against scheduler + unified worker: greedy outputs of 20
   prompts equal (a divergence is tolerated only at a near-tie of the two best logprobs, and
   at least 16 must match exactly); aborts leave both block pools whole.

The model is `random:llama-3.2-1b` in float32 (no tokenizer: this test plays the frontend,
submitting token ids to the scheduler and reading the workers' output streams).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.kv_pair import run_kv_pair

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SHAPE = (256, 4, 2, 16, 8, 64)  # blocks, layers, k/v, block_size, kv heads, head size
DTYPE = torch.bfloat16
SEED = 21
Job = tuple[list[int], list[int]]


def source_cache() -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    return torch.randn(SHAPE, generator=gen).to(DTYPE)


def make_jobs() -> dict[str, Job]:
    rng = random.Random(SEED)
    free = list(range(SHAPE[0]))
    rng.shuffle(free)
    jobs: dict[str, Job] = {}
    # Long consecutive runs both sides: one copy_ per stretch.
    jobs["runs"] = (list(range(100, 140)), [*range(200, 230), *range(10, 20), 240])
    used = set(jobs["runs"][1]) | set(range(100, 120))
    free = [b for b in free if b not in used]
    # A long stretch among scattered blocks: one copy_ and one kernel launch.
    mixed_dst, free = free[:12], free[12:]
    jobs["mixed"] = (
        [*rng.sample(range(SHAPE[0]), 12), *range(150, 170)],
        [*mixed_dst, *range(100, 120)],
    )
    # Scattered both sides: more stretches than MAX_COPIES -> one kernel launch.
    for rid, n in (("scatter", 24), ("c0", 5), ("c1", 9), ("c2", 3), ("after", 7)):
        dst, free = free[: n + 1], free[n + 1 :]
        jobs[rid] = (rng.sample(range(SHAPE[0]), n), dst)
    return jobs


def decode_main(conn: Connection, reservations: dict[str, list[int]], out: str) -> None:
    asyncio.run(_decode(conn, reservations, out))


async def _decode(conn: Connection, reservations: dict[str, list[int]], out: str) -> None:
    from tandem.kv_transfer.base import DirectEngine
    from tandem.kv_transfer.cuda_ipc import CudaIpcMover
    from tandem.kv_transfer.placement import CUDA_IPC
    from tandem_services.worker.kv_sessions import RemoteKVConnector
    from tandem_services.worker.kv_standalone import start_receiver
    from tandem_services.worker.kv_transports import KVTransports

    cache = torch.zeros(SHAPE, dtype=DTYPE, device="cuda")
    receiving = RemoteKVConnector(CudaIpcMover(cache, DirectEngine(), "decode-0"))
    transports = KVTransports({CUDA_IPC: receiving})
    server, address, receiver = await start_receiver(transports, reservations)
    conn.send(address)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    deadline = time.monotonic() + 10
    while receiver.being_written and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    torch.cuda.synchronize()
    torch.save(cache.cpu(), out)
    conn.send({"being_written": dict(receiver.being_written), "sessions": receiver.sessions})
    await server.stop(0)
    await transports.close()


def prefill_main(conn: Connection, address: str, jobs: dict[str, Job]) -> None:
    conn.send(asyncio.run(_prefill(address, jobs)))


async def _prefill(address: str, jobs: dict[str, Job]) -> dict[str, Any]:
    from tandem.kv_transfer.base import DirectEngine, KVDestination, KVTransferError
    from tandem.kv_transfer.cuda_ipc import CudaIpcMover
    from tandem_protos.v1 import worker_pb2, worker_pb2_grpc
    from tandem_services.worker.kv_sessions import BEGIN, READY, RemoteKVConnector

    connector = RemoteKVConnector(CudaIpcMover(source_cache().cuda(), DirectEngine(), "prefill-0"))

    def dest(dst: list[int]) -> KVDestination:
        return KVDestination("decode-0", address, tuple(dst), transport="cuda_ipc")

    result: dict[str, Any] = {"bytes": {}, "errors": {}}

    async def send(rid: str, src: list[int], dst: list[int], c: Any = connector) -> None:
        try:
            result["bytes"][rid] = await c.send_blocks(rid, src, dest(dst))
        except KVTransferError as exc:
            result["errors"][rid] = str(exc)

    await send("runs", *jobs["runs"])
    await send("mixed", *jobs["mixed"])
    await send("scatter", *jobs["scatter"])
    await asyncio.gather(*(send(rid, *jobs[rid]) for rid in ("c0", "c1", "c2")))
    await send("ghost", [1, 2], [50, 51, 52])
    await send("c0", [1], [0, 1])
    other = RemoteKVConnector(
        CudaIpcMover(source_cache().float().cuda(), DirectEngine(), "prefill-1")
    )
    await send("layout", [1], jobs["after"][1], c=other)
    await other.close()
    # Abandoned after READY (nothing was written), then a reconnect (a second share/open).
    peer = await connector.peer(dest([0]))
    call = worker_pb2_grpc.WorkerStub(connector._channel(address)).WriteKV()
    await call.write(
        worker_pb2.KVWriteMessage(
            phase=BEGIN,
            request_id="abandoned",
            transport="cuda_ipc",
            first_block_ids=[jobs["after"][1][0]],
            num_blocks=[1],
        )
    )
    result["abandoned_ready"] = (await call.read()).phase == READY
    call.cancel()
    connector._forget_peer(address, peer)
    await send("after", *jobs["after"])
    result["data_s"] = {r.request_id: r.data_s for r in connector.history}
    result["batches"] = {r.request_id: r.batch_size for r in connector.history}
    await connector.close()
    return result


def test_two_processes_copy_blocks_byte_exact(tmp_path: Path) -> None:
    jobs = make_jobs()
    reservations = {rid: dst for rid, (_, dst) in jobs.items()}
    reservations["abandoned"] = list(jobs["after"][1])
    reservations["layout"] = list(jobs["after"][1])
    out = tmp_path / "decode_cache.pt"
    result, report = run_kv_pair(
        decode_main,
        prefill_main,
        reservations,
        jobs,
        out,
        start_timeout_s=120,
        finish_timeout_s=180,
    )

    src, dst = source_cache(), torch.load(out)
    good = ("runs", "mixed", "scatter", "c0", "c1", "c2", "after")
    assert set(result["bytes"]) == set(good), result["errors"]
    assert "no blocks are reserved" in result["errors"]["ghost"]
    assert "not reserved" in result["errors"]["c0"]
    assert "layouts differ" in result["errors"]["layout"]
    assert result["abandoned_ready"]
    bytes_per_block = src[0].numel() * src.element_size()
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
    assert report["being_written"] == {}
    # c0, c1, c2 were handed off at once: one write session, one copy launch for all three.
    assert result["batches"]["c0"] == result["batches"]["c1"] == result["batches"]["c2"] == 3
    print("data path seconds per request:", result["data_s"])


# ----------------------------------------------------------------------------- serving

MODEL = os.environ.get("TANDEM_GPU_IPC_MODEL", "random:llama-3.2-1b")
DEVICE = "cuda"
DISAGG_CONNECTOR = "cuda-ipc"
PROMPT_VOCAB = 128000
NUM_PROMPTS = 20
NEW_TOKENS = 24
NEAR_TIE = 1e-3
WORKER_ARGS = [
    "--model",
    MODEL,
    "--device",
    DEVICE,
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--num-gpu-blocks",
    "2048",
    "--max-num-seqs",
    "32",
]


@dataclass
class _Stream:
    parts: list[tuple[int, list[int], list[Any]]] = field(default_factory=list)
    final_len: int | None = None
    error: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, out: Any) -> None:
        from tandem_protos.v1 import common_pb2

        self.parts.append((out.output_index, list(out.new_token_ids), list(out.logprobs)))
        if out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.final_len = out.output_index + len(out.new_token_ids)
            self.error = out.error
        if self.final_len is not None and sum(len(p[1]) for p in self.parts) >= self.final_len:
            self.done.set()

    def tokens(self) -> tuple[list[int], list[Any]]:
        ids: list[int] = []
        lps: list[Any] = []
        for _, t, lp in sorted(self.parts, key=lambda p: p[0]):
            ids += t
            lps += lp
        return ids, lps


class MiniFrontend:
    """Plays the frontend: Submit to the scheduler with token ids, read every worker's output
    stream for this destination."""

    def __init__(self, scheduler: str, workers: list[str], name: str) -> None:
        self.scheduler, self.workers, self.name = scheduler, workers, name
        self.streams: dict[str, _Stream] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: list[grpc.aio.Channel] = []

    async def __aenter__(self) -> MiniFrontend:
        from tandem_protos.v1 import worker_pb2, worker_pb2_grpc

        for address in self.workers:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            call = worker_pb2_grpc.WorkerStub(channel).StreamOutputs(
                worker_pb2.StreamOutputsRequest(destination=self.name)
            )
            self._tasks.append(asyncio.create_task(self._read(call)))
        await asyncio.sleep(0.5)  # the streams are open before the first request
        return self

    async def _read(self, call: Any) -> None:
        async for step in call:
            for out in step.outputs:
                self.streams.setdefault(out.request_id, _Stream()).add(out)

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for channel in self._channels:
            await channel.close()

    async def submit(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        from tandem_protos.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

        self.streams.setdefault(rid, _Stream())
        params = common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2
        )
        async with grpc.aio.insecure_channel(self.scheduler) as channel:
            await scheduler_pb2_grpc.SchedulerStub(channel).Submit(
                scheduler_pb2.SubmitRequest(
                    request=common_pb2.EngineRequest(
                        request_id=rid, prompt_token_ids=prompt, sampling_params=params
                    ),
                    destination=self.name,
                ),
                timeout=120,
            )

    async def generate(self, rid: str, prompt: list[int], max_tokens: int) -> _Stream:
        await self.submit(rid, prompt, max_tokens)
        stream = self.streams[rid]
        await asyncio.wait_for(stream.done.wait(), 300)
        return stream

    async def abort(self, rids: list[str]) -> None:
        from tandem_protos.v1 import common_pb2, scheduler_pb2_grpc

        async with grpc.aio.insecure_channel(self.scheduler) as channel:
            await scheduler_pb2_grpc.SchedulerStub(channel).Abort(
                common_pb2.AbortRequest(request_ids=rids), timeout=30
            )


@dataclass
class _Deployment:
    services: dict[str, Any]

    @property
    def scheduler(self) -> str:
        return self.services["scheduler"].info["grpc"]

    def workers(self) -> list[str]:
        return [s.info["grpc"] for n, s in self.services.items() if n != "scheduler"]

    def log(self, name: str) -> str:
        path = self.services[name].log_path
        return Path(path).read_text(errors="replace") if path else ""


# Per deployment kind: the scheduler's --kv-connector, and (role, arguments) of each worker.
Plans = dict[str, tuple[str, list[tuple[str, list[str]]]]]


@contextmanager
def start_deployments(
    tmp_path_factory: pytest.TempPathFactory, name: str, plans: Plans
) -> Iterator[dict[str, _Deployment]]:
    """Every deployment of `plans` at once: its scheduler, then its workers (worker id
    <role>-0, service <kind>-<role>), all ready within 400 s. Stopped in reverse order; the
    log tail of any service that exits uncleanly is printed."""
    from tandem_services.launcher import ServeConfig, spawn_service, stop_process, wait_ready

    config = ServeConfig(log_dir=str(tmp_path_factory.mktemp(f"{name}-logs")))
    work = tmp_path_factory.mktemp(f"{name}-ready")
    deadline = time.monotonic() + 400
    deps: dict[str, _Deployment] = {}
    started: list[Any] = []
    try:
        for kind, (connector, workers) in plans.items():
            sched = spawn_service(
                config,
                f"{kind}-scheduler",
                "tandem_services.scheduler",
                ["--host", "127.0.0.1", "--port", "0", "--kv-connector", connector],
                work,
            )
            started.append(sched)
            wait_ready([sched], deadline)
            services = {"scheduler": sched}
            for role, args in workers:
                module = (
                    "tandem_services.prefill_worker"
                    if role == "prefill"
                    else "tandem_services.decode_worker"
                )
                extra = ["--unified"] if role == "unified" else []
                svc = spawn_service(
                    config,
                    f"{kind}-{role}",
                    module,
                    [
                        "--host",
                        "127.0.0.1",
                        "--port",
                        "0",
                        "--scheduler",
                        sched.info["grpc"],
                        "--worker-id",
                        f"{role}-0",
                        *extra,
                        *args,
                    ],
                    work,
                )
                started.append(svc)
                services[role] = svc
            deps[kind] = _Deployment(services)
        wait_ready(started, deadline)
        yield deps
    finally:
        for svc in reversed(started):
            code = stop_process(svc.process, 30)
            if code != 0 and svc.log_path is not None:
                print(f"---- {svc.name} (exit {code}) ----")
                print(svc.log_tail(60))


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Deployment]]:
    plans: Plans = {
        "unified": ("auto", [("unified", WORKER_ARGS)]),
        "disagg": (DISAGG_CONNECTOR, [("prefill", WORKER_ARGS), ("decode", WORKER_ARGS)]),
    }
    with start_deployments(tmp_path_factory, "ipc-serving", plans) as deps:
        for dep in deps.values():  # the ready files carry the addresses
            for svc in dep.services.values():
                assert svc.info
        yield deps


def serving_prompts(max_len: int = 1500, vocab: int = PROMPT_VOCAB) -> list[list[int]]:
    rng = random.Random(7)
    lengths = [rng.randrange(20, max_len) for _ in range(NUM_PROMPTS)]
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


async def run_all(
    dep: _Deployment, name: str, prompts: list[list[int]] | None = None
) -> list[_Stream]:
    """Every prompt (default: `serving_prompts()`) through `dep` at once, greedy, NEW_TOKENS
    each."""
    async with MiniFrontend(dep.scheduler, dep.workers(), name) as fe:
        return await asyncio.gather(
            *(
                fe.generate(f"{name}-{i}", p, NEW_TOKENS)
                for i, p in enumerate(serving_prompts() if prompts is None else prompts)
            )
        )


def _pools_whole(dep: _Deployment) -> bool:
    from tandem_protos.v1 import worker_pb2, worker_pb2_grpc

    for address in dep.workers():
        with grpc.insecure_channel(address) as channel:
            s = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)
        if (
            s.num_inflight
            or s.num_running
            or s.num_waiting
            or s.num_held
            or s.num_reserved
            or s.num_free_blocks != s.num_blocks
        ):
            return False
    return True


def _wait_pools_whole(dep: _Deployment, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not _pools_whole(dep):
        assert time.monotonic() < deadline, "blocks leaked"
        time.sleep(0.2)


def count_exact_matches(ref: list[_Stream], ours: list[_Stream]) -> int:
    """Greedy streams against the reference: the number identical; every other one must first
    differ at a near-tie of the reference's logprobs (gap < NEAR_TIE)."""
    exact = 0
    for i, (r, o) in enumerate(zip(ref, ours, strict=True)):
        assert not r.error and not o.error, (r.error, o.error)
        r_ids, r_lps = r.tokens()
        o_ids, _ = o.tokens()
        assert len(r_ids) == len(o_ids) == NEW_TOKENS, i
        if r_ids == o_ids:
            exact += 1
            continue
        j = next(k for k, (a, b) in enumerate(zip(r_ids, o_ids, strict=True)) if a != b)
        lp = r_lps[j]
        ranked = dict(zip(lp.token_ids, lp.logprobs, strict=True))
        gap = ranked[r_ids[j]] - ranked.get(o_ids[j], float("-inf"))
        assert gap < NEAR_TIE, f"prompt {i}: differs at token {j} with a logprob gap of {gap}"
    return exact


def test_disaggregated_cuda_ipc_matches_unified(deployments: dict[str, _Deployment]) -> None:
    ref = asyncio.run(run_all(deployments["unified"], "u"))
    ours = asyncio.run(run_all(deployments["disagg"], "d"))
    exact = count_exact_matches(ref, ours)
    assert exact >= 16, f"only {exact} of {NUM_PROMPTS} prompts matched exactly"
    print(f"exact matches: {exact}/{NUM_PROMPTS}")
    disagg = deployments["disagg"]
    over = "over " + DISAGG_CONNECTOR.replace("-", "_")
    assert over in disagg.log("scheduler") and over in disagg.log("prefill")
    _wait_pools_whole(disagg)
    _wait_pools_whole(deployments["unified"])


def test_aborts_free_blocks_on_both_sides(deployments: dict[str, _Deployment]) -> None:
    dep = deployments["disagg"]
    prompts = serving_prompts()[:6]

    async def run() -> None:
        async with MiniFrontend(dep.scheduler, dep.workers(), "abort") as fe:
            # Aborted while decoding (a few tokens out) ...
            for i in range(3):
                await fe.submit(f"late-{i}", prompts[i], 1000)
            deadline = time.monotonic() + 120
            while any(len(fe.streams[f"late-{i}"].tokens()[0]) < 3 for i in range(3)):
                assert time.monotonic() < deadline, "no tokens"
                await asyncio.sleep(0.05)
            # ... and at once (prefilling, handing off or just reserved).
            for i in range(3, 6):
                await fe.submit(f"early-{i}", prompts[i], 1000)
            await fe.abort([f"early-{i}" for i in range(3, 6)])
            await fe.abort([f"late-{i}" for i in range(3)])

    asyncio.run(run())
    _wait_pools_whole(dep)
