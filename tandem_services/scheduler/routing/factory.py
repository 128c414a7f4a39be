"""The policy `--routing` names, and its metrics for the scheduler's scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from tandem_services.directory import DirectoryConfig, make_directory
from tandem_services.scheduler.routing.base import RoutingPolicy
from tandem_services.scheduler.routing.cost import RoutingWeights
from tandem_services.scheduler.routing.directory_lookup import PrefixRouter
from tandem_services.scheduler.routing.load import LoadBasedRouting
from tandem_services.scheduler.routing.prefix import DispatchedPrefixes, PrefixAwareRouting
from tandem_services.scheduler.routing.round_robin import RoundRobinRouting

# The `--routing` values; the first is the default.
ROUTING_CHOICES = ("prefix", "round-robin", "load")


def routing_metrics(policy: RoutingPolicy) -> Iterator[Metric]:
    """The routing policy's metrics, read at scrape time (on the scheduler's event loop):
    `tandem_scheduler_routing_info{policy}` for every policy, plus the policy's own."""
    return policy.metrics()


def make_routing_policy(
    routing: str,
    directory: DirectoryConfig,
    weights: RoutingWeights,
    hint_ttl_s: float,
    max_inflight_per_worker: int,
    max_inflight_prefills: int,
) -> RoutingPolicy:
    """The policy `--routing` names. `hint_ttl_s` < 0: 2 s with a directory server (it only
    bridges the publish delay), 300 s without (the record is all there is); 0: no record."""
    if routing == "load":
        return LoadBasedRouting(max_inflight_per_worker, max_inflight_prefills)
    if routing == "round-robin":
        return RoundRobinRouting(max_inflight_per_worker, max_inflight_prefills)
    if routing != "prefix":
        raise ValueError(f"routing must be one of {', '.join(ROUTING_CHOICES)}, got {routing!r}")
    router = None
    if directory.uses_redis:
        # PrefixRouter's block size serves its `route`; lookups here hash with the workers'.
        router = PrefixRouter(make_directory(directory), block_size=16)
    if hint_ttl_s < 0:
        hint_ttl_s = 2.0 if router is not None else 300.0
    hints = DispatchedPrefixes(hint_ttl_s) if hint_ttl_s > 0 else None
    return PrefixAwareRouting(
        router,
        weights,
        hints,
        max_inflight_per_worker=max_inflight_per_worker,
        max_inflight_prefills=max_inflight_prefills,
    )
