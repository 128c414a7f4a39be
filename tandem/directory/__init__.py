"""Prefix-cache directory (which worker holds which KV block) and KV-aware routing.

Importing this package does not import redis; `RedisDirectory` lives in
`tandem.directory.redis_directory` and `make_directory` imports it only when a URL is set.
"""

from __future__ import annotations

from tandem.directory.base import DirectoryUnavailable, PrefixDirectory
from tandem.directory.factory import DirectoryConfig, make_directory
from tandem.directory.memory import InMemoryDirectory
from tandem.directory.publisher import DirectoryPublisher
from tandem.directory.router import PrefixRouter
from tandem.directory.routing import (
    PrefixAwarePolicy,
    RoundRobin,
    RoutingDecision,
    RoutingPolicy,
    RoutingWeights,
    WorkerLoad,
    choose_worker,
    rank_workers,
    routing_cost,
)

__all__ = [
    "DirectoryConfig",
    "DirectoryPublisher",
    "DirectoryUnavailable",
    "InMemoryDirectory",
    "PrefixAwarePolicy",
    "PrefixDirectory",
    "PrefixRouter",
    "RoundRobin",
    "RoutingDecision",
    "RoutingPolicy",
    "RoutingWeights",
    "WorkerLoad",
    "choose_worker",
    "make_directory",
    "rank_workers",
    "routing_cost",
]
