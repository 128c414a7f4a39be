"""Disaggregated serving with the scheduler forcing the NCCL connector: on CPU workers it runs
over gloo, so the whole path (ConnectKV, the pair's process group, WriteKV sessions beside
AddPrefilled and aborts) is exercised with real processes. Greedy outputs must equal the
offline engine's, and aborts must leave both block pools whole."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment
from tests.service.conftest import (
    MAX_TOKENS,
    PROMPTS,
    SCHEDULER_ARGS,
    Reference,
    assert_pools_whole,
    generate_token_ids,
    greedy_request,
    launched,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def nccl_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # frontend_args=(): the frontend's own migration default (no worker is lost here).
    with launched(
        tmp_path_factory.mktemp("logs-nccl"),
        unified=False,
        scheduler_args=(*SCHEDULER_ARGS, "--kv-connector", "nccl"),
        frontend_args=(),
    ) as dep:
        yield dep


def _log(dep: Deployment, name: str) -> str:
    path = dep.services[name].log_path
    assert path is not None
    return Path(path).read_text(errors="replace")


def test_greedy_over_nccl_matches_offline(
    nccl_deployment: Deployment, reference: Reference
) -> None:
    async def run() -> list[list[int]]:
        # 16 at once: the pair's sessions queue up; repeats hit the decode prefix cache, so
        # some hand-offs skip their leading blocks.
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
        address = nccl_deployment.grpc_address
        return await asyncio.gather(
            *(generate_token_ids(address, greedy_request(p, MAX_TOKENS)) for p in prompts)
        )

    for i, ids in enumerate(asyncio.run(run())):
        assert ids == reference.token_ids[i % len(PROMPTS)], PROMPTS[i % len(PROMPTS)]
    assert "over nccl" in _log(nccl_deployment, "scheduler")
    assert "over nccl" in _log(nccl_deployment, "prefill")
    assert_pools_whole(nccl_deployment)


def test_cancel_over_nccl_frees_blocks_on_both_sides(nccl_deployment: Deployment) -> None:
    async def run() -> int:
        async with grpc.aio.insecure_channel(nccl_deployment.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            params = common_pb2.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
            calls = [
                stub.Generate(frontend_pb2.GenerateRequest(text=p * 8, sampling_params=params))
                for p in PROMPTS
            ]
            seen = 0
            for call in calls:
                async for _ in call:
                    seen += 1
                    call.cancel()
                    break
            return seen

    assert asyncio.run(run()) == len(PROMPTS)
    assert_pools_whole(nccl_deployment, timeout_s=30)
