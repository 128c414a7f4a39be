"""Workers whose engines run tensor parallel (three rank processes over gloo, the embedded
model's 9 heads and 3 KV heads split one KV head per rank), unified and disaggregated (the
prefill worker's ranks hand each its share of every block to the same rank of the decode
worker, over TCP): the served outputs equal the offline one-rank outputs, greedy and seeded,
over gRPC and the OpenAI API. A disaggregated worker whose ranks span hosts is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem.engine_args import EngineArgs
from tandem_services.launcher import Deployment
from tandem_services.worker.config import WorkerServiceConfig, WorkerServiceConfigError
from tests.service.conftest import WORKER_ARGS, assert_pools_whole, launched
from tests.service.test_serving import (  # noqa: F401 (run here against a TP deployment)
    test_grpc_greedy_matches_offline,
    test_grpc_seeded_sampling_matches_offline,
    test_openai_completions_match_offline,
)


@pytest.fixture(scope="module", params=["unified", "disaggregated"])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    with launched(
        tmp_path_factory.mktemp(f"logs-tp3-{request.param}"),
        unified=request.param == "unified",
        worker_args=(*WORKER_ARGS, "--tensor-parallel-size", "3"),
    ) as dep:
        yield dep


def test_pools_whole_after_parallel_serving(deployment: Deployment) -> None:
    assert_pools_whole(deployment)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_disaggregated_workers_across_hosts_are_refused(role: str) -> None:
    engine = EngineArgs(
        model="default", tensor_parallel_size=3, nnodes=3, master_port=29500
    ).create_engine_config(resolve=False)
    with pytest.raises(
        WorkerServiceConfigError, match=f"a {role} worker .* --unified workers only"
    ):
        WorkerServiceConfig(role=role, engine=engine)  # type: ignore[arg-type]
