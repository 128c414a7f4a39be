"""Service-test fixtures: real processes on 127.0.0.1 with the embedded default model.

Process start-ups are the expensive part (each worker loads the model), so deployments are
module-scoped and the offline reference outputs are computed once per session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem_protos.v1 import (
    common_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tandem_services.launcher import Deployment, ServeConfig, start_deployment
from tests.service.healing import (  # noqa: F401 (fixtures)
    heal_reference,
    healing_cluster,
    long_reference,
)

MAX_MODEL_LEN = 2048
NUM_BLOCKS = 256
MAX_TOKENS = 12
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# float32 on both sides of every served-against-offline comparison (the services started here
# read it from TANDEM_DTYPE, set in tests/conftest.py).
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": MAX_MODEL_LEN,
    "num_gpu_blocks": NUM_BLOCKS,
    "num_threads": 1,
}
# One intra-op thread per worker: on a small shared machine more threads than free cores
# makes every step wait on busy cores.
WORKER_ARGS = (
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-gpu-blocks",
    str(NUM_BLOCKS),
    "--num-threads",
    "1",
)
# Short enough that the lost-worker test is quick, long enough for a loaded 2-core machine.
SCHEDULER_ARGS = ("--dead-after-s", "3", "--report-interval-s", "0.2")
GRACE_S = 10.0


@dataclass(frozen=True)
class Reference:
    """Offline `LLM` greedy outputs for PROMPTS (and CHAT), max_tokens=MAX_TOKENS."""

    texts: list[str]
    token_ids: list[list[int]]
    chat_text: str
    chat_token_ids: list[int]
    # Seeded sampling (SEEDED below) of each of PROMPTS.
    seeded_token_ids: list[list[int]]


# Seeded, non-greedy sampling: the same tokens offline, unified and disaggregated (the prefill
# worker draws the first token, the decode worker's generator continues after that draw).
SEEDED = {"temperature": 0.8, "top_k": 50, "seed": 1234}


@pytest.fixture(scope="session")
def reference() -> Reference:
    from tandem import LLM, SamplingParams

    llm = LLM(model="default", **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    chat = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    seeded = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **SEEDED), use_tqdm=False)
    ref = Reference(
        [o.outputs[0].text for o in outs],
        [list(o.outputs[0].token_ids) for o in outs],
        chat.text,
        list(chat.token_ids),
        [list(o.outputs[0].token_ids) for o in seeded],
    )
    llm.shutdown()
    return ref


def launch(tmp: Path, unified: bool, **overrides: Any) -> Deployment:
    # The lost-worker tests of these deployments pin the failure path (a stream ends with
    # UNAVAILABLE): migration off. test_migration.py and test_chaos.py run it on.
    overrides.setdefault("frontend_args", ("--migration-limit", "0"))
    overrides.setdefault("worker_args", WORKER_ARGS)
    config = ServeConfig(
        http_port=0,
        grpc_port=0,
        unified=unified,
        scheduler_args=SCHEDULER_ARGS,
        grace_period_s=GRACE_S,
        log_dir=str(tmp),
        startup_timeout_s=300.0,
        **overrides,
    )
    return start_deployment(config)


@pytest.fixture(scope="module", params=["disaggregated", "unified"])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    dep = launch(logs, unified=request.param == "unified")
    try:
        yield dep
    finally:
        codes = dep.stop(timeout_s=GRACE_S + 10)
        dead_early = [n for n, c in codes.items() if c not in (0,)]
        if dead_early:
            for name in dead_early:
                print(f"---- {name} log (exit {codes[name]}) ----")
                print(dep.services[name].log_tail(80))


def worker_names(dep: Deployment) -> list[str]:
    return [n for n in ("prefill", "decode", "unified") if n in dep.services]


def worker_stats(address: str) -> common_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)


def list_workers(dep: Deployment) -> scheduler_pb2.ListWorkersResponse:
    with grpc.insecure_channel(dep.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=30)


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def pools_whole(dep: Deployment) -> bool:
    """Every worker has nothing in flight and every KV block free."""
    for name in worker_names(dep):
        s = worker_stats(dep.address(name))
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


def interrupt_a_stream(
    grpc_address: str, prompt: str, interrupt: Callable[[], None], timeout_s: float = 60.0
) -> tuple[grpc.StatusCode, float]:
    """Stream a long greedy Generate and call `interrupt` after its second message; returns
    the status the stream ended with and the seconds from the interrupt to that end. A stream
    that ends without an error fails the test."""

    async def run() -> tuple[grpc.StatusCode, float]:
        async with grpc.aio.insecure_channel(grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            params = common_pb2.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
            call = stub.Generate(frontend_pb2.GenerateRequest(text=prompt, sampling_params=params))
            n = 0
            t0 = 0.0
            try:
                async for _ in call:
                    n += 1
                    if n == 2:
                        interrupt()
                        t0 = time.monotonic()
            except grpc.aio.AioRpcError as exc:
                return exc.code(), time.monotonic() - t0
            raise AssertionError("the stream ended without an error")

    return asyncio.run(asyncio.wait_for(run(), timeout=timeout_s))


def assert_pools_whole(dep: Deployment, timeout_s: float = 20.0) -> None:
    try:
        wait_until(lambda: pools_whole(dep), timeout_s, "every worker's block pool to be whole")
    except AssertionError:
        stats = {n: worker_stats(dep.address(n)) for n in worker_names(dep)}
        raise AssertionError(f"blocks leaked: {stats}") from None
