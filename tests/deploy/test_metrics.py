"""The metrics modules on their own: the /metrics endpoint, scrape-time collectors over
actor state, and how the frontend classifies request outcomes (the live services are
scraped in test_topology.py)."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.core import EngineStats
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, scheduler_pb2
from tandem_services.common.metrics import MetricsServer, start_metrics_server
from tandem_services.frontend.engine import FrontendEngine
from tandem_services.frontend.metrics import FrontendMetrics, MeteredFrontendEngine
from tandem_services.frontend.types import (
    ChoiceDelta,
    FrontendError,
    GenerateInput,
    StepEvent,
    Usage,
)
from tandem_services.scheduler.metrics import SchedulerMetrics
from tandem_services.worker.metrics import WorkerMetrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return samples(registry)[name, tuple(sorted(labels.items()))]


# ----------------------------------------------------------------------------- fakes


def fake_worker_metrics(role: str = "prefill") -> WorkerMetrics:
    metrics = WorkerMetrics(role, model_name="m")
    requests = {
        "a": SimpleNamespace(kind=role, phase="running", num_emitted=0, num_prompt_tokens=100),
        "b": SimpleNamespace(kind=role, phase="running", num_emitted=0, num_prompt_tokens=20),
        # Past its first token: not pending prefill any more.
        "c": SimpleNamespace(kind=role, phase="handing_off", num_emitted=1, num_prompt_tokens=7),
    }
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        num_free_blocks=40,
        num_blocks=100,
        kv_usage=0.6,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
        num_preemptions=1,
        num_held=1,
        num_reserved=0,
        expert_load=((5, 0, 3), (1, 6, 1)),
    )
    metrics.bind(SimpleNamespace(requests=requests), SimpleNamespace(latest_stats=stats))  # type: ignore[arg-type]
    return metrics


def fake_scheduler_metrics() -> SchedulerMetrics:
    def queued(n: int) -> Any:
        request = SimpleNamespace(prompt_token_ids=list(range(n)))
        return SimpleNamespace(submit=SimpleNamespace(request=request))

    def worker(role: int, free: int, draining: bool = False) -> Any:
        return SimpleNamespace(
            info=scheduler_pb2.RegisterWorkerRequest(role=role),
            stats=common_pb2.WorkerStats(num_free_blocks=free, num_blocks=100),
            draining=draining,
        )

    dispatcher = SimpleNamespace(
        queued={"q1": queued(30), "q2": queued(12)},
        inflight={"r1": object()},
        workers={
            "p": worker(common_pb2.WORKER_ROLE_PREFILL, 90),
            "d1": worker(common_pb2.WORKER_ROLE_DECODE, 70),
            "d2": worker(common_pb2.WORKER_ROLE_DECODE, 50, draining=True),
        },
    )
    return SchedulerMetrics(dispatcher)  # type: ignore[arg-type]


def exported_sample_names() -> set[str]:
    """Every family and sample name the three services' metrics objects produce."""
    registries = [
        fake_worker_metrics("prefill").registry,
        fake_scheduler_metrics().registry,
        FrontendMetrics().registry,
    ]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
    return names


# ----------------------------------------------------------------------------- collectors


def test_worker_collector_reads_engine_and_requests() -> None:
    r = fake_worker_metrics("prefill").registry
    role = {"role": "prefill"}
    assert sample(r, "tandem_worker_pending_prefill_tokens", **role) == 120
    assert sample(r, "tandem_worker_inflight_requests", **role) == 3
    assert sample(r, "tandem_worker_running_requests", **role) == 3
    assert sample(r, "tandem_worker_waiting_requests", **role) == 2
    assert sample(r, "tandem_worker_kv_cache_blocks_used", **role) == 60
    assert sample(r, "tandem_worker_kv_cache_blocks_free", **role) == 40
    assert sample(r, "tandem_worker_kv_cache_usage_ratio", **role) == pytest.approx(0.6)
    assert sample(r, "tandem_worker_prefix_cache_hit_ratio", **role) == pytest.approx(0.25)
    assert sample(r, "tandem_worker_prefix_cache_hit_tokens_total", **role) == 50
    assert sample(r, "tandem_worker_prefix_cache_queried_tokens_total", **role) == 200
    assert sample(r, "tandem_worker_preemptions_total", **role) == 1
    # vLLM's names for the same, labelled with the model.
    assert sample(r, "vllm:num_requests_running", model_name="m") == 3
    assert sample(r, "vllm:num_requests_waiting", model_name="m") == 2
    assert sample(r, "vllm:kv_cache_usage_perc", model_name="m") == pytest.approx(0.6)
    assert sample(r, "vllm:prefix_cache_queries_total", model_name="m") == 200
    assert sample(r, "vllm:prefix_cache_hits_total", model_name="m") == 50
    assert sample(r, "vllm:num_preemptions_total", model_name="m") == 1
    moe = "tandem_worker_moe_expert_tokens_total"
    assert sample(r, moe, layer="0", expert="0", **role) == 5
    assert sample(r, moe, layer="1", expert="1", **role) == 6


