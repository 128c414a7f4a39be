"""Prometheus metrics plumbing shared by every service: a `/metrics` HTTP endpoint on the
service's event loop, histogram buckets, and a collector base for values read at scrape time.

Every service owns one `CollectorRegistry` (no global registry, no module-level state): its
metrics object is created in `serve`, handed to whatever records into it, and served by a
`MetricsServer`. Because the server runs on the service's event loop, a scrape-time collector
reads actor-owned state on the same thread that owns it, between two messages, never in the
middle of one.

Names follow Prometheus conventions: a `tandem_` prefix, base units in the name (`_seconds`,
`_bytes`, `_tokens`, `_ratio`), `_total` on counters. Beside them, what vLLM also measures is
exported under vLLM's names (`vllm:` prefix, a `model_name` label: `VLLM_LABELS`), so the
dashboards, autoscaler rules and inference gateways written for vLLM's servers read a tandem
deployment unchanged: the frontend's request latencies and token counts, each worker's queue
lengths, KV-cache usage, prefix-cache lookups and preemptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Latency buckets (seconds) for TTFT and end-to-end times: 5 ms .. 10 min.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
    320.0, 640.0,
)  # fmt: skip
# Per-output-token times (seconds): 1 ms .. 10 s.
TOKEN_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
# KV transfer times (seconds): 100 us .. 30 s.
TRANSFER_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# The label every `vllm:` family carries (vLLM's own), naming the served model.
VLLM_LABELS = ("model_name",)

# An HTTP request head larger than this is refused.
_MAX_HEAD_BYTES = 16 * 1024
_READ_TIMEOUT_S = 10.0


def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    """One gauge family with one sample (scrape-time collectors)."""
    labels = labels or {}
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    """One counter family with one sample; `name` without the `_total` suffix."""
    labels = labels or {}
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class ScrapeCollector(Collector):
    """A collector whose families come from a function called at every scrape."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._collect()
        except Exception:  # a scrape must never take the service down
            logger.exception("metrics collection failed")

    def describe(self) -> list[Metric]:
        # Families appear and disappear with state (labels per worker role): no fixed list.
        return []


class MetricsServer:
    """`GET /metrics` (Prometheus text format) and `GET /healthz` on the running event loop.

    A deliberately small HTTP/1.1 server (one request per connection): scrapes are rare and
    tiny, and serving them on the loop keeps collectors on the thread that owns the state.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port (`port` 0: any free port)."""
        self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            if len(head) > _MAX_HEAD_BYTES:
                raise ValueError("request head too large")
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"ok\n"
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1")
            )
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except (ConnectionError, ValueError) as exc:
            logger.debug("metrics request failed: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> MetricsServer | None:
    """Serve `registry` on host:port; `port` < 0 disables metrics (returns None)."""
    if port < 0:
        return None
    server = MetricsServer(registry)
    bound = await server.start(host, port)
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return server
