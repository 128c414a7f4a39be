"""The frontend's metrics: what clients see of each request.

    tandem_requests_total{outcome}                 success | cancelled | <gRPC code, lower case>
    tandem_requests_running                        requests streaming now
    tandem_request_time_to_first_token_seconds     generate() called -> first token out
    tandem_request_time_per_output_token_seconds   (last token - first token) / (tokens - 1)
    tandem_request_e2e_latency_seconds             generate() called -> last event
    tandem_prompt_tokens_total, tandem_generation_tokens_total
    tandem_request_migrations_total                choices moved off a lost worker

The same under vLLM's names, with the served model's `model_name` label:
vllm:time_to_first_token_seconds, vllm:request_time_per_output_token_seconds,
vllm:e2e_request_latency_seconds, vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:request_success_total{finished_reason} (stop | length | abort | ...: the last choice's).

Both APIs (gRPC Generate, OpenAI HTTP) go through `FrontendEngine.generate`, so
`MeteredFrontendEngine` measures there, once for both.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem_services.common.metrics import (
    LATENCY_BUCKETS_S,
    TOKEN_LATENCY_BUCKETS_S,
    VLLM_LABELS,
)
from tandem_services.frontend.engine import FrontendEngine
from tandem_services.frontend.tracker import Migration
from tandem_services.frontend.types import FrontendError, GenerateInput, StepEvent


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        self.requests = Counter("tandem_requests", "Requests by outcome.", ["outcome"], registry=r)
        self.running = Gauge("tandem_requests_running", "Requests streaming now.", registry=r)
        self.ttft = Histogram(
            "tandem_request_time_to_first_token_seconds",
            "Time from submission to the first output token.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem_request_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=TOKEN_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_request_e2e_latency_seconds",
            "Time from submission to the last output.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of requests that finished.", registry=r
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Output tokens streamed to clients.", registry=r
        )
        self.migrations = Counter(
            "tandem_request_migrations",
            "Choices continued on another worker after theirs was lost.",
            registry=r,
        )
        # vLLM's names for the same (tandem_services.common.metrics).
        self.vllm_ttft, self.vllm_tpot, self.vllm_e2e = (
            Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=r).labels(model_name)
            for name, doc, buckets in (
                ("vllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS_S),
                (
                    "vllm:request_time_per_output_token_seconds",
                    "Mean time per output token of each request.",
                    TOKEN_LATENCY_BUCKETS_S,
                ),
                ("vllm:e2e_request_latency_seconds", "Request latency.", LATENCY_BUCKETS_S),
            )
        )
        self.vllm_prompt_tokens, self.vllm_generation_tokens = (
            Counter(name, doc, VLLM_LABELS, registry=r).labels(model_name)
            for name, doc in (
                ("vllm:prompt_tokens", "Prompt tokens of finished requests."),
                ("vllm:generation_tokens", "Generated tokens."),
            )
        )
        self.vllm_success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*VLLM_LABELS, "finished_reason"],
            registry=r,
        )

    def generated(self, num_tokens: int) -> None:
        """`num_tokens` more tokens streamed to a client."""
        self.generation_tokens.inc(num_tokens)
        self.vllm_generation_tokens.inc(num_tokens)

    def finish(
        self,
        outcome: str,
        start: float,
        first: float | None,
        last: float | None,
        tokens_per_choice: int,
        num_prompt_tokens: int,
        finished_reason: str | None = None,
    ) -> None:
        """Record one request that left `generate` (`outcome` as in `outcome_of`;
        `finished_reason`: its last choice's finish reason)."""
        self.requests.labels(outcome).inc()
        if outcome != "success":
            return
        end = last if last is not None else time.monotonic()
        self.e2e.observe(end - start)
        self.vllm_e2e.observe(end - start)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.vllm_prompt_tokens.inc(num_prompt_tokens)
        self.vllm_success.labels(self.model_name, finished_reason or "stop").inc()
        if first is not None:
            self.ttft.observe(first - start)
            self.vllm_ttft.observe(first - start)
            if tokens_per_choice > 1:
                tpot = (end - first) / (tokens_per_choice - 1)
                self.tpot.observe(tpot)
                self.vllm_tpot.observe(tpot)


def outcome_of(exc: BaseException | None) -> str:
    """success, cancelled (the client went away), or the gRPC code's name in lower case."""
    if exc is None:
        return "success"
    if isinstance(exc, FrontendError):
        return "cancelled" if exc.code == grpc.StatusCode.CANCELLED else exc.code.name.lower()
    # GeneratorExit / CancelledError: the consumer stopped listening.
    return "internal" if isinstance(exc, Exception) else "cancelled"


class MeteredFrontendEngine(FrontendEngine):
    """`FrontendEngine` that records every request it streams into `metrics`."""

    def __init__(self, *args: Any, metrics: FrontendMetrics, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = metrics

    def _migrate_soon(self, migration: Migration) -> None:
        self.metrics.migrations.inc()
        super()._migrate_soon(migration)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[StepEvent]:
        start = time.monotonic()
        first: float | None = None
        last: float | None = None
        num_tokens = 0
        error: BaseException | None = None
        done = False
        reason: str | None = None
        inner = super().generate(inp)
        self.metrics.running.inc()
        try:
            async for event in inner:
                now = time.monotonic()
                new = sum(len(d.token_ids) for d in event.deltas)
                if new:
                    num_tokens += new
                    self.metrics.generated(new)
                    first = now if first is None else first
                    last = now
                for d in event.deltas:
                    if d.finish_reason is not None:
                        reason = str(d.finish_reason)
                if event.finished:
                    done, last = event.error is None, now
                yield event
        except BaseException as exc:
            # Closed after the final event: that request succeeded.
            error = None if done and isinstance(exc, GeneratorExit) else exc
            raise
        finally:
            await inner.aclose()
            self.metrics.running.dec()
            self.metrics.finish(
                outcome_of(error),
                start,
                first,
                last,
                num_tokens // max(inp.params.n, 1),
                len(inp.prompt_token_ids),
                reason,
            )
