"""A worker's metrics: its engine, its KV cache and its KV transfers.

    tandem_worker_running_requests, tandem_worker_waiting_requests     engine scheduler queues
    tandem_worker_inflight_requests            every request this worker is responsible for
    tandem_worker_pending_prefill_tokens       prompt tokens of requests not yet past prefill
    tandem_worker_kv_cache_blocks_used, tandem_worker_kv_cache_blocks_free
    tandem_worker_kv_cache_usage_ratio
    tandem_worker_prefix_cache_queried_tokens_total, tandem_worker_prefix_cache_hit_tokens_total
    tandem_worker_prefix_cache_hit_ratio       hit tokens / queried tokens since start
    tandem_worker_preemptions_total
    tandem_worker_engine_steps_total, tandem_worker_generated_tokens_total
    tandem_worker_spec_decode_num_drafts_total, ..._num_draft_tokens_total,
    ..._num_accepted_tokens_total, ..._num_accepted_tokens_per_pos_total{position}
                                               speculative decoding (only when it is on)
    tandem_worker_moe_expert_tokens_total{layer,expert}    tokens routed to each expert of
                                               each MoE layer (MoE models only)
    tandem_kv_transfer_bytes_total{direction,transport}    sent | received; tcp, cuda_ipc, nccl
    tandem_kv_transfer_duration_seconds{direction,transport}   one request's prompt KV

Sends are measured on every transport; receives on TCP (the CUDA IPC and NCCL writers are
the senders, so their side carries the figures).

Under vLLM's names (tandem_services.common.metrics), with a `model_name` label instead of
`role`: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (a
fraction, as vLLM's), vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total,
vllm:num_preemptions_total.

Every tandem_ family carries a `role` label (prefill, decode, unified). Engine figures come from the
engine thread's latest snapshot and the worker's request table, read at scrape time on the
event loop. The autoscaling signals are `pending_prefill_tokens` (prefill pool) and
`kv_cache_usage_ratio` / `running_requests` (decode pool).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.core_client import AsyncMPClient
from tandem.kv_transfer.base import KVDestination
from tandem.kv_transfer.placement import TCP
from tandem_services.common.metrics import (
    TRANSFER_BUCKETS_S,
    VLLM_LABELS,
    ScrapeCollector,
    counter,
    gauge,
)
from tandem_services.worker import engine_host as m
from tandem_services.worker.kv_transports import KVTransports
from tandem_services.worker.states import Phase, Role


class WorkerMetrics:
    def __init__(
        self, role: str, registry: CollectorRegistry | None = None, model_name: str = ""
    ) -> None:
        self.role = role
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.steps = Counter(
            "tandem_worker_engine_steps", "Engine steps with outputs.", ["role"], registry=r
        ).labels(role)
        self.generated_tokens = Counter(
            "tandem_worker_generated_tokens", "Tokens sampled by this engine.", ["role"], registry=r
        ).labels(role)
        self.transfer_bytes = Counter(
            "tandem_kv_transfer_bytes",
            "KV cache bytes moved between workers.",
            ["role", "direction", "transport"],
            registry=r,
        )
        self.transfer_time = Histogram(
            "tandem_kv_transfer_duration_seconds",
            "Time to move one request's prompt KV (send: until the receiver acknowledged).",
            ["role", "direction", "transport"],
            buckets=TRANSFER_BUCKETS_S,
            registry=r,
        )
        self._host: m.EngineHost | None = None
        self._engine: AsyncMPClient | None = None

    def bind(self, host: m.EngineHost, engine: AsyncMPClient) -> None:
        """Start reporting the state of `host` and `engine` at scrape time."""
        self._host, self._engine = host, engine
        self.registry.register(ScrapeCollector(self._collect))

    def on_transfer(self, direction: str, transport: str, num_bytes: int, seconds: float) -> None:
        """One request's prompt KV moved (`direction`: sent or received)."""
        self.transfer_bytes.labels(self.role, direction, transport).inc(num_bytes)
        self.transfer_time.labels(self.role, direction, transport).observe(seconds)

    def on_step(self, outputs: list[EngineCoreOutput]) -> None:
        """Called on the event loop with each engine step's outputs."""
        self.steps.inc()
        self.generated_tokens.inc(sum(len(o.new_token_ids) for o in outputs))

    def _collect(self) -> Iterator[Metric]:
        assert self._host is not None and self._engine is not None
        labels = {"role": self.role}
        requests = self._host.requests.values()
        yield gauge(
            "tandem_worker_inflight_requests",
            "Requests this worker is responsible for.",
            len(self._host.requests),
            labels,
        )
        yield gauge(
            "tandem_worker_pending_prefill_tokens",
            "Prompt tokens of this worker's requests whose prefill has not finished.",
            sum(
                r.num_prompt_tokens
                for r in requests
                if r.kind != Role.DECODE and r.phase == Phase.RUNNING and r.num_emitted == 0
            ),
            labels,
        )
        stats = self._engine.latest_stats
        if stats is None:
            return
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        for name, doc, value in (
            ("running_requests", "Requests in the engine's running batch.", stats.num_running),
            ("waiting_requests", "Requests waiting in the engine.", stats.num_waiting),
            (
                "kv_cache_blocks_used",
                "KV cache blocks in use.",
                stats.num_blocks - stats.num_free_blocks,
            ),
            ("kv_cache_blocks_free", "KV cache blocks free.", stats.num_free_blocks),
            ("kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", stats.kv_usage),
            (
                "prefix_cache_hit_ratio",
                "Prompt tokens found in the prefix cache / tokens looked up, since start.",
                hits / queries if queries else 0.0,
            ),
        ):
            yield gauge(f"tandem_worker_{name}", doc, value, labels)
        for name, doc, value in (
            ("prefix_cache_queried_tokens", "Prompt tokens looked up in the cache.", queries),
            ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", hits),
            ("preemptions", "Requests preempted (recomputed later).", stats.num_preemptions),
        ):
            yield counter(f"tandem_worker_{name}", doc, value, labels)
        yield from self._vllm_families(stats)
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:
            yield from spec_decode_families(spec, labels)
        load = getattr(stats, "expert_load", None)
        if load is not None:
            family = CounterMetricFamily(
                "tandem_worker_moe_expert_tokens",
                "Tokens routed to each expert of each MoE layer (layer: the MoE layers' order).",
                labels=[*labels, "layer", "expert"],
            )
            for layer, row in enumerate(load):
                for expert, value in enumerate(row):
                    family.add_metric([*labels.values(), str(layer), str(expert)], value)
            yield family

    def _vllm_families(self, stats: Any) -> Iterator[Metric]:
        """The engine's queues, KV cache and prefix cache under vLLM's names."""
        labels = dict(zip(VLLM_LABELS, (self.model_name,), strict=True))
        yield gauge("vllm:num_requests_running", "Requests running.", stats.num_running, labels)
        yield gauge("vllm:num_requests_waiting", "Requests waiting.", stats.num_waiting, labels)
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", stats.kv_usage, labels
        )
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found cached.", stats.prefix_cache_hits),
            ("num_preemptions", "Preemptions.", stats.num_preemptions),
        ):
            yield counter(f"vllm:{name}", doc, value, labels)


