"""Readiness the way clients read it: a frontend started before any worker exists answers
`/v1/models` and the completion endpoints with 503 and Retry-After (raw HTTP and the official
`openai` client), while `/health` says why; once a worker serves, `/v1/models` answers 200 and
the first completion after it is served at once. `tandem bench serve --url` started before the
worker waits for that 200 and then runs its load; given too little time it gives up naming the
last answer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tandem_services.bench.ready import NotReadyError, wait_until_serving
from tandem_services.frontend.health import NOT_READY_RETRY_AFTER_S
from tandem_services.launcher import (
    Deployment,
    ServeConfig,
    spawn_service,
    wait_ready,
    worker_commands,
)

from .conftest import GRACE_S, SCHEDULER_ARGS, wait_until

pytestmark = pytest.mark.timeout(600)

_REQUESTS: tuple[tuple[str, str, dict[str, object] | None], ...] = (
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
)


def test_frontend_answers_503_with_retry_after_until_a_worker_serves(
    tmp_path: Path, tiny_model_path: Callable[[str], Path]
) -> None:
    model = str(tiny_model_path("llama"))
    config = ServeConfig(
        model=model,
        http_port=0,
        grpc_port=0,
        unified=True,
        # The torch attention backend: no C++ kernel build in the worker's start-up.
        worker_args=(
            *("--max-model-len", "256", "--num-gpu-blocks", "32", "--num-threads", "1"),
            *("--attention-backend", "torch"),
        ),
        scheduler_args=SCHEDULER_ARGS,
        grace_period_s=GRACE_S,
        log_dir=str(tmp_path / "logs"),
    )
    workdir = tmp_path / "run"
    workdir.mkdir()
    dep = Deployment(config, {}, workdir)
    deadline = time.monotonic() + 300
    bench: subprocess.Popen[str] | None = None
    try:
        # The scheduler and the frontend start side by side (the frontend keeps trying to
        # reach the scheduler); no worker exists until the refusals are checked.
        with socket.socket() as probe:
            probe.bind((config.host, 0))
            scheduler = f"{config.host}:{probe.getsockname()[1]}"
        dep.services["scheduler"] = spawn_service(
            config,
            "scheduler",
            "tandem_services.scheduler",
            ["--host", config.host, "--port", scheduler.rpartition(":")[2], *SCHEDULER_ARGS],
            workdir,
        )
        dep.services["frontend"] = spawn_service(
            config,
            "frontend",
            "tandem_services.frontend",
            [
                "--host",
                config.host,
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--scheduler",
                scheduler,
                "--model",
                config.model,
            ],
            workdir,
        )
        wait_ready([dep.services["scheduler"], dep.services["frontend"]], deadline)
        base = f"http://{dep.http_address}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with httpx.Client(timeout=30) as http:
            # No worker yet: every API route is 503 with Retry-After; /health says why.
            for method, path, body in _REQUESTS:
                r = http.request(method, base + path, json=body)
                assert r.status_code == 503, (path, r.text)
                assert r.headers["retry-after"] == str(NOT_READY_RETRY_AFTER_S)
                assert "not ready" in r.json()["error"]["message"]
            # The frontend's own tokenizer answers without a worker (vLLM's /tokenize).
            tok = http.post(base + "/tokenize", json={"prompt": "Hello"})
            assert tok.status_code == 200 and tok.json()["count"] > 0, tok.text
            health = http.get(base + "/health")
            assert health.status_code == 503
            assert health.json()["workers"] == {"prefill": 0, "decode": 0, "unified": 0}
            with pytest.raises(openai.APIStatusError) as refused:
                client.models.list()
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"] == str(NOT_READY_RETRY_AFTER_S)
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model=model, prompt="Hello", max_tokens=2)
            assert refused.value.status_code == 503

            # The bench client's readiness wait: too little time -> a clear refusal.
            with pytest.raises(NotReadyError, match=r"did not answer 200 within 0.3 s.*HTTP 503"):
                wait_until_serving(base, 0.3, log=lambda _: None)
            # Started now, it waits for the worker below, then runs its load.
            bench = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tandem.cli", "bench", "serve"),
                    *("--url", base, "--backend", "http", "--model", model),
                    *("--num-prompts", "2", "--input-len", "8", "--output-len", "2"),
                    *("--warmup", "0", "--no-plots", "--name", "bench"),
                    *("--out-dir", str(tmp_path), "--ready-check-timeout-sec", "240"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            assert bench.stdout is not None
            first = ""  # it says it waits before anything is sent
            while "waiting for" not in first and (line := bench.stdout.readline()):
                first += line
            assert "waiting for" in first and "/v1/models" in first, first

            (worker,) = worker_commands(config, dep.scheduler_address)
            dep.services[worker.name] = spawn_service(
                config, worker.name, worker.module, list(worker.args), workdir
            )
            wait_ready([dep.services[worker.name]], deadline)
            # Ready means ready: the first 200 of /v1/models comes with /health 200, and a
            # completion sent right then is served.
            wait_until(
                lambda: http.get(base + "/v1/models").status_code == 200, 60, "/v1/models 200"
            )
            assert http.get(base + "/health").status_code == 200
            bench_out, _ = bench.communicate(timeout=240)
            assert bench.returncode == 0, first + bench_out
            assert "200 after" in bench_out, bench_out
            (run,) = json.loads((tmp_path / "bench.json").read_text())["runs"]
            assert run["summary"]["num_ok"] == 2, run["summary"]
        assert [m.id for m in client.models.list().data] == [model]
        out = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage is not None and 1 <= out.usage.completion_tokens <= 3
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
            bench.wait()
        dep.stop(timeout_s=GRACE_S + 10)
