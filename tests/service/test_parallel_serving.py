"""A unified worker whose engine runs tensor parallel (three rank processes over gloo, the
embedded model's 9 heads and 3 KV heads split one KV head per rank): the served outputs equal
the offline one-rank outputs, greedy and seeded, over gRPC and the OpenAI API. Disaggregated
workers of several ranks are refused at start, naming why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem.config import EngineArgs
from tandem_services.launcher import Deployment
from tandem_services.worker.config import WorkerConfigError, WorkerServiceConfig
from tests.service.conftest import GRACE_S, WORKER_ARGS, assert_pools_whole, launch
from tests.service.test_serving import (  # noqa: F401 (run here against a TP deployment)
    test_grpc_greedy_matches_offline,
    test_grpc_seeded_sampling_matches_offline,
    test_openai_completions_match_offline,
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("logs-tp3")
    dep = launch(logs, unified=True, worker_args=(*WORKER_ARGS, "--tensor-parallel-size", "3"))
    try:
        yield dep
    finally:
        codes = dep.stop(timeout_s=GRACE_S + 10)
        for name, code in codes.items():
            if code != 0:
                print(f"---- {name} log (exit {code}) ----")
                print(dep.services[name].log_tail(80))


def test_pools_whole_after_parallel_serving(deployment: Deployment) -> None:
    assert_pools_whole(deployment)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_disaggregated_workers_of_several_ranks_are_refused(role: str) -> None:
    engine = EngineArgs(model="default", tensor_parallel_size=3).create_engine_config(
        resolve=False
    )
    with pytest.raises(WorkerConfigError, match=f"a {role} worker .* run --unified"):
        WorkerServiceConfig(role=role, engine=engine)  # type: ignore[arg-type]
