"""Disaggregated serving of a model with a KV cache group per attention kind (the tiny
Gemma 3: layer 0 slides with an 8-token window, layer 1 is global), as real processes: the
prefill worker chunks each prompt, hands each group's blocks (a sliding group's window
alone) to the decode worker over TCP, and greedy outputs equal the offline engine's; both
block pools are whole afterwards. Repeats hit the decode worker's prefix cache, so some
hand-offs skip their leading blocks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment
from tests.service.conftest import GRACE_S, assert_pools_whole, launch

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 10
# Chunked prefill on the prefill worker (16 tokens a step): its sliding group frees blocks
# while the prompt is computed; 4-token blocks so the window spans several.
ENGINE_ARGS = {
    "max_model_len": 256,
    "num_gpu_blocks": 192,
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "num_threads": 1,
}
WORKER_ARGS = tuple(a for k, v in ENGINE_ARGS.items() for a in (f"--{k.replace('_', '-')}", str(v)))
_rng = random.Random(17)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 23, 70)]


@pytest.fixture(scope="module")
def gemma3_case(
    tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, list[list[int]]]]:
    from tandem import LLM, SamplingParams

    model = str(tiny_model_path("gemma3"))
    llm = LLM(model, dtype="float32", **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    reference = [list(o.outputs[0].token_ids) for o in outs]
    llm.shutdown()
    dep = launch(tmp_path_factory.mktemp("logs-gemma3"), unified=False, model=model,
                 worker_args=WORKER_ARGS)  # fmt: skip
    try:
        yield dep, reference
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


def test_gemma3_disaggregated_matches_offline(gemma3_case) -> None:
    dep, reference = gemma3_case

    async def run() -> list[list[int]]:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
        first = await asyncio.gather(*(generate(dep.grpc_address, p) for p in prompts[:3]))
        return first + await asyncio.gather(*(generate(dep.grpc_address, p) for p in prompts[3:]))

    for i, ids in enumerate(asyncio.run(run())):
        assert ids == reference[i % len(PROMPTS)], f"prompt {i % len(PROMPTS)}"
    assert_pools_whole(dep)
