"""Runs the frontend: gRPC and HTTP servers on one event loop; drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import uvicorn

from tandem.loader import load_tokenizer, resolve_model_path, sampling_defaults
from tandem_protos.v1 import frontend_pb2, frontend_pb2_grpc
from tandem_services.common.metrics import start_metrics_server
from tandem_services.common.server import GrpcServer, shutdown_event, write_ready_file
from tandem_services.frontend.config import FrontendConfig
from tandem_services.frontend.grpc_api import FrontendServicer
from tandem_services.frontend.http_api import HttpApi
from tandem_services.frontend.metrics import FrontendMetrics, MeteredFrontendEngine

logger = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


async def serve(config: FrontendConfig) -> int:
    stop = shutdown_event()
    model_path = resolve_model_path(config.model, config.cache_dir or None)
    tokenizer = load_tokenizer(model_path)
    defaults = sampling_defaults(model_path, config.generation_config)
    if defaults:
        logger.info("default sampling parameters from generation_config.json: %s", defaults)
    metrics = FrontendMetrics(model_name=config.model_ids[0])
    engine = MeteredFrontendEngine(
        config.frontend_id,
        config.scheduler_address,
        tokenizer,
        config.model_ids[0],
        migration_limit=config.migration_limit,
        metrics=metrics,
        tls=config.tls,
        sampling_defaults=defaults,
    )
    await engine.start()
    metrics_server = await start_metrics_server(metrics.registry, config.host, config.metrics_port)

    grpc_server = GrpcServer(
        [frontend_pb2.DESCRIPTOR.services_by_name["Frontend"].full_name], tls=config.tls
    )
    servicer = FrontendServicer(engine, config.api_key, config.model_ids, config.request_limits)
    grpc_server.add(lambda s: frontend_pb2_grpc.add_FrontendServicer_to_server(servicer, s))
    grpc_port = await grpc_server.start(config.host, config.grpc_port)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.http_port))
    http_port = sock.getsockname()[1]
    http = HttpApi(
        engine,
        config.api_key,
        config.max_body_bytes,
        config.model_ids,
        config.request_limits,
        config.auto_tool_parser,
        metrics.registry,
        responses_store_size=config.responses_store_size,
    )
    uv = _Uvicorn(
        uvicorn.Config(
            http.app(),
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(config.grace_period_s)),
            access_log=False,
        )
    )
    http_task = asyncio.create_task(uv.serve(sockets=[sock]))
    while not uv.started and not http_task.done():
        await asyncio.sleep(0.01)
    if http_task.done():
        http_task.result()
    logger.info(
        "frontend %s: HTTP on %s:%d, gRPC on %s:%d",
        config.frontend_id,
        config.host,
        http_port,
        config.host,
        grpc_port,
    )
    if config.wait_for_workers_s > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(engine.serving.wait(), config.wait_for_workers_s)
    ready = [f"http={config.host}:{http_port}", f"grpc={config.host}:{grpc_port}"]
    if metrics_server is not None:
        ready.append(f"metrics={config.host}:{metrics_server.port}")
    write_ready_file(config.ready_file, ready)

    await stop.wait()
    # Refuse new requests; let the ones in flight finish within the grace period.
    engine.draining = True
    await grpc_server.set_serving(False)
    deadline = time.monotonic() + config.grace_period_s
    while time.monotonic() < deadline and await engine.num_inflight():
        await asyncio.sleep(0.05)
    # The rest end now with UNAVAILABLE (HTTP 503), so no handler outlives the server.
    left = await engine.fail_inflight("the frontend is shutting down; retry the request")
    if left:
        logger.warning("grace period over: ended %d requests with UNAVAILABLE", left)
        await asyncio.sleep(0.2)  # their handlers answer
    uv.should_exit = True
    await grpc_server.stop(grace_s=0.5)
    try:
        await asyncio.wait_for(http_task, timeout=5.0)
    except (TimeoutError, asyncio.CancelledError):
        logger.warning("HTTP connections still open after 5 s: closed")
    await engine.close()
    if metrics_server is not None:
        await metrics_server.close()
    logger.info("frontend stopped")
    return 0
