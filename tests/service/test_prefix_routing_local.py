"""Prefix-aware routing without Redis (the `tandem serve` default): two prefill workers in
their own processes, no shared directory; the scheduler follows its own record of where it
sent which prompt prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem_services.launcher import Deployment, start_deployment
from tests.service.conftest import wait_until
from tests.service.test_prefix_routing import (
    BLOCK_SIZE,
    PREFILL,
    counters,
    generate,
    idle,
    make_prefix,
    served_by,
    two_prefill_config,
    with_question,
    worker_id,
)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # The Redis module's deployment, less the directory: the dispatch record stays on.
    config = two_prefill_config(tmp_path_factory.mktemp("logs-prefix-routing-local"))
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
