"""Disaggregated serving across two GPUs of one host (needs two GPUs; skipped otherwise).

Prefill worker on cuda:0, decode worker on cuda:1 (`--device cuda:<index>`, both processes see
both GPUs), KV handed over by NCCL or by CUDA IPC between the GPUs (`--kv-connector`), against
one unified worker on cuda:0: greedy outputs of 20 prompts equal (a divergence is tolerated
only at a near-tie of the two best logprobs, at least 16 exact), the hand-offs went over the
connector asked for, each worker's weights and KV cache sit on its own GPU, and aborts leave
both block pools whole. The harness (a stand-in frontend submitting token ids) is the one of
test_cuda_ipc.py; every deployment starts at once, then they are used one after another.

Dry run of the harness on a CPU (`--noconftest`, since tests/gpu skips gpu tests without CUDA):

    TANDEM_TWO_GPU_DEVICES=cpu,cpu TANDEM_TWO_GPU_CONNECTORS=nccl TANDEM_GPU_IPC_MODEL=default \
    TANDEM_TWO_GPU_VOCAB=49152 TANDEM_TWO_GPU_MAX_PROMPT=200 \
        python -m pytest --noconftest -p no:cacheprovider tests/gpu/test_two_gpus.py
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.gpu.test_cuda_ipc import (
    MODEL,
    NUM_PROMPTS,
    MiniFrontend,
    Plans,
    _Deployment,
    _wait_pools_whole,
    count_exact_matches,
    run_all,
    serving_prompts,
    start_deployments,
)

# Where the prefill (and unified) worker and the decode worker run, the connectors tried.
DEVICES = os.environ.get("TANDEM_TWO_GPU_DEVICES", "cuda:0,cuda:1").split(",")
CONNECTORS = tuple(os.environ.get("TANDEM_TWO_GPU_CONNECTORS", "nccl,cuda-ipc").split(","))
ON_GPUS = all(d.startswith("cuda") for d in DEVICES)
PROMPT_VOCAB = int(os.environ.get("TANDEM_TWO_GPU_VOCAB", "128000"))
MAX_PROMPT = int(os.environ.get("TANDEM_TWO_GPU_MAX_PROMPT", "1500"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        ON_GPUS and (not torch.cuda.is_available() or torch.cuda.device_count() < 2),
        reason="needs two GPUs",
    ),
]

WORKER_ARGS = [
    "--model",
    MODEL,
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--num-gpu-blocks",
    "2048",
    "--max-num-seqs",
    "32",
]
# float32 weights of llama-3.2-1b (~5 GiB) plus a 2 GiB KV cache: a GPU holding a worker's
# model has at least this much more in use than one that holds only CUDA contexts.
MODEL_BYTES = 4 << 30


def _prompts() -> list[list[int]]:
    return serving_prompts(MAX_PROMPT, PROMPT_VOCAB)


async def _run_all(dep: _Deployment, name: str) -> list[Any]:
    return await run_all(dep, name, _prompts())


def _used_bytes(index: int) -> int:
    free, total = torch.cuda.mem_get_info(index)
    return total - free


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Deployment]]:
    """ "unified": one unified worker on cuda:0; "<connector>": prefill on cuda:0, decode on
    cuda:1, the scheduler forced onto that connector."""
    plans: Plans = {"unified": ("auto", [("unified", ["--device", DEVICES[0], *WORKER_ARGS])])}
    for connector in CONNECTORS:
        plans[connector] = (
            connector,
            [
                ("prefill", ["--device", DEVICES[0], *WORKER_ARGS]),
                ("decode", ["--device", DEVICES[1], *WORKER_ARGS]),
            ],
        )
    with start_deployments(tmp_path_factory, "two-gpu", plans) as deps:
        yield deps


@pytest.fixture(scope="module")
def reference(deployments: dict[str, _Deployment]) -> list[Any]:
    return asyncio.run(_run_all(deployments["unified"], "u"))


@pytest.mark.skipif(not ON_GPUS, reason="GPU memory")
def test_workers_hold_their_model_on_their_own_gpu(deployments: dict[str, _Deployment]) -> None:
    # cuda:0: the unified worker and two prefill workers; cuda:1: two decode workers. Were
    # the decode workers on cuda:0 (the device index ignored), cuda:1 would hold no model.
    used = [_used_bytes(0), _used_bytes(1)]
    print(f"GPU memory in use: {[f'{u / (1 << 30):.1f} GiB' for u in used]}")
    assert used[0] >= 3 * MODEL_BYTES, used
    assert used[1] >= 2 * MODEL_BYTES, used


@pytest.mark.parametrize("connector", CONNECTORS)
def test_disaggregated_across_gpus_matches_unified(
    connector: str, deployments: dict[str, _Deployment], reference: list[Any]
) -> None:
    dep = deployments[connector]
    ours = asyncio.run(_run_all(dep, f"d-{connector}"))
    exact = count_exact_matches(reference, ours)
    print(f"{connector} {DEVICES[0]} -> {DEVICES[1]}: exact matches {exact}/{NUM_PROMPTS}")
    assert exact >= 16, f"only {exact} of {NUM_PROMPTS} prompts matched exactly"
    over = "over " + connector.replace("-", "_")
    assert over in dep.log("scheduler") and over in dep.log("prefill")
    _wait_pools_whole(dep)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_aborts_free_blocks_on_both_gpus(
    connector: str, deployments: dict[str, _Deployment]
) -> None:
    dep = deployments[connector]
    prompts = _prompts()[:6]

    async def run() -> None:
        async with MiniFrontend(dep.scheduler, dep.workers(), f"abort-{connector}") as fe:
            for i in range(3):  # aborted while decoding on cuda:1 ...
                await fe.submit(f"late-{i}", prompts[i], 1000)
            deadline = time.monotonic() + 120
            while any(len(fe.streams[f"late-{i}"].tokens()[0]) < 3 for i in range(3)):
                assert time.monotonic() < deadline, "no tokens"
                await asyncio.sleep(0.05)
            for i in range(3, 6):  # ... and at once (prefilling or handing off)
                await fe.submit(f"early-{i}", prompts[i], 1000)
            await fe.abort([f"early-{i}" for i in range(3, 6)])
            await fe.abort([f"late-{i}" for i in range(3)])

    asyncio.run(run())
    _wait_pools_whole(dep)