def spec_decode_families(spec: Any, labels: dict[str, str]) -> Iterator[Metric]:
    """The speculative-decoding counters of an engine's `SpecDecodingStats`."""
    prefix = "tandem_worker_spec_decode"
    for name, doc, value in (
        ("num_drafts", "Request-steps that verified draft tokens.", spec.num_drafts),
        ("num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
    ):
        yield counter(f"{prefix}_{name}", doc, value, labels)
    family = CounterMetricFamily(
        f"{prefix}_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 first).",
        labels=[*labels, "position"],
    )
    for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
        family.add_metric([*labels.values(), str(pos)], value)
    yield family


class MeteredKVTransports(KVTransports):
    """A worker's `KVTransports` that records the bytes and time of every transfer."""

    def __init__(self, transports: KVTransports, metrics: WorkerMetrics) -> None:
        super().__init__(transports.connectors)
        self.metrics = metrics

    async def send_blocks(
        self, request_id: str, src_block_ids: Sequence[int], dst: KVDestination
    ) -> int:
        start = time.perf_counter()
        num_bytes = await super().send_blocks(request_id, src_block_ids, dst)
        if num_bytes:
            elapsed = time.perf_counter() - start
            self.metrics.on_transfer("sent", dst.transport or TCP, num_bytes, elapsed)
        return num_bytes

    async def receive_stream(
        self,
        messages: AsyncIterator[Any],
        reserved_for: Callable[[str], Awaitable[Sequence[int] | None]],
    ) -> Any:
        start = time.perf_counter()
        reply = await super().receive_stream(messages, reserved_for)
        self.metrics.on_transfer("received", TCP, reply.num_bytes, time.perf_counter() - start)
        return reply
