"""The scheduler's metrics: admission and the cluster as the scheduler sees it.

    tandem_scheduler_requests_total{outcome}        dispatched | cancelled | <gRPC code>
    tandem_scheduler_queue_time_seconds             submit -> dispatched to its workers
    tandem_scheduler_queued_requests                admission queue depth
    tandem_scheduler_queued_prefill_tokens          prompt tokens waiting in that queue
    tandem_scheduler_inflight_requests              dispatched, not yet reported finished
    tandem_scheduler_workers{role,state}            registered workers (ready | draining)
    tandem_scheduler_kv_cache_blocks{role,state}    KV blocks (used | free) summed per role

The gauges are read from `Dispatcher` at scrape time (on its event loop, between two
messages), so they are exact and cost nothing between scrapes.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from tandem_protos.v1 import common_pb2, scheduler_pb2
from tandem_services.common.metrics import LATENCY_BUCKETS_S, ScrapeCollector, gauge
from tandem_services.scheduler.dispatcher import Dispatcher
from tandem_services.scheduler.servicer import SchedulerServicer

_ROLES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_UNIFIED: "unified",
}


class SchedulerMetrics:
    def __init__(self, dispatcher: Dispatcher, registry: CollectorRegistry | None = None) -> None:
        self.dispatcher = dispatcher
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "tandem_scheduler_requests",
            "Submitted requests by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "tandem_scheduler_queue_time_seconds",
            "Time from submission until the request was dispatched to its workers.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(ScrapeCollector(self._collect))

    def _collect(self) -> Iterator[Metric]:
        dispatcher = self.dispatcher
        yield gauge("tandem_scheduler_queued_requests", "Requests waiting.", len(dispatcher.queued))
        yield gauge(
            "tandem_scheduler_queued_prefill_tokens",
            "Prompt tokens of the requests waiting.",
            sum(len(q.submit.request.prompt_token_ids) for q in dispatcher.queued.values()),
        )
        yield gauge(
            "tandem_scheduler_inflight_requests",
            "Requests dispatched and not yet finished.",
            len(dispatcher.inflight),
        )
        workers: dict[tuple[str, str], int] = defaultdict(int)
        blocks: dict[tuple[str, str], int] = defaultdict(int)
        for role in ("prefill", "decode", "unified"):
            for state in ("ready", "draining"):
                workers[role, state] = 0
            for state in ("used", "free"):
                blocks[role, state] = 0
        for w in dispatcher.workers.values():
            role = _ROLES.get(w.info.role, "unspecified")
            workers[role, "draining" if w.draining else "ready"] += 1
            blocks[role, "free"] += w.stats.num_free_blocks
            blocks[role, "used"] += w.stats.num_blocks - w.stats.num_free_blocks
        yield _labelled(
            "tandem_scheduler_workers", "Registered workers by role and state.", workers
        )
        yield _labelled(
            "tandem_scheduler_kv_cache_blocks",
            "KV cache blocks of the registered workers (last reports), by role and state.",
            blocks,
        )


def _labelled(name: str, doc: str, values: dict[tuple[str, str], int]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["role", "state"])
    for (role, state), value in sorted(values.items()):
        family.add_metric([role, state], value)
    return family


class MeteredSchedulerServicer(SchedulerServicer):
    """`SchedulerServicer` that counts every Submit's outcome and its queue time."""

    def __init__(self, dispatcher: Dispatcher, metrics: SchedulerMetrics) -> None:
        super().__init__(dispatcher)
        self.metrics = metrics

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        try:
            reply = await super().Submit(request, context)
        except asyncio.CancelledError:
            self.metrics.requests.labels("cancelled").inc()
            raise
        except BaseException:
            code = context.code()
            name = code.name.lower() if isinstance(code, grpc.StatusCode) else "internal"
            self.metrics.requests.labels(name).inc()
            raise
        self.metrics.requests.labels("dispatched").inc()
        self.metrics.queue_time.observe(reply.queue_time_s)
        return reply
