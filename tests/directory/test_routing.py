"""Routing cost, tie-breaking, round robin, and the router's fallback when Redis is gone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tandem_services.directory.memory import InMemoryDirectory
from tandem_services.directory.redis_directory import RedisDirectory
from tandem_services.scheduler.routing.cost import (
    CostModelChooser,
    RoundRobinChooser,
    RoutingWeights,
    WorkerLoad,
    choose_worker,
    num_uncached_tokens,
    rank_workers,
    routing_cost,
)
from tandem_services.scheduler.routing.directory_lookup import PrefixRouter
from tests.directory.helpers import chain
from tests.redis_server import RedisServer

BS = 16


def test_uncached_tokens_keep_the_last_token() -> None:
    assert num_uncached_tokens(100, 0, BS) == 100
    assert num_uncached_tokens(100, 2, BS) == 68
    assert num_uncached_tokens(64, 4, BS) == 1  # a full hit still computes one token
    assert num_uncached_tokens(64, 9, BS) == 1  # more blocks than the prompt (other suffix)
    assert num_uncached_tokens(0, 3, BS) == 0


def test_cost_formula() -> None:
    load = WorkerLoad("a", queued_prefill_tokens=100, num_running=2, num_waiting=3)
    w = RoutingWeights(uncached_token=2.0, queued_token=0.5, running_request=10.0,
                       waiting_request=1.0)  # fmt: skip
    # 2 * (80 - 32) + 0.5 * 100 + 10 * 2 + 1 * 3
    assert routing_cost(load, 2, 80, BS, w) == 96 + 50 + 20 + 3


def test_cached_prefix_wins_at_equal_load() -> None:
    loads = [WorkerLoad("a"), WorkerLoad("b"), WorkerLoad("c")]
    assert choose_worker(loads, {"b": 20, "c": 10}, 512, BS) == "b"
    ranked = rank_workers(loads, {"b": 20, "c": 10}, 512, BS)
    assert [r.worker_id for r in ranked] == ["b", "c", "a"]
    assert [r.num_cached_tokens for r in ranked] == [320, 160, 0]


def test_load_outweighs_a_small_cached_prefix() -> None:
    busy = WorkerLoad("busy", queued_prefill_tokens=2048)
    idle = WorkerLoad("idle")
    # 512 cached tokens save 512; 2048 queued tokens cost more: go to the idle worker.
    assert choose_worker([busy, idle], {"busy": 32}, 600, BS) == "idle"
    # With queued tokens weighed lightly, the cache wins.
    light = RoutingWeights(queued_token=0.1)
    assert choose_worker([busy, idle], {"busy": 32}, 600, BS, light) == "busy"


def test_running_requests_weight() -> None:
    a = WorkerLoad("a", num_running=4)
    b = WorkerLoad("b", num_running=0)
    # b has no cache: 64 more tokens; a has 4 running * 32 = 128: b wins by default.
    assert choose_worker([a, b], {"a": 4}, 65, BS) == "b"
    assert choose_worker([a, b], {"a": 4}, 65, BS, RoutingWeights(running_request=8.0)) == "a"


def test_ties_broken_by_load_then_id() -> None:
    # Equal cost: the worker with fewer queued tokens wins.
    a = WorkerLoad("a", queued_prefill_tokens=10)
    b = WorkerLoad("b", queued_prefill_tokens=0)
    w = RoutingWeights(queued_token=0.0)
    assert choose_worker([a, b], {}, 100, BS, w) == "b"
    # Then fewer requests (running + waiting).
    c = WorkerLoad("c", num_waiting=2)
    d = WorkerLoad("d", num_running=1)
    assert choose_worker([c, d], {}, 100, BS, RoutingWeights(running_request=0.0)) == "d"
    # Then more free blocks, unknown counting as none.
    e = WorkerLoad("e", free_blocks=10)
    f = WorkerLoad("f", free_blocks=50)
    g = WorkerLoad("g")
    assert choose_worker([e, g, f], {}, 100, BS) == "f"
    # Then the smaller id, whatever the candidates' order.
    assert choose_worker([WorkerLoad("y"), WorkerLoad("x")], {}, 100, BS) == "x"


def test_validation() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose_worker([], {}, 10, BS)
    with pytest.raises(ValueError, match="queued_prefill_tokens"):
        WorkerLoad("a", queued_prefill_tokens=-1)
    with pytest.raises(ValueError, match="uncached_token"):
        RoutingWeights(uncached_token=float("nan"))
    with pytest.raises(ValueError, match="running_request"):
        RoutingWeights(running_request=-1.0)
    with pytest.raises(ValueError, match="block_size"):
        choose_worker([WorkerLoad("a")], {}, 10, 0)


def test_round_robin_ignores_cache_and_load() -> None:
    rr = RoundRobinChooser()
    loads = [WorkerLoad("b", queued_prefill_tokens=10_000), WorkerLoad("a"), WorkerLoad("c")]
    picks = [rr.choose(loads, {"c": 100}, 100, BS).worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert CostModelChooser().choose(loads, {"c": 100}, 100, BS).worker_id == "c"


def test_router_uses_the_directory() -> None:
    h = chain("route", 8)

    async def main() -> None:
        d = InMemoryDirectory()
        await d.publish("b", h[:6])
        await d.publish("c", h[:2])
        router = PrefixRouter(d, BS)
        decision = await router.route(h, [WorkerLoad("a"), WorkerLoad("b"), WorkerLoad("c")], 128)
        assert decision.worker_id == "b" and decision.num_cached_tokens == 96
        assert decision.used_cache_info
        # Only the candidates count: "b" is not one.
        decision = await router.route(h, [WorkerLoad("a"), WorkerLoad("c")], 128)
        assert decision.worker_id == "c"
        assert router.num_fallbacks == 0 and router.num_routed == 2

    asyncio.run(main())


def test_router_falls_back_to_load_while_redis_is_down(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory()
    h = chain("fallback", 8)
    now = [0.0]

    async def main() -> None:
        d = RedisDirectory(server.url)
        router = PrefixRouter(d, BS, retry_after_s=5.0, clock=lambda: now[0])
        loads = [WorkerLoad("a", queued_prefill_tokens=64), WorkerLoad("b")]
        try:
            await d.publish("a", h)
            assert (await router.route(h, loads, 128)).worker_id == "a"
            server.stop()
            decision = await router.route(h, loads, 128)
            assert decision.worker_id == "b"  # least loaded
            assert not decision.used_cache_info
            assert router.num_fallbacks == 1 and router.degraded
            assert d.num_unavailable_errors == 1
            # Within retry_after_s the directory is not asked again.
            await router.route(h, loads, 128)
            assert router.num_fallbacks == 2 and d.num_unavailable_errors == 1
            server.start()  # empty again until workers republish
            await d.publish("a", h)
            now[0] += 5.0
            decision = await router.route(h, loads, 128)
            assert decision.worker_id == "a" and decision.used_cache_info
            assert not router.degraded and router.num_fallbacks == 2
        finally:
            await d.close()

    asyncio.run(main())


def test_package_imports_neither_torch_nor_redis() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tandem_services.directory, tandem_services.scheduler.routing.cost; "
        "bad = [m for m in ('torch', 'redis') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
