"""Prefix-aware routing without Redis (the `tandem serve` default): two prefill workers in
their own processes, no shared directory; the scheduler follows its own record of where it
sent which prompt prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.launcher import Deployment, ServeConfig, start_deployment
from tests.service.conftest import wait_until
from tests.service.test_prefix_routing import (
    BLOCK_SIZE,
    PREFILL,
    SCHEDULER_ARGS,
    WORKER_ARGS,
    counters,
    generate,
    idle,
    make_prefix,
    served_by,
    with_question,
    worker_id,
)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("logs-prefix-routing-local")
    # The Redis module's scheduler flags, less the one that turns the dispatch record off.
    scheduler_args = tuple(
        a for i, a in enumerate(SCHEDULER_ARGS)
        if a != "--prefix-hint-ttl-s" and SCHEDULER_ARGS[i - 1] != "--prefix-hint-ttl-s"
    )  # fmt: skip
    config = ServeConfig(
        http_port=0,
        grpc_port=0,
        num_prefill_workers=2,
        worker_args=WORKER_ARGS,
        scheduler_args=scheduler_args,
        grace_period_s=5.0,
        log_dir=str(logs),
        startup_timeout_s=300.0,
    )
    dep = start_deployment(config)
    try:
        yield dep
    finally:
        dep.stop(timeout_s=20)


def test_without_redis_a_shared_prefix_follows_the_dispatch_record(
    local_cluster: Deployment,
) -> None:
    # Two new prefixes sent together land apart (by load); prompts of distinct lengths
    # tell from the workers' counters which went where.
    prompts = {"a": with_question(make_prefix(), 6), "b": with_question(make_prefix(), 9)}
    wait_until(lambda: idle(local_cluster), 10, "idle workers")
    before = counters(local_cluster)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda t: generate(local_cluster, t), prompts.values()))
    wait_until(lambda: idle(local_cluster), 10, "idle workers")
    after = counters(local_cluster)
    grew = {worker_id(n): after[n][0] - before[n][0] for n in PREFILL}
    holder = {k: next(w for w, g in grew.items() if g == len(t)) for k, t in prompts.items()}
    assert set(holder.values()) == {"prefill-0", "prefill-1"}, grew
    # Followers, one at a time on idle workers (where load alone would pick one worker for
    # all), go where their prefix went.
    for _ in range(2):
        for k, t in prompts.items():
            prefix = t[: 3 * BLOCK_SIZE]
            assert served_by(local_cluster, with_question(prefix)) == (holder[k], len(prefix))