def test_decode_requests_are_not_pending_prefill() -> None:
    r = fake_worker_metrics("decode").registry
    assert sample(r, "tandem_worker_pending_prefill_tokens", role="decode") == 0


def test_worker_step_and_transfer_counters() -> None:
    metrics = fake_worker_metrics("prefill")
    out = SimpleNamespace(new_token_ids=[1, 2])
    metrics.on_step([out, SimpleNamespace(new_token_ids=[3])])  # type: ignore[list-item]
    metrics.on_transfer("sent", "tcp", 4096, 0.01)
    metrics.on_transfer("sent", "tcp", 1024, 0.02)
    r = metrics.registry
    assert sample(r, "tandem_worker_generated_tokens_total", role="prefill") == 3
    assert sample(r, "tandem_worker_engine_steps_total", role="prefill") == 1
    sent = {"role": "prefill", "direction": "sent", "transport": "tcp"}
    assert sample(r, "tandem_kv_transfer_bytes_total", **sent) == 5120
    assert sample(r, "tandem_kv_transfer_duration_seconds_count", **sent) == 2
    assert sample(r, "tandem_kv_transfer_duration_seconds_sum", **sent) == pytest.approx(0.03)


def test_scheduler_collector_reads_queue_and_workers() -> None:
    r = fake_scheduler_metrics().registry
    assert sample(r, "tandem_scheduler_queued_requests") == 2
    assert sample(r, "tandem_scheduler_queued_prefill_tokens") == 42
    assert sample(r, "tandem_scheduler_inflight_requests") == 1
    assert sample(r, "tandem_scheduler_workers", role="prefill", state="ready") == 1
    assert sample(r, "tandem_scheduler_workers", role="decode", state="ready") == 1
    assert sample(r, "tandem_scheduler_workers", role="decode", state="draining") == 1
    assert sample(r, "tandem_scheduler_kv_cache_blocks", role="decode", state="free") == 120
    assert sample(r, "tandem_scheduler_kv_cache_blocks", role="decode", state="used") == 80


def test_names_follow_conventions() -> None:
    """tandem_ prefix (or vLLM's `vllm:` with its model_name label), snake case, counters
    end in _total, histograms are in seconds."""
    registries = [
        fake_worker_metrics("prefill").registry,
        fake_scheduler_metrics().registry,
        FrontendMetrics(model_name="m").registry,
    ]
    families = [f for r in registries for f in r.collect()]
    assert len(families) > 25
    assert sum(f.name.startswith("vllm:") for f in families) == 12
    for family in families:
        assert re.fullmatch(r"tandem_[a-z0-9_]+|vllm:[a-z0-9_]+", family.name), family.name
        if family.name.startswith("vllm:"):
            assert all(s.labels.get("model_name") == "m" for s in family.samples), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name


# ----------------------------------------------------------------------------- frontend


class _Scripted(FrontendEngine):
    """FrontendEngine whose generate plays a script (no scheduler)."""

    script: list[StepEvent | BaseException]
    closed: bool

    async def generate(self, inp: GenerateInput) -> AsyncIterator[StepEvent]:
        try:
            for item in self.script:
                await asyncio.sleep(0.001)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


class _Metered(MeteredFrontendEngine, _Scripted):
    pass


def metered(script: list[StepEvent | BaseException]) -> _Metered:
    engine = _Metered.__new__(_Metered)
    engine.metrics = FrontendMetrics()
    engine.script = script
    engine.closed = False
    return engine


def token(t: int) -> StepEvent:
    return StepEvent([ChoiceDelta(0, "x", [t])])


