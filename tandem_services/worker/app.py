"""Runs one worker: engine-core process, gRPC server, scheduler link; drains on SIGTERM.

The engine runs in a child process (`EngineCoreProc`) reached through an `AsyncMPClient`, so
this process's event loop (gRPC, protobuf conversion, KV hand-off sessions) and the engine's
host work do not share one GIL. When the engine process dies, the worker notices at once (its
output pipe closes): it reports NOT_SERVING, fails every request in flight with an error, and
exits non-zero. When the engine's step loop stalls (a step in flight longer than
`engine_stall_timeout_s`, or the process stopped), the worker's gRPC health is NOT_SERVING and
its load reports pause, so the scheduler drops it after its `dead_after_s` and routes around
it; once steps run again the health is SERVING and the worker registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.core_client import AsyncMPClient
from tandem.engine.serial import Piggyback
from tandem.kv_transfer.placement import TCP, host_id
from tandem_protos.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tandem_services.common.entrypoint import reachable_address
from tandem_services.common.metrics import start_metrics_server
from tandem_services.common.server import (
    GrpcServer,
    channel,
    shutdown_event,
    write_ready_file,
)
from tandem_services.worker import engine_host as m
from tandem_services.worker.config import WorkerServiceConfig
from tandem_services.worker.kv_tcp import TcpKVConnector
from tandem_services.worker.kv_transports import KVTransports, worker_transports
from tandem_services.worker.metrics import MeteredKVTransports, WorkerMetrics
from tandem_services.worker.prefix_publishing import (
    CacheMirror,
    publishes_prefixes,
    start_prefix_publishing,
    stop_prefix_publishing,
)
from tandem_services.worker.roles import worker_role
from tandem_services.worker.servicer import WorkerServicer, stats_to_proto

logger = logging.getLogger(__name__)


class SchedulerLink:
    """Registers with the scheduler and streams load reports; registers again when the
    stream ends. A NOT_FOUND answer means the scheduler dropped this worker and failed its
    requests, so the worker aborts them too. A lost connection (scheduler restarting) leaves
    requests running: their outputs go straight to the frontends."""

    def __init__(
        self,
        config: WorkerServiceConfig,
        register: scheduler_pb2.RegisterWorkerRequest,
        host: m.EngineHost,
        engine: AsyncMPClient,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.register_request = register
        self.host = host
        self.engine = engine
        self.max_model_len = max_model_len
        self.registered = asyncio.Event()
        # Cleared while the engine is stalled (see the module docstring).
        self.engine_running = asyncio.Event()
        self.engine_running.set()
        self._channel = channel(config.scheduler_address, config.tls)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def run(self) -> None:
        backoff = 0.1
        had_stream = False
        while True:
            try:
                reply = await self._stub.RegisterWorker(self.register_request, timeout=5.0)
                self.registered.set()
                backoff = 0.1
                had_stream = True
                await self._stub.ReportLoad(self._reports(reply.report_interval_s or 0.25))
            except grpc.aio.AioRpcError as exc:
                if had_stream:
                    logger.warning("scheduler link lost (%s); registering again", exc.code().name)
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    # The scheduler dropped this worker (it missed reports) and failed its
                    # requests: stop working on them.
                    ids = await self.host.ask(m.Inflight())
                    if ids:
                        await self.host.ask(
                            m.Abort(ids, notify_error="the scheduler dropped this worker")
                        )
            had_stream = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _reports(self, interval_s: float) -> AsyncIterator[scheduler_pb2.LoadReport]:
        while True:
            # A stalled engine: no reports, so the scheduler drops this worker.
            await self.engine_running.wait()
            finished, num_inflight = await self.host.ask(m.TakeFinished())
            # The latest snapshot, not a fresh read: a report must not wait for a long step.
            stats = self.engine.latest_stats
            yield scheduler_pb2.LoadReport(
                worker_id=self.config.worker_id,
                stats=stats_to_proto(
                    stats,
                    self.config.worker_id,
                    self.config.role,
                    num_inflight,
                    self.config.engine.cache.block_size,
                    self.max_model_len,
                ),
                finished_request_ids=finished,
            )
            await asyncio.sleep(interval_s)

    async def deregister(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.DeregisterWorker(
                scheduler_pb2.DeregisterWorkerRequest(worker_id=self.config.worker_id),
                timeout=2.0,
            )

    async def close(self) -> None:
        await self._channel.close()


async def _ticker(host: m.EngineHost) -> None:
    while True:
        await asyncio.sleep(1.0)
        host.tell(m.Tick())


async def serve(config: WorkerServiceConfig) -> int:
    stop = shutdown_event()
    holder: list[m.EngineHost] = []
    role = worker_role(config.role)
    metrics = WorkerMetrics(config.role, model_name=config.engine.model.model)

    mirror = CacheMirror()
    publishes = publishes_prefixes(config)
    engine_dead = asyncio.Event()

    def on_piggyback(pig: Piggyback) -> None:
        if pig.cache_events:
            mirror.apply(pig.cache_events)

    def on_step(outputs: list[EngineCoreOutput], pig: Piggyback) -> None:
        on_piggyback(pig)
        holder[0].tell(m.Step(outputs, pig.held_block_ids))
        metrics.on_step(outputs)

    def on_dead(reason: str) -> None:
        engine_dead.set()
        if holder:
            holder[0].tell(m.Abort(list(holder[0].requests), notify_error=reason))

    server = GrpcServer(
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name], tls=config.tls
    )
    link: SchedulerLink | None = None
    health_tasks: set[asyncio.Task[None]] = set()

    def on_stall(stalled: bool) -> None:
        if link is not None:
            (link.engine_running.clear if stalled else link.engine_running.set)()
        if server.port and not engine_dead.is_set() and not stop.is_set():  # not draining
            task = asyncio.get_running_loop().create_task(server.set_serving(not stalled))
            health_tasks.add(task)
            task.add_done_callback(health_tasks.discard)

    client = AsyncMPClient(
        config.engine,
        on_step,
        role.engine_options(publish_cache_events=publishes),
        name=f"engine-{config.role}",
        on_dead=on_dead,
        on_piggyback=on_piggyback,
        stall_timeout_s=config.engine_stall_timeout_s,
        on_stall=on_stall,
    )
    info = await client.start()
    logger.info("engine-core process %s ready", info.pid)
    host = m.EngineHost(
        config.worker_id,
        client,
        info.block_size,
        info.max_model_len,
        config.destination_timeout_s,
        config.rpc_timeout_s,
        role,
        config.tls,
        info.kv_cache_spec,
    )
    holder.append(host)
    host.start()
    connector = None
    if role.has_kv_connector:
        kv_caches = client.kv_caches()
        tcp = TcpKVConnector(
            kv_caches, client, config.kv_max_message_bytes, config.rpc_timeout_s, tls=config.tls
        )
        # TCP, and CUDA IPC / NCCL (gloo on CPU) where this process can; the scheduler picks
        # one per pair and names it in each hand-off. An engine of several ranks moves each
        # rank's share of a block to the same rank of the peer: over TCP only, today.
        transports = (
            KVTransports({TCP: tcp})
            if len(kv_caches) > 1
            else worker_transports(
                kv_caches[0], client, tcp, config.worker_id, config.rpc_timeout_s, tls=config.tls
            )
        )
        connector = MeteredKVTransports(transports, metrics)
        host.connector = connector

    servicer = WorkerServicer(role, config.worker_id, host, client, info.eos_token_id, connector)
    server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s))
    port = await server.start(config.host, config.port)
    metrics.bind(host, client)
    metrics_server = await start_metrics_server(metrics.registry, config.host, config.metrics_port)
    # Prefix-cache directory feed (prefill / unified workers, when a server is configured).
    publisher = await start_prefix_publishing(config, mirror, metrics.registry)
    address = config.advertise_address or reachable_address(config.host, port)
    tasks = [asyncio.create_task(_ticker(host))]

    if config.scheduler_address:
        link = SchedulerLink(
            config,
            scheduler_pb2.RegisterWorkerRequest(
                worker_id=config.worker_id,
                address=address,
                role=role.proto,
                model=config.engine.model.model,
                max_model_len=info.max_model_len,
                block_size=info.block_size,
                num_blocks=info.num_blocks,
                kv_transports=connector.names if connector is not None else [],
                host_id=host_id(),
                process_id=os.getpid(),
                kv_device=info.kv_device,
                kv_cache_group_windows=[w or 0 for w in host.kv_cache_spec.group_windows],
            ),
            host,
            client,
            info.max_model_len,
        )
        tasks.append(asyncio.create_task(link.run()))
        registered = asyncio.create_task(link.registered.wait())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([registered, stopping], return_when=asyncio.FIRST_COMPLETED)
        registered.cancel()
        stopping.cancel()
    logger.info("%s worker %s serving on %s", config.role, config.worker_id, address)
    ready = [f"grpc={address}", f"worker_id={config.worker_id}", f"engine_pid={info.pid}"]
    if metrics_server is not None:
        ready.append(f"metrics={config.host}:{metrics_server.port}")
    write_ready_file(config.ready_file, ready)

    # Run until SIGTERM or until the engine process dies.
    stopping = asyncio.create_task(stop.wait())
    dead = asyncio.create_task(engine_dead.wait())
    await asyncio.wait([stopping, dead], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    dead.cancel()
    exit_code = 0 if client.alive else 1
    if exit_code:
        logger.error("worker %s: %s; stopping", config.worker_id, client.dead_reason)

    # Drain: no new work, let in-flight requests finish within the grace period.
    await host.ask(m.SetDraining())
    await server.set_serving(False)
    if link is not None:
        await link.deregister()
    await stop_prefix_publishing(publisher)
    deadline = time.monotonic() + config.grace_period_s
    while client.alive and time.monotonic() < deadline and await host.ask(m.Inflight()):
        await asyncio.sleep(0.05)
    remaining = await host.ask(m.Inflight())
    if remaining:
        logger.warning("grace period over: handing back %d requests", len(remaining))
        reason = "the worker is shutting down" if client.alive else "the engine failed"
        await host.ask(m.Abort(remaining, notify_error=reason))
    # Let the streams carry the last outputs, then end them.
    flush_deadline = time.monotonic() + 1.0
    while time.monotonic() < flush_deadline and await host.ask(m.HasPendingOutputs()):
        await asyncio.sleep(0.02)
    await host.ask(m.CloseStreams())
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await server.stop(grace_s=1.0)
    await client.shutdown()
    await host.close()
    if connector is not None:
        await connector.close()
    if link is not None:
        await link.close()
    if metrics_server is not None:
        await metrics_server.close()
    logger.info(
        "worker %s stopped (%d engine step frames)", config.worker_id, client.num_step_frames
    )
    return exit_code
