"""Admission without workers (no model loads): a full queue answers RESOURCE_EXHAUSTED, a
queued request nobody takes fails with UNAVAILABLE, and the API key is enforced before
anything else. The HTTP API is not ready without workers: it answers 503 with Retry-After at
once (after the key check) instead of queueing; gRPC Generate queues at the scheduler."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment, ServeConfig, Service, spawn_service, wait_ready

pytestmark = pytest.mark.timeout(300)

API_KEY = "s3cret"
QUEUE_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def no_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("admission")
    config = ServeConfig(log_dir=str(tmp), grace_period_s=2.0)
    services: dict[str, Service] = {}
    dep = Deployment(config, services, Path(tmp))
    try:
        services["scheduler"] = spawn_service(
            config,
            "scheduler",
            "tandem_services.scheduler",
            ["--port", "0", "--max-queue-len", "1", "--queue-timeout-s", str(QUEUE_TIMEOUT_S)],
            Path(tmp),
        )
        wait_ready([services["scheduler"]], time.monotonic() + 120)
        services["frontend"] = spawn_service(
            config,
            "frontend",
            "tandem_services.frontend",
            [
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--api-key",
                API_KEY,
                "--scheduler",
                services["scheduler"].info["grpc"],
                "--grace-period-s",
                "2",
            ],
            Path(tmp),
        )
        wait_ready([services["frontend"]], time.monotonic() + 120)
        yield dep
    finally:
        for s in services.values():
            if s.process.poll() is None:
                s.process.send_signal(signal.SIGTERM)
        for s in services.values():
            s.process.wait(timeout=20)


def _body() -> dict[str, object]:
    return {"model": "default", "prompt": "Hello", "max_tokens": 4}


def test_api_key_required(no_workers: Deployment) -> None:
    url = f"http://{no_workers.http_address}/v1"
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{url}/models").status_code == 401
        r = http.get(f"{url}/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = http.get(f"{url}/models", headers={"Authorization": f"Bearer {API_KEY}"})
        # The key passes; no worker can serve yet, so the API says it is not ready.
        assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1

    async def run() -> None:
        async with grpc.aio.insecure_channel(no_workers.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(frontend_pb2.ListModelsRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(
                    frontend_pb2.ListModelsRequest(), metadata=(("authorization", "Bearer wrong"),)
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await stub.ListModels(
                frontend_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {API_KEY}"),)
            )

    asyncio.run(run())


def test_full_queue_429_then_queued_request_times_out_503(no_workers: Deployment) -> None:
    url = f"http://{no_workers.http_address}/v1/completions"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    auth = (("authorization", f"Bearer {API_KEY}"),)
    request = frontend_pb2.GenerateRequest(
        text="Hello", sampling_params=common_pb2.SamplingParams(max_tokens=4)
    )

    async def generate(stub: frontend_pb2_grpc.FrontendStub) -> None:
        async for _ in stub.Generate(request, metadata=auth):
            pass

    async def run() -> None:
        async with (
            httpx.AsyncClient(timeout=60) as http,
            grpc.aio.insecure_channel(no_workers.grpc_address) as channel,
        ):
            stub = frontend_pb2_grpc.FrontendStub(channel)
            # No worker: the first request waits in the queue (length 1) ...
            first = asyncio.create_task(generate(stub))
            await asyncio.sleep(1.0)
            assert not first.done()
            # ... so the next one is refused at once, with a retry hint: the queued request's
            # age in whole seconds, at least 1.
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full" in (info.value.details() or "")
            assert time.monotonic() - t0 < 5
            hint = dict(info.value.trailing_metadata() or ())["retry-after"]
            assert 1 <= int(hint) <= 30
            # HTTP is not ready without workers: 503 with Retry-After at once, nothing queued.
            t0 = time.monotonic()
            r = await http.post(url, json=_body(), headers=headers)
            assert r.status_code == 503, r.text
            assert "not ready" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1 and time.monotonic() - t0 < 5
            # The queued one fails with UNAVAILABLE once the queue timeout passes: no hang.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await first
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no worker" in (info.value.details() or "")

    asyncio.run(run())
