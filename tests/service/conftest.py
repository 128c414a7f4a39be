"""Service-test fixtures: real processes on 127.0.0.1 with the embedded default model.

Process start-ups are the expensive part (each worker loads the model), so deployments are
module-scoped and the offline reference outputs are computed once per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from tandem.engine.output_processor import Logprob
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
# A conversation whose final message the model continues (continue_final_message).
CONTINUED = [*CHAT, {"role": "assistant", "content": "The answer is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
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
    # CONTINUED with its final message continued (CONTINUE).
    continued_text: str
    # PROMPTS[1]'s token ids and prompt logprobs (PROMPT_LOGPROBS top ones), and CHAT's.
    prompt_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None]
    chat_prompt_logprobs: list[dict[int, Logprob] | None]
    # LLM.beam_search's BEAM_WIDTH beams of BEAM_TOKENS (their text, best first) for
    # PROMPTS[1] and CHAT.
    beams: list[str]
    chat_beams: list[str]


PROMPT_LOGPROBS = 2
BEAM_WIDTH = 2
BEAM_TOKENS = 6


# Seeded, non-greedy sampling: the same tokens offline, unified and disaggregated (the prefill
# worker draws the first token, the decode worker's generator continues after that draw).
SEEDED = {"temperature": 0.8, "top_k": 50, "seed": 1234}


@pytest.fixture(scope="session")
def reference() -> Reference:
    from tandem import LLM, BeamSearchParams, SamplingParams

    llm = LLM(model="default", **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    chat = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    seeded = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **SEEDED), use_tqdm=False)
    continued = llm.chat(CONTINUED, params, use_tqdm=False, **CONTINUE)[0].outputs[0]
    with_prompt = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=PROMPT_LOGPROBS)
    [scored] = llm.generate(PROMPTS[1], with_prompt, use_tqdm=False)
    [chat_scored] = llm.chat(CHAT, with_prompt, use_tqdm=False)
    beams = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=BEAM_TOKENS)
    tok = llm.tokenizer
    chat_ids = tok(
        tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    ).input_ids
    [searched, chat_searched] = llm.beam_search([PROMPTS[1], list(chat_ids)], beams)
    ref = Reference(
        [o.outputs[0].text for o in outs],
        [list(o.outputs[0].token_ids) for o in outs],
        chat.text,
        list(chat.token_ids),
        [list(o.outputs[0].token_ids) for o in seeded],
        continued.text,
        list(scored.prompt_token_ids),
        scored.prompt_logprobs,
        chat_scored.prompt_logprobs,
        [b.text or "" for b in searched.sequences],
        [b.text or "" for b in chat_searched.sequences],
    )
    llm.shutdown()
    return ref


def launch(tmp: Path, unified: bool, **overrides: Any) -> Deployment:
    """Start a deployment on 127.0.0.1 (ephemeral ports, logs under `tmp`) and wait until
    every service is ready. `overrides` are ServeConfig fields; worker, scheduler and frontend
    flags default to this module's (an override replaces them: extend SCHEDULER_ARGS, say,
    with `scheduler_args=(*SCHEDULER_ARGS, "--kv-connector", "nccl")`)."""
    # The lost-worker tests of these deployments pin the failure path (a stream ends with
    # UNAVAILABLE): migration off. test_migration.py and test_chaos.py run it on.
    overrides.setdefault("frontend_args", ("--migration-limit", "0"))
    overrides.setdefault("worker_args", WORKER_ARGS)
    overrides.setdefault("scheduler_args", SCHEDULER_ARGS)
    config = ServeConfig(
        http_port=0,
        grpc_port=0,
        unified=unified,
        grace_period_s=GRACE_S,
        log_dir=str(tmp),
        startup_timeout_s=300.0,
        **overrides,
    )
    return start_deployment(config)


def stop_deployment(dep: Deployment, log_lines: int = 80) -> dict[str, int]:
    """Stop every service (GRACE_S to drain, then killed) and print the last `log_lines` of
    the log of each that exited with a non-zero code, so a failing test shows why. Returns
    the exit codes by service name."""
    codes = dep.stop(timeout_s=GRACE_S + 10)
    for name, code in codes.items():
        if code != 0:
            print(f"---- {name} log (exit {code}) ----")
            print(dep.services[name].log_tail(log_lines))
    return codes


@contextlib.contextmanager
def launched(tmp: Path, unified: bool, **overrides: Any) -> Iterator[Deployment]:
    """`launch`, then `stop_deployment` when the block ends: the body of a deployment fixture."""
    dep = launch(tmp, unified, **overrides)
    try:
        yield dep
    finally:
        stop_deployment(dep)


@pytest.fixture(scope="module", params=["disaggregated", "unified"])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    with launched(logs, unified=request.param == "unified") as dep:
        yield dep


def engine_flags(engine_args: Mapping[str, object]) -> tuple[str, ...]:
    """Engine settings as worker flags: {"max_model_len": 256} -> ("--max-model-len", "256")."""
    return tuple(a for k, v in engine_args.items() for a in (f"--{k.replace('_', '-')}", str(v)))


def greedy_request(
    prompt: str | list[int], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False
) -> frontend_pb2.GenerateRequest:
    """A greedy gRPC Generate request for a text or for token ids."""
    params = common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos
    )
    if isinstance(prompt, str):
        return frontend_pb2.GenerateRequest(text=prompt, sampling_params=params)
    return frontend_pb2.GenerateRequest(
        token_ids=frontend_pb2.TokenIds(ids=prompt), sampling_params=params
    )


async def generate_token_ids(address: str, request: frontend_pb2.GenerateRequest) -> list[int]:
    """The token ids a gRPC Generate streams back, every message's choices joined."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        return [t async for r in stub.Generate(request) for c in r.choices for t in c.token_ids]


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
