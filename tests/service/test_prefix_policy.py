"""Scheduler routing policies without processes: prefix-aware (directory, dispatch record,
fallback), round robin, and the flags that build them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tandem.core.kv_cache_utils import compute_block_hashes
from tandem_protos.v1 import common_pb2
from tandem_services.directory import (
    DirectoryConfig,
    DirectoryUnavailable,
    InMemoryDirectory,
)
from tandem_services.scheduler.config import SchedulerServiceConfigError, config_from_args
from tandem_services.scheduler.routing import (
    ROUTING_CHOICES,
    DispatchedPrefixes,
    LoadBasedRouting,
    PrefixAwareRouting,
    PrefixRouter,
    RoundRobinRouting,
    Route,
    RoutingPolicy,
    RoutingRequest,
    RoutingWeights,
    WorkerView,
    make_routing_policy,
    prompt_block_hashes,
    routing_metrics,
)

P, D, U = (
    common_pb2.WORKER_ROLE_PREFILL,
    common_pb2.WORKER_ROLE_DECODE,
    common_pb2.WORKER_ROLE_UNIFIED,
)
BS = 16
PREFIX = list(range(1000, 1064))  # 4 blocks


def _w(
    wid: str,
    role: int = P,
    inflight: int = 0,
    queued_tokens: int = 0,
    running: int = 0,
    free: int = 100,
    block_size: int = BS,
) -> WorkerView:
    return WorkerView(wid, role, running, 0, free, 100, inflight, block_size, 2048, queued_tokens)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _DownDirectory(InMemoryDirectory):
    """A directory whose server is away (raises like RedisDirectory does)."""

    async def longest_prefix(self, block_hashes: object) -> dict[str, int]:  # type: ignore[override]
        self.num_unavailable_errors += 1
        raise DirectoryUnavailable("server away")


async def _request(policy: PrefixAwareRouting, tokens: list[int], salt: str | None = None):
    prefix = await policy.lookup(tokens, salt, BS)
    return RoutingRequest("r", tokens, 0, prefix)


def test_directory_prefix_wins_over_a_small_load_difference() -> None:
    async def run() -> None:
        directory = InMemoryDirectory()
        policy = PrefixAwareRouting(PrefixRouter(directory, BS), hints=None)
        prompt = [*PREFIX, 7, 8, 9, 10, 11]
        hashes = compute_block_hashes(prompt, BS)
        await directory.publish("p2", hashes[:3])
        workers = [_w("p1"), _w("p2", inflight=1, queued_tokens=20), _w("d", D)]
        req = await _request(policy, prompt)
        assert req.prefix is not None and req.prefix.cached_blocks == {"p2": 3}
        assert policy.route(req, workers) == Route("p2", "d", 48)
        # Too much queued on p2: the uncached prompt on p1 is cheaper.
        busy = [_w("p1"), _w("p2", queued_tokens=500), _w("d", D)]
        assert policy.route(req, busy) == Route("p1", "d", 0)
        # A worker with another block size cannot hold this chain.
        other = [_w("p1"), _w("p2", block_size=32), _w("d", D)]
        assert policy.route(req, other) == Route("p1", "d", 0)
        # Nothing cached anywhere: ties by load (fewer queued tokens).
        cold = await _request(policy, [1, 2, 3] * 20)
        assert (
            policy.route(cold, [_w("p1", queued_tokens=5), _w("p2"), _w("d", D)]).prefill_worker_id
            == "p2"
        )
        assert policy.num_directory_answers == 2 and policy.num_fallbacks == 0

    asyncio.run(run())


def test_cache_salt_changes_the_chain() -> None:
    async def run() -> None:
        directory = InMemoryDirectory()
        policy = PrefixAwareRouting(PrefixRouter(directory, BS), hints=None)
        await directory.publish("p2", compute_block_hashes(PREFIX, BS, "tenant-a"))
        workers = [_w("p1"), _w("p2"), _w("d", D)]
        salted = await _request(policy, [*PREFIX, 1], "tenant-a")
        assert policy.route(salted, workers).prefill_worker_id == "p2"
        unsalted = await _request(policy, [*PREFIX, 1])
        assert unsalted.prefix is not None and unsalted.prefix.cached_blocks == {}
        assert policy.route(unsalted, workers).prefill_worker_id == "p1"

    asyncio.run(run())


def test_directory_down_routes_on_load_and_counts_fallbacks() -> None:
    async def run() -> None:
        policy = PrefixAwareRouting(PrefixRouter(_DownDirectory(), BS), hints=None)
        req = await _request(policy, [*PREFIX, 1])
        assert req.prefix is not None and req.prefix.cached_blocks is None
        workers = [_w("p1", inflight=2, queued_tokens=100), _w("p2"), _w("d", D)]
        assert policy.route(req, workers) == Route("p2", "d", 0)
        assert policy.num_fallbacks == 1 and policy.directory_degraded
        names = {m.name for m in routing_metrics(policy)}
        assert "tandem_scheduler_prefix_directory_fallbacks" in names
        up = next(m for m in routing_metrics(policy) if m.name.endswith("directory_up"))
        assert up.samples[0].value == 0.0

    asyncio.run(run())


def test_dispatch_record_sends_a_shared_prefix_to_the_same_worker_before_any_publish() -> None:
    async def run() -> None:
        policy = PrefixAwareRouting(None, hints=DispatchedPrefixes(ttl_s=5.0))
        workers = [_w("p1"), _w("p2"), _w("d", D)]
        first = policy.route(await _request(policy, [*PREFIX, 1, 2]), workers)
        assert first is not None and first.num_cached_tokens == 0
        other = "p2" if first.prefill_worker_id == "p1" else "p1"
        # The first is partly computed there; the second goes there for its prefix.
        loaded = [
            _w(first.prefill_worker_id, inflight=1, queued_tokens=20),
            _w(other),
            _w("d", D),
        ]
        second = policy.route(await _request(policy, [*PREFIX, 3, 4]), loaded)
        assert second == Route(first.prefill_worker_id, "d", 64)
        policy.forget_worker(first.prefill_worker_id)
        third = policy.route(await _request(policy, [*PREFIX, 5, 6]), loaded)
        assert third is not None and third.prefill_worker_id == other

    asyncio.run(run())


def test_dispatched_prefixes_expire_and_evict_the_chain_tail_first() -> None:
    clock = _Clock()
    record = DispatchedPrefixes(ttl_s=2.0, clock=clock)
    chain = compute_block_hashes(list(range(96)), BS)  # 6 blocks
    record.record("w", chain, capacity=4)
    # The last two blocks went first: the chain's head stays usable.
    assert record.longest_prefix(chain) == {"w": 4}
    assert record.num_entries("w") == 4
    clock.now = 1.0
    other = compute_block_hashes(list(range(500, 532)), BS)
    record.record("w", other, capacity=4)  # evicts the two oldest of the first chain
    assert record.longest_prefix(other) == {"w": 2}
    assert record.longest_prefix(chain) == {"w": 2}
    clock.now = 2.5  # the first chain's entries expired
    assert record.longest_prefix(chain) == {}
    assert record.longest_prefix(other) == {"w": 2}
    with pytest.raises(ValueError):
        DispatchedPrefixes(ttl_s=0)


def test_round_robin_cycles_and_load_policy_unchanged() -> None:
    rr = RoundRobinRouting()
    workers = [_w("p2"), _w("p1", inflight=5), _w("d", D)]
    req = RoutingRequest("r", PREFIX, 0)
    picks = [rr.route(req, workers) for _ in range(4)]
    assert [p.prefill_worker_id for p in picks if p] == ["p1", "p2", "p1", "p2"]
    unified = [_w("u1", U), _w("u2", U)]
    assert [rr.route(req, unified) for _ in range(2)] == [Route("u1", None), Route("u2", None)]
    assert LoadBasedRouting().route(req, workers) == Route("p2", "d")


def test_prompt_hashes_are_the_engine_hashes() -> None:
    tokens = list(range(70))
    assert prompt_block_hashes(tokens, BS, None) == compute_block_hashes(tokens, BS)
    assert len(prompt_block_hashes(tokens, BS, "s")) == 4


def test_flags_build_the_policy() -> None:
    c = config_from_args(
        [
            "--routing",
            "prefix",
            "--routing-queued-token-weight",
            "0.5",
            "--prefix-hint-ttl-s",
            "0",
            "--redis-url",
            "redis://127.0.0.1:6390/2",
            "--redis-tls-no-check-hostname",
            "--directory-ttl-s",
            "7",
        ]
    )
    assert c.routing_weights == RoutingWeights(queued_token=0.5)
    assert c.directory.redis_url == "redis://127.0.0.1:6390/2"
    assert not c.directory.redis_tls_check_hostname and c.directory.worker_ttl_s == 7.0
    policy = make_routing_policy(
        c.routing, c.directory, c.routing_weights, c.prefix_hint_ttl_s, 8, 8
    )
    assert isinstance(policy, PrefixAwareRouting)
    assert policy.router is not None and policy.hints is None
    asyncio.run(policy.close())
    local = make_routing_policy("prefix", DirectoryConfig(), RoutingWeights(), -1, 8, 8)
    assert isinstance(local, PrefixAwareRouting)
    assert local.router is None and local.hints is not None and local.hints.ttl_s == 300.0
    assert isinstance(
        make_routing_policy("round-robin", DirectoryConfig(), RoutingWeights(), -1, 8, 8),
        RoundRobinRouting,
    )
    assert config_from_args([]).routing == "prefix"
    with pytest.raises(SchedulerServiceConfigError):
        config_from_args(["--routing-running-request-weight", "-1"])
    with pytest.raises(SystemExit):
        config_from_args(["--routing", "random"])


def test_one_policy_interface_with_defaults() -> None:
    """Every policy the flags build is a `RoutingPolicy`; a policy that writes only `route`
    gets every other hook the dispatcher calls from the base class."""

    class FirstWorker(RoutingPolicy):
        name = "first"

        def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
            return Route(workers[0].worker_id, None) if workers else None

    policy = FirstWorker()
    assert not policy.uses_lookup
    assert asyncio.run(policy.lookup([1, 2, 3], None, BS)) is None
    policy.forget_worker("u1")
    asyncio.run(policy.leave_directory("u1"))
    asyncio.run(policy.close())
    [info] = list(routing_metrics(policy))
    assert info.name == "tandem_scheduler_routing_info"
    assert info.samples[0].labels == {"policy": "first"}
    assert policy.route(RoutingRequest("r", [1], 0), [_w("u1", U)]) == Route("u1", None)
    with pytest.raises(TypeError):
        RoutingPolicy()  # type: ignore[abstract]
    for routing in ROUTING_CHOICES:
        built = make_routing_policy(routing, DirectoryConfig(), RoutingWeights(), -1, 8, 8)
        assert isinstance(built, RoutingPolicy) and built.name == routing
        assert built.uses_lookup == (routing == "prefix")
