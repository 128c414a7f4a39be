"""Routing: which workers run a request. The scheduler service's one routing package.

    base.py              RoutingPolicy (the one interface; every hook declared, with defaults),
                         RoutingRequest, WorkerView, Route, PrefixLookup, candidates()
    load.py              --routing load         LoadBasedRouting
    round_robin.py       --routing round-robin  RoundRobinRouting
    prefix.py            --routing prefix       PrefixAwareRouting, DispatchedPrefixes
    cost.py              the cost model (cached prefix against load), its choosers
    directory_lookup.py  PrefixRouter: the directory asked for cached prefixes, never failing
    factory.py           make_routing_policy (from the flags), routing_metrics

tandem_services/directory/ keeps the directory itself (Redis, in-memory) and the workers' publisher.
"""

from __future__ import annotations

from tandem_services.scheduler.routing.base import (
    Candidates,
    PrefixLookup,
    Route,
    RoutingPolicy,
    RoutingRequest,
    WorkerView,
    candidates,
    roomiest_decode,
)
from tandem_services.scheduler.routing.cost import (
    CostModelChooser,
    PrefillChooser,
    RoundRobinChooser,
    RoutingDecision,
    RoutingWeights,
    WorkerLoad,
    choose_worker,
    num_uncached_tokens,
    rank_workers,
    routing_cost,
)
from tandem_services.scheduler.routing.directory_lookup import PrefixRouter
from tandem_services.scheduler.routing.factory import (
    ROUTING_CHOICES,
    make_routing_policy,
    routing_metrics,
)
from tandem_services.scheduler.routing.load import LoadBasedRouting
from tandem_services.scheduler.routing.prefix import (
    DispatchedPrefixes,
    PrefixAwareRouting,
    prompt_block_hashes,
)
from tandem_services.scheduler.routing.round_robin import RoundRobinRouting

__all__ = [
    "ROUTING_CHOICES",
    "Candidates",
    "CostModelChooser",
    "DispatchedPrefixes",
    "LoadBasedRouting",
    "PrefillChooser",
    "PrefixAwareRouting",
    "PrefixLookup",
    "PrefixRouter",
    "RoundRobinChooser",
    "RoundRobinRouting",
    "Route",
    "RoutingDecision",
    "RoutingPolicy",
    "RoutingRequest",
    "RoutingWeights",
    "WorkerLoad",
    "WorkerView",
    "candidates",
    "choose_worker",
    "make_routing_policy",
    "num_uncached_tokens",
    "prompt_block_hashes",
    "rank_workers",
    "roomiest_decode",
    "routing_cost",
    "routing_metrics",
]
