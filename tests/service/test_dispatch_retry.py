"""Dispatch retries against a stalled worker, with real processes: the worker is stopped
(SIGSTOP) for longer than the scheduler's RPC timeout, so its first dispatch times out at the
scheduler while it sits, received, in the worker's socket; the worker then resumes and sees the
first attempt, its abort and the retry. The request must succeed (the retry runs under an id
of its own, so the earlier attempt the worker still holds never collides: no ALREADY_EXISTS),
an abort while a retry waits must end the request, and no worker may keep a
block or any request state afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment, ServeConfig, start_deployment
from tests.service.conftest import (
    GRACE_S,
    MAX_TOKENS,
    PROMPTS,
    WORKER_ARGS,
    Reference,
    assert_pools_whole,
    list_workers,
    wait_until,
)

pytestmark = pytest.mark.timeout(600)

RPC_TIMEOUT_S = 1.0
# Longer than one dispatch timeout, shorter than two: the first attempt times out, the worker
# wakes before a retry could time out too. Well below --dead-after-s (the worker stays).
STALL_S = 1.6


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    config = ServeConfig(
        http_port=0,
        grpc_port=0,
        unified=False,
        worker_args=WORKER_ARGS,
        scheduler_args=(
            "--rpc-timeout-s",
            str(RPC_TIMEOUT_S),
            "--dead-after-s",
            "10",
            "--report-interval-s",
            "0.2",
        ),
        grace_period_s=GRACE_S,
        log_dir=str(tmp_path_factory.mktemp("logs-dispatch-retry")),
        startup_timeout_s=300.0,
    )
    dep = start_deployment(config)
    try:
        yield dep
    finally:
        for name in ("prefill", "decode"):
            if dep.services[name].process.poll() is None:
                os.kill(dep.pid(name), signal.SIGCONT)
        dep.stop(timeout_s=GRACE_S + 10)


def _request(prompt: str) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(
        text=prompt,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )


async def _generate(address: str, request: frontend_pb2.GenerateRequest) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        return [t async for r in stub.Generate(request) for c in r.choices for t in c.token_ids]


async def _resume_after(pid: int, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    os.kill(pid, signal.SIGCONT)


def _scheduler_idle(dep: Deployment) -> bool:
    listing = list_workers(dep)
    return listing.num_queued == 0 and listing.num_inflight == 0


@pytest.mark.parametrize("stalled", ["decode", "prefill"])
def test_retry_after_timeout_reaches_a_worker_that_got_the_first_attempt(
    deployment: Deployment, reference: Reference, stalled: str
) -> None:
    pid = deployment.pid(stalled)

    async def run() -> list[int]:
        os.kill(pid, signal.SIGSTOP)
        try:
            resume = asyncio.create_task(_resume_after(pid, STALL_S))
            ids = await _generate(deployment.grpc_address, _request(PROMPTS[0]))
            await resume
            return ids
        finally:
            os.kill(pid, signal.SIGCONT)

    scheduler_log = deployment.services["scheduler"].log_path
    assert scheduler_log is not None
    mark = len(scheduler_log.read_text())
    t0 = time.monotonic()
    assert asyncio.run(run()) == reference.token_ids[0]
    assert time.monotonic() - t0 > RPC_TIMEOUT_S  # it did wait for the stalled worker
    log = scheduler_log.read_text()[mark:]
    assert "DEADLINE_EXCEEDED, attempt 1" in log, log  # the first attempt timed out
    assert "ALREADY_EXISTS" not in log, log  # the retry never met it
    assert_pools_whole(deployment)
    wait_until(lambda: _scheduler_idle(deployment), 10, "the scheduler to forget the request")
    # The worker serves the next request as usual.
    assert (
        asyncio.run(_generate(deployment.grpc_address, _request(PROMPTS[1])))
        == (reference.token_ids[1])
    )
    assert_pools_whole(deployment)


def test_abort_while_a_retry_is_pending(deployment: Deployment, reference: Reference) -> None:
    pid = deployment.pid("decode")

    async def run() -> None:
        os.kill(pid, signal.SIGSTOP)
        try:
            call = asyncio.create_task(_generate(deployment.grpc_address, _request(PROMPTS[2])))
            # Past the first attempt's timeout: the request waits for its retry.
            await asyncio.sleep(RPC_TIMEOUT_S + 0.3)
            assert not call.done()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(STALL_S)
        finally:
            os.kill(pid, signal.SIGCONT)

    asyncio.run(run())
    assert_pools_whole(deployment)
    wait_until(lambda: _scheduler_idle(deployment), 10, "the scheduler to forget the request")
    assert (
        asyncio.run(_generate(deployment.grpc_address, _request(PROMPTS[2])))
        == (reference.token_ids[2])
    )
    assert_pools_whole(deployment)
