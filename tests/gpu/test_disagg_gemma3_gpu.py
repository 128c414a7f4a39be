"""Disaggregated serving of the tiny Gemma 3 (a KV cache group per attention kind) on the GPU,
as real processes, over CUDA IPC and NCCL: each group's blocks (a sliding group's window
alone) reach the decode worker's tables, greedy outputs equal the offline engine's on the
GPU, and both block pools are whole afterwards (tests/service/test_disagg_gemma3.py is the
TCP run on the CPU)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment, ServeConfig, start_deployment
from tests.service.conftest import GRACE_S, SCHEDULER_ARGS, assert_pools_whole

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# 16-token blocks (the GPU kernels' size); the 8-token window then spans at most 2 of them.
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "num_gpu_blocks": 128,
    "block_size": 16,
    "max_num_batched_tokens": 16,
}
MAX_TOKENS = 10
_rng = random.Random(17)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 23, 70)]
WORKER_ARGS = tuple(a for k, v in ENGINE_ARGS.items() for a in (f"--{k.replace('_', '-')}", str(v)))


@pytest.fixture(scope="module")
def reference(tiny_model_path: Callable[[str], Path]) -> list[list[int]]:
    from tandem import LLM, SamplingParams

    llm = LLM(str(tiny_model_path("gemma3")), **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["cuda-ipc", "nccl"])
def deployment(
    request: pytest.FixtureRequest,
    tiny_model_path: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Deployment, str]]:
    """The deployment, and the transport its scheduler names in its log."""
    config = ServeConfig(
        model=str(tiny_model_path("gemma3")),
        http_port=0,
        grpc_port=0,
        worker_args=WORKER_ARGS,
        scheduler_args=(*SCHEDULER_ARGS, "--kv-connector", request.param),
        grace_period_s=GRACE_S,
        log_dir=str(tmp_path_factory.mktemp(f"logs-gemma3-{request.param}")),
        startup_timeout_s=300.0,
    )
    dep = start_deployment(config)
    try:
        yield dep, request.param.replace("-", "_")
    finally:
        codes = dep.stop(timeout_s=GRACE_S + 10)
        for name, code in codes.items():
            if code != 0:
                print(f"---- {name} log (exit {code}) ----")
                print(dep.services[name].log_tail(80))


async def generate(address: str, ids: list[int]) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        request = frontend_pb2.GenerateRequest(
            token_ids=frontend_pb2.TokenIds(ids=ids), sampling_params=params
        )
        return [t async for r in stub.Generate(request) for c in r.choices for t in c.token_ids]


def test_gemma3_disaggregated_on_the_gpu_matches_offline(
    deployment: tuple[Deployment, str], reference: list[list[int]]
) -> None:
    dep, transport = deployment

    async def run() -> list[list[int]]:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
        return await asyncio.gather(*(generate(dep.grpc_address, p) for p in prompts))

    for i, ids in enumerate(asyncio.run(run())):
        assert ids == reference[i % len(PROMPTS)], f"prompt {i % len(PROMPTS)}"
    log = Path(dep.services["scheduler"].log_path or "").read_text(errors="replace")
    assert f"KV from prefill-0 to decode-0 over {transport}" in log
    assert_pools_whole(dep)
