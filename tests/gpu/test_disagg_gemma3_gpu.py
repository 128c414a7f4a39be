"""Disaggregated serving of the tiny Gemma 3 (a KV cache group per attention kind) on the GPU,
as real processes, over CUDA IPC and NCCL: each group's blocks (a sliding group's window
alone) reach the decode worker's tables, greedy outputs equal the offline engine's on the
GPU, and both block pools are whole afterwards (tests/service/test_disagg_gemma3.py is the
TCP run on the CPU; tests/service/gemma3_disagg.py what both share)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tandem_services.launcher import Deployment
from tests.service.conftest import assert_pools_whole
from tests.service.gemma3_disagg import (
    assert_served_as_offline,
    gemma3_deployment,
    offline_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# 16-token blocks (the GPU kernels' size); the 8-token window then spans at most 2 of them.
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "num_gpu_blocks": 128,
    "block_size": 16,
    "max_num_batched_tokens": 16,
}


@pytest.fixture(scope="module")
def reference(tiny_model_path: Callable[[str], Path]) -> list[list[int]]:
    return offline_reference(str(tiny_model_path("gemma3")), ENGINE_ARGS)


# NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"): the prefill
# and decode workers need a GPU each for it.
_ONE_GPU = not torch.cuda.is_available() or torch.cuda.device_count() < 2
NCCL = pytest.param(
    "nccl", marks=pytest.mark.skipif(_ONE_GPU, reason="NCCL hand-off needs a GPU per worker")
)


@pytest.fixture(scope="module", params=["cuda-ipc", NCCL])
def deployment(
    request: pytest.FixtureRequest,
    tiny_model_path: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Deployment, str]]:
    """The deployment, and the transport its scheduler names in its log."""
    logs = tmp_path_factory.mktemp(f"logs-gemma3-{request.param}")
    model = str(tiny_model_path("gemma3"))
    with gemma3_deployment(logs, model, ENGINE_ARGS, kv_connector=request.param) as dep:
        yield dep, request.param.replace("-", "_")


def test_gemma3_disaggregated_on_the_gpu_matches_offline(
    reference: list[list[int]], deployment: tuple[Deployment, str]
) -> None:
    dep, transport = deployment
    assert_served_as_offline(dep, reference, waves=1)
    log = Path(dep.services["scheduler"].log_path or "").read_text(errors="replace")
    assert f"KV from prefill-0 to decode-0 over {transport}" in log
    assert_pools_whole(dep)
