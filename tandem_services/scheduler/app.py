"""Runs the scheduler service until SIGTERM, then drains within the grace period."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from tandem_protos.v1 import scheduler_pb2, scheduler_pb2_grpc
from tandem_services.common.metrics import ScrapeCollector, start_metrics_server
from tandem_services.common.server import GrpcServer, shutdown_event, write_ready_file
from tandem_services.scheduler.config import SchedulerServiceConfig
from tandem_services.scheduler.dispatcher import Dispatcher
from tandem_services.scheduler.messages import BeginShutdown, CountDispatching, Tick
from tandem_services.scheduler.metrics import MeteredSchedulerServicer, SchedulerMetrics
from tandem_services.scheduler.routing import make_routing_policy, routing_metrics

logger = logging.getLogger(__name__)


async def _ticker(dispatcher: Dispatcher, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        dispatcher.tell(Tick())


async def serve(config: SchedulerServiceConfig) -> int:
    stop = shutdown_event()
    policy = make_routing_policy(
        config.routing,
        config.directory,
        config.routing_weights,
        config.prefix_hint_ttl_s,
        config.max_inflight_per_worker,
        config.max_inflight_prefills,
    )
    directory = (
        f"prefix directory at {config.directory.redis_url}"
        if config.directory.uses_redis
        else "no prefix directory (routing on the scheduler's own dispatch record)"
    )
    logger.info("routing: %s; %s", config.routing, directory)
    dispatcher = Dispatcher(config, policy)
    dispatcher.start()
    server = GrpcServer(
        [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name], tls=config.tls
    )
    metrics = SchedulerMetrics(dispatcher)
    metrics.registry.register(ScrapeCollector(lambda: routing_metrics(policy)))
    servicer = MeteredSchedulerServicer(dispatcher, metrics)
    server.add(lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s))
    port = await server.start(config.host, config.port)
    metrics_server = await start_metrics_server(metrics.registry, config.host, config.metrics_port)
    ticker = asyncio.create_task(_ticker(dispatcher, min(config.report_interval_s, 0.5)))
    address = f"{config.host}:{port}"
    logger.info("scheduler serving on %s", address)
    ready = [f"grpc={address}"]
    if metrics_server is not None:
        ready.append(f"metrics={config.host}:{metrics_server.port}")
    write_ready_file(config.ready_file, ready)

    await stop.wait()
    # Stop taking work; queued requests fail with UNAVAILABLE; let dispatches finish.
    await dispatcher.ask(BeginShutdown())
    deadline = time.monotonic() + config.grace_period_s
    while time.monotonic() < deadline and await dispatcher.ask(CountDispatching()):
        await asyncio.sleep(0.05)
    await server.stop(grace_s=max(0.0, min(1.0, deadline - time.monotonic())))
    ticker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ticker
    await dispatcher.close()
    if metrics_server is not None:
        await metrics_server.close()
    logger.info("scheduler stopped")
    return 0
