"""Disaggregated serving of a model with a KV cache group per attention kind (the tiny
Gemma 3: layer 0 slides with an 8-token window, layer 1 is global), as real processes: the
prefill worker chunks each prompt, hands each group's blocks (a sliding group's window
alone) to the decode worker over TCP, and greedy outputs equal the offline engine's; both
block pools are whole afterwards. Repeats hit the decode worker's prefix cache, so some
hand-offs skip their leading blocks. (tests/service/gemma3_disagg.py holds what the GPU run,
tests/gpu/test_disagg_gemma3_gpu.py, shares with this one.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem_services.launcher import Deployment
from tests.service.conftest import assert_pools_whole
from tests.service.gemma3_disagg import (
    assert_served_as_offline,
    gemma3_deployment,
    offline_reference,
)

pytestmark = pytest.mark.timeout(600)

# Chunked prefill on the prefill worker (16 tokens a step): its sliding group frees blocks
# while the prompt is computed; 4-token blocks so the window spans several.
ENGINE_ARGS = {
    "max_model_len": 256,
    "num_gpu_blocks": 192,
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "num_threads": 1,
}


@pytest.fixture(scope="module")
def reference(tiny_model_path: Callable[[str], Path]) -> list[list[int]]:
    return offline_reference(str(tiny_model_path("gemma3")), ENGINE_ARGS)


@pytest.fixture(scope="module")
def deployment(
    tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    model = str(tiny_model_path("gemma3"))
    with gemma3_deployment(tmp_path_factory.mktemp("logs-gemma3"), model, ENGINE_ARGS) as dep:
        yield dep


def test_gemma3_disaggregated_matches_offline(
    reference: list[list[int]], deployment: Deployment
) -> None:
    # Two waves of three: the second wave's prompts are cached on the decode worker.
    assert_served_as_offline(deployment, reference, waves=2)
    assert_pools_whole(deployment)
