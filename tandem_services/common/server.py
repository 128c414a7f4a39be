"""gRPC server set-up shared by every service: health, reflection, message limits, signals;
the channel options and pool (`tandem_services.common.channels`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# The one set of channel / server options and the channel pool (defined beside the KV movers,
# which the library keeps and which cannot import the services).
from tandem_services.common.channels import (
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    PLAINTEXT,
    SERVER_OPTIONS,
    ChannelPool,
    TlsConfig,
    add_port,
    channel,
    insecure_channel,
    sync_channel,
)

__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "PLAINTEXT",
    "RETRY_AFTER_KEY",
    "SERVER_OPTIONS",
    "ChannelPool",
    "GrpcServer",
    "TlsConfig",
    "channel",
    "env_default",
    "insecure_channel",
    "setup_logging",
    "shutdown_event",
    "sync_channel",
    "write_ready_file",
]

# Trailing-metadata key of an overload refusal's (RESOURCE_EXHAUSTED) retry hint: whole
# seconds in ASCII, set by the scheduler's admission control, passed on by the frontend.
RETRY_AFTER_KEY = "retry-after"


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class GrpcServer:
    """A grpc.aio server with the health service and reflection for `service_names`; TLS (and
    mutual TLS) when `tls` says so (`tandem_services.common.channels.TlsConfig`)."""

    def __init__(self, service_names: Iterable[str], tls: TlsConfig = PLAINTEXT) -> None:
        self.tls = tls
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    def add(self, register: Callable[[grpc.aio.Server], None]) -> None:
        register(self.server)

    async def start(self, host: str, port: int) -> int:
        self.port = add_port(self.server, f"{host}:{port}", self.tls)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
        await self.server.start()
        await self.set_serving(True)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


def shutdown_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (a second one exits at once)."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def on_signal(signum: int) -> None:
        if event.is_set():
            logging.getLogger(__name__).warning("second signal %d: exiting now", signum)
            os._exit(1)
        logging.getLogger(__name__).info("signal %d: shutting down", signum)
        event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return event


def write_ready_file(path: str, lines: Iterable[str]) -> None:
    """Atomically write `path` (one `key=value` per line) so a launcher can wait on it."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    tmp.replace(target)


def env_default(name: str, default: str) -> str:
    """A flag's default from the environment (`TANDEM_<NAME>`); read in `__main__` only."""
    return os.environ.get(name, default)
