"""The tiny Gemma 3 (a KV cache group per attention kind) served disaggregated, shared by the
CPU run over TCP (tests/service/test_disagg_gemma3.py) and the GPU runs over CUDA IPC and NCCL
(tests/gpu/test_disagg_gemma3_gpu.py): the prompts, the offline engine's greedy tokens for
them, the deployment, and the check that the served tokens are the offline ones.

Each run sends every prompt twice (NUM_REQUESTS requests, request i asks for prompt
i % len(PROMPTS)), so repeats can hit the decode worker's prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tandem_services.launcher import Deployment
from tests.service.conftest import (
    SCHEDULER_ARGS,
    engine_flags,
    generate_token_ids,
    greedy_request,
    launched,
)

MAX_TOKENS = 10
_rng = random.Random(17)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 23, 70)]
NUM_REQUESTS = 6


def offline_reference(model: str, engine_args: Mapping[str, Any]) -> list[list[int]]:
    """The offline engine's greedy tokens for PROMPTS (float32, `engine_args` beside it)."""
    from tandem import LLM, SamplingParams

    llm = LLM(model, **{"dtype": "float32", **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@contextlib.contextmanager
def gemma3_deployment(
    log_dir: Path, model: str, engine_args: Mapping[str, Any], kv_connector: str | None = None
) -> Iterator[Deployment]:
    """A prefill and a decode worker serving `model` with `engine_args` as their flags; the
    scheduler forces `kv_connector` when one is named."""
    scheduler_args = SCHEDULER_ARGS
    if kv_connector is not None:
        scheduler_args = (*SCHEDULER_ARGS, "--kv-connector", kv_connector)
    with launched(
        log_dir,
        unified=False,
        model=model,
        worker_args=engine_flags(engine_args),
        scheduler_args=scheduler_args,
    ) as dep:
        yield dep


def assert_served_as_offline(dep: Deployment, reference: list[list[int]], waves: int) -> None:
    """NUM_REQUESTS greedy requests over gRPC, sent in `waves` waves one after another (the
    requests of a wave at once), each returning its prompt's tokens in `reference`."""
    requests = [
        greedy_request(PROMPTS[i % len(PROMPTS)], MAX_TOKENS, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    size = -(-NUM_REQUESTS // waves)

    async def run() -> list[list[int]]:
        served: list[list[int]] = []
        for start in range(0, NUM_REQUESTS, size):
            wave = requests[start : start + size]
            served += await asyncio.gather(*(generate_token_ids(dep.grpc_address, r) for r in wave))
        return served

    for i, ids in enumerate(asyncio.run(run())):
        assert ids == reference[i % len(PROMPTS)], f"prompt {i % len(PROMPTS)}"