FINAL = StepEvent([ChoiceDelta(0, "", [], finish_reason="length")], usage=Usage(5, 3))
INPUT = GenerateInput("r1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))


async def consume(engine: _Metered, stop_after: int | None = None) -> None:
    gen = engine.generate(INPUT)
    n = 0
    try:
        async for _ in gen:
            n += 1
            if stop_after is not None and n >= stop_after:
                break
    finally:
        await gen.aclose()


def test_frontend_success_records_latencies_and_tokens() -> None:
    engine = metered([token(1), token(2), token(3), FINAL])
    asyncio.run(consume(engine))
    r = engine.metrics.registry
    assert sample(r, "tandem_requests_total", outcome="success") == 1
    assert sample(r, "tandem_request_time_to_first_token_seconds_count") == 1
    assert sample(r, "tandem_request_time_per_output_token_seconds_count") == 1
    assert sample(r, "tandem_request_e2e_latency_seconds_count") == 1
    assert sample(r, "tandem_generation_tokens_total") == 3
    assert sample(r, "tandem_prompt_tokens_total") == 5
    assert sample(r, "tandem_requests_running") == 0
    ttft = sample(r, "tandem_request_time_to_first_token_seconds_sum")
    assert 0 < ttft <= sample(r, "tandem_request_e2e_latency_seconds_sum")
    # vLLM's names: the same figures, and the finish reason.
    model = {"model_name": ""}
    assert sample(r, "vllm:request_success_total", finished_reason="length", **model) == 1
    assert sample(r, "vllm:time_to_first_token_seconds_sum", **model) == ttft
    assert sample(r, "vllm:request_time_per_output_token_seconds_count", **model) == 1
    assert sample(r, "vllm:e2e_request_latency_seconds_count", **model) == 1
    assert sample(r, "vllm:generation_tokens_total", **model) == 3
    assert sample(r, "vllm:prompt_tokens_total", **model) == 5


def test_frontend_consumer_that_stops_at_the_final_event_still_succeeded() -> None:
    engine = metered([token(1), FINAL])
    asyncio.run(consume(engine, stop_after=2))
    assert sample(engine.metrics.registry, "tandem_requests_total", outcome="success") == 1


def test_frontend_client_gone_mid_stream_is_cancelled_and_inner_closed() -> None:
    engine = metered([token(1), token(2), token(3), FINAL])
    asyncio.run(consume(engine, stop_after=1))
    r = engine.metrics.registry
    assert sample(r, "tandem_requests_total", outcome="cancelled") == 1
    assert ("tandem_requests_total", (("outcome", "success"),)) not in samples(r)
    assert sample(r, "tandem_request_e2e_latency_seconds_count") == 0
    assert sample(r, "tandem_requests_running") == 0
    assert engine.closed


def test_frontend_error_counts_its_code() -> None:
    engine = metered([token(1), FrontendError(grpc.StatusCode.UNAVAILABLE, "worker lost")])
    with pytest.raises(FrontendError):
        asyncio.run(consume(engine))
    r = engine.metrics.registry
    assert sample(r, "tandem_requests_total", outcome="unavailable") == 1
    assert sample(r, "tandem_request_time_to_first_token_seconds_count") == 0


# ----------------------------------------------------------------------------- endpoint


def test_metrics_server_serves_prometheus_text() -> None:
    metrics = fake_worker_metrics("decode")

    def get(url: str, method: str = "GET") -> tuple[int, str, str]:
        req = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.headers["Content-Type"], resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, "", ""

    async def main() -> None:
        assert await start_metrics_server(metrics.registry, "127.0.0.1", -1) is None
        server = await start_metrics_server(metrics.registry, "127.0.0.1", 0)
        assert isinstance(server, MetricsServer) and server.port > 0
        base = f"http://127.0.0.1:{server.port}"
        status, ctype, body = await asyncio.to_thread(get, base + "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(body)}
        assert families["tandem_worker_kv_cache_blocks_free"].samples[0].value == 40
        assert (await asyncio.to_thread(get, base + "/healthz"))[0] == 200
        assert (await asyncio.to_thread(get, base + "/nope"))[0] == 404
        assert (await asyncio.to_thread(get, base + "/metrics", "POST"))[0] == 405
        # A client that sends garbage and leaves does not hurt the server.
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"\x00\x01garbage")
        writer.close()
        assert (await asyncio.to_thread(get, base + "/metrics"))[0] == 200
        await server.close()

    asyncio.run(main())
