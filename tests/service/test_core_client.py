"""EngineCoreClient: the in-process and the multiprocess engines agree token for token, and an
engine process that dies is noticed at once (by its client, and by the worker around it).

Real engines (the embedded SmolLM2 on the CPU), real child processes, real pipes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from tandem.config import EngineConfig
from tandem.core.outputs import EngineCoreOutput
from tandem.engine.core import InvalidRequestError
from tandem.engine.core_client import (
    AsyncMPClient,
    EngineCoreClient,
    EngineDeadError,
    InprocClient,
    SyncMPClient,
)
from tandem.engine.core_proc import EngineProcOptions
from tandem.engine.serial import Piggyback
from tandem.engine_args import EngineArgs
from tandem.request import EngineCoreRequest
from tandem.sampling_params import SamplingParams

from .conftest import PROMPTS, interrupt_a_stream, launch, wait_until


def _config(model: Path, async_scheduling: str = "auto") -> EngineConfig:
    return EngineArgs(
        model=str(model), dtype="float32", device="cpu", num_gpu_blocks=64,
        max_model_len=512, num_threads=1, async_scheduling=async_scheduling,
    ).create_engine_config()  # fmt: skip


def _requests() -> list[EngineCoreRequest]:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=10, ignore_eos=True)
    stop_early = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [
        EngineCoreRequest("greedy-0", list(range(20, 60)), greedy),
        EngineCoreRequest("greedy-1", list(range(100, 117)), greedy),
        EngineCoreRequest("seeded", list(range(300, 340)), seeded),
        EngineCoreRequest("aborted", list(range(500, 530)), stop_early),
    ]


def _run(client: EngineCoreClient) -> tuple[dict[str, list[int]], dict[str, str | None]]:
    for req in _requests():
        client.add_request(req)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    steps = 0
    while client.has_unfinished_requests():
        outs = client.get_output()
        steps += 1
        if steps == 4:
            client.abort_requests(["aborted"])
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return tokens, finish


@pytest.fixture(scope="module")
def clients(smollm2_path: Path) -> Iterator[tuple[InprocClient, SyncMPClient]]:
    inproc = InprocClient(_config(smollm2_path))
    mp = SyncMPClient(_config(smollm2_path))
    try:
        yield inproc, mp
    finally:
        mp.shutdown()
        inproc.shutdown()


def test_inproc_and_multiprocess_clients_agree(clients: tuple[InprocClient, SyncMPClient]) -> None:
    inproc, mp = clients
    assert mp.info.pid not in (0, os.getpid())
    assert (mp.info.num_blocks, mp.info.block_size) == (inproc.info.num_blocks, 16)
    a_tokens, a_finish = _run(inproc)
    b_tokens, b_finish = _run(mp)
    assert a_tokens["greedy-0"] and len(a_tokens["seeded"]) == 10
    for rid in ("greedy-0", "greedy-1", "seeded"):
        assert b_tokens[rid] == a_tokens[rid], rid
    assert a_finish["greedy-0"] == b_finish["greedy-0"] == "length"
    assert b_finish.get("aborted") in (None, "abort")  # an abort asked for emits nothing
    assert len(b_tokens.get("aborted", [])) < 40
    for client in (inproc, mp):
        s = client.stats()
        assert (s.num_running, s.num_waiting) == (0, 0)
        assert s.num_free_blocks == s.num_blocks, "aborts and finishes must free every block"


def test_late_planning_engine_process_agrees(
    clients: tuple[InprocClient, SyncMPClient], smollm2_path: Path
) -> None:
    """An engine process under late planning (its loop takes commands until the step in
    flight lands, here at once: a CPU step has landed when it returns) gives the same tokens
    as the synchronous in-process engine, and frees every block."""
    inproc, _ = clients
    late = SyncMPClient(_config(smollm2_path, async_scheduling="late"))
    try:
        a_tokens, _ = _run(inproc)
        b_tokens, b_finish = _run(late)
        for rid in ("greedy-0", "greedy-1", "seeded"):
            assert b_tokens[rid] == a_tokens[rid], rid
        assert b_finish["greedy-0"] == "length"
        s = late.stats()
        assert s.async_scheduling and (s.num_running, s.num_waiting) == (0, 0)
        assert s.num_free_blocks == s.num_blocks
    finally:
        late.shutdown()


def test_disaggregation_hooks_over_the_process_boundary(
    clients: tuple[InprocClient, SyncMPClient],
) -> None:
    _, mp = clients
    params = SamplingParams(temperature=0.0, max_tokens=1)
    mp.add_request(EngineCoreRequest("held", list(range(40, 90)), params), hold_kv=True)
    while mp.has_unfinished_requests():
        mp.get_output()
    held = mp.get_held_block_ids("held")
    assert len(held) == 4  # 50 prompt tokens in blocks of 16
    assert mp.stats().num_held == 1
    mp.release_held("held")
    assert mp.stats().num_held == 0
    decode = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    reserved = mp.reserve(EngineCoreRequest("reserved", list(range(40, 90)), decode))
    assert reserved is not None and len(reserved[0]) == 4
    first = mp.add_prefilled_request("reserved", 7)
    assert first is None or not first.finished
    got: list[int] = []
    while mp.has_unfinished_requests():
        for out in mp.get_output():
            got.extend(out.new_token_ids)
    assert len(got) == 2  # the first token came from "elsewhere"
    with pytest.raises(KeyError):
        mp.get_held_block_ids("nobody")
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        mp.add_request(EngineCoreRequest("empty", [], decode))
    s = mp.stats()
    assert s.num_free_blocks == s.num_blocks


@pytest.mark.parametrize("share_kv_cache", [False, True])
def test_async_client_notices_a_dead_engine_at_once(
    smollm2_path: Path, share_kv_cache: bool
) -> None:
    """Also with the KV cache shared (a shared-memory file, whose manager process can keep
    the engine's pipes open after it died): noticed within a second."""

    async def run() -> None:
        dead: list[tuple[str, float]] = []
        steps: list[list[EngineCoreOutput]] = []

        def on_step(outputs: list[EngineCoreOutput], pig: Piggyback) -> None:
            steps.append(outputs)

        client = AsyncMPClient(
            _config(smollm2_path),
            on_step,
            EngineProcOptions(share_kv_cache=share_kv_cache),
            on_dead=lambda r: dead.append((r, time.monotonic())),
        )
        info = await client.start()
        if share_kv_cache:
            assert client.kv_cache().shape[0] == info.num_blocks
        assert client.alive and client.latest_stats is not None
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        await client.add_request(EngineCoreRequest("long", list(range(10, 40)), params))
        while not steps:
            await asyncio.sleep(0.01)
        os.kill(info.pid, signal.SIGKILL)
        killed = time.monotonic()
        pending = client.stats()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(pending, 5.0)
        assert dead, "on_dead was not called"
        assert dead[0][1] - killed < 1.0
        assert "exit" in dead[0][0]
        assert not client.alive
        with pytest.raises(EngineDeadError):
            await client.add_request(EngineCoreRequest("later", [1, 2, 3], params))
        await client.shutdown()

    asyncio.run(run())


def test_engine_build_error_surfaces(smollm2_path: Path) -> None:
    """An engine that cannot be built in its process: `start` raises the engine's error."""

    async def run() -> None:
        config = EngineArgs(
            model=str(smollm2_path), device="cpu", num_gpu_blocks=4, max_model_len=512
        ).create_engine_config()
        client = AsyncMPClient(config, lambda outputs, pig: None)
        with pytest.raises(ValueError, match="cannot hold one request of max_model_len 512"):
            await client.start()
        assert not client.alive

    asyncio.run(run())


def test_worker_whose_engine_dies_fails_its_streams_and_exits(tmp_path: Path) -> None:
    """SIGKILL the unified worker's engine process mid-stream: the stream ends with an error
    within seconds (no hang), the worker process exits non-zero, and the frontend's /ready is
    503 (no serving worker)."""
    dep = launch(tmp_path, unified=True)
    try:
        worker = psutil.Process(dep.pid("unified"))
        engine = psutil.Process(int(dep.services["unified"].info["engine_pid"]))
        assert engine in worker.children()

        code, waited = interrupt_a_stream(dep.grpc_address, PROMPTS[0], engine.kill)
        assert code == grpc.StatusCode.UNAVAILABLE, code
        assert waited < 10
        code = dep.services["unified"].process.wait(timeout=30)
        assert code != 0
        assert "engine" in dep.services["unified"].log_tail(40)
        # No serving worker is left: the frontend's readiness says so.
        ready = f"http://{dep.http_address}/ready"
        wait_until(lambda: httpx.get(ready, timeout=10).status_code == 503, 15, "/ready 503")
        assert httpx.get(ready, timeout=10).json()["workers"]["unified"] == 0
    finally:
        dep.stop(timeout_s=20)
