"""Requests survive a lost worker (issue 15): `tandem serve` with 2 prefill + 2 decode workers;
a worker SIGKILLed mid-request, every stream still ends with the offline engine's greedy text
(no token repeated or missing), and the deployment serves a new request within 30 s."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from tests.service.healing import (
    CLUSTER_WORKERS,
    HEAL_PROMPTS,
    LONG_PROMPTS,
    HealReference,
    Serve,
    StreamResult,
    stream_completion,
    streams_flowing,
)

pytestmark = pytest.mark.timeout(600)


def _migrations(serve: Serve) -> int:
    return len(re.findall(r"migrating after \d+ tokens", serve.log("frontend")))


async def _served_within(client: httpx.AsyncClient, serve: Serve, seconds: float) -> float:
    """Send a small request; assert it is answered 200 within `seconds`; return the time."""
    t0 = time.monotonic()
    r = await client.post(
        f"http://{serve.http}/v1/completions",
        json={"model": "default", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        timeout=seconds,
    )
    took = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert took < seconds
    return took


def test_decode_worker_killed_mid_stream(
    healing_cluster: Serve, heal_reference: HealReference
) -> None:
    """8 streams in flight, decode-0 SIGKILLed once each has tokens: all 8 end with the
    offline engine's text; a new request is served within 30 s; decode-0 comes back."""
    serve = healing_cluster
    serve.wait_registered(CLUSTER_WORKERS, 300)
    before = _migrations(serve)
    mark = len(serve.lines)

    async def run() -> tuple[list[StreamResult], float]:
        """The streams' results and how long after the kill a new request was answered."""
        async with httpx.AsyncClient() as client:
            results, tasks = await streams_flowing(client, serve.http, HEAL_PROMPTS)
            serve.kill_worker("decode-0")
            new = await _served_within(client, serve, 30)
            await asyncio.gather(*tasks)
            return results, new

    results, new_request_s = asyncio.run(run())
    print(f"decode-0 killed: a new request answered {new_request_s:.1f} s later")
    for prompt, r in zip(HEAL_PROMPTS, results, strict=True):
        assert r.ok, r
        assert r.text == heal_reference.texts[prompt], (r, heal_reference.texts[prompt])
    assert _migrations(serve) > before, serve.log("frontend")[-3000:]
    serve.wait_output(r"decode: restarted, serving at", 240, start=mark)
    serve.wait_registered(CLUSTER_WORKERS, 60)
    serve.wait_idle_and_whole()


def test_prefill_worker_killed_mid_prefill(
    healing_cluster: Serve, long_reference: HealReference
) -> None:
    """Long prompts; the first prefill worker seen computing them is SIGKILLed while some have
    no token out yet: each is prefilled elsewhere and ends with the offline engine's text."""
    serve = healing_cluster
    serve.wait_registered(CLUSTER_WORKERS, 300)
    before = _migrations(serve)
    prefill = {w.worker_id for w in serve.workers().workers if w.worker_id.startswith("prefill")}

    async def run() -> list[StreamResult]:
        results = [StreamResult(i) for i in range(len(LONG_PROMPTS))]
        async with httpx.AsyncClient() as client:
            tasks = [
                asyncio.create_task(stream_completion(client, serve.http, p, r))
                for p, r in zip(LONG_PROMPTS, results, strict=True)
            ]
            deadline = time.monotonic() + 60
            victim = ""
            while not victim:
                # The scheduler's view (the workers' load reports, each the latest snapshot):
                # a worker's own Stats waits for its engine's step, seconds on a busy CPU.
                listed = await asyncio.to_thread(serve.workers)
                for w in listed.workers:
                    if w.worker_id in prefill and w.stats.num_inflight:
                        victim = w.worker_id
                        break
                assert time.monotonic() < deadline, "no prefill worker got a prompt"
                await asyncio.sleep(0.01)
            assert any(r.num_chunks == 0 for r in results), results  # still prefilling
            serve.kill_worker(victim)
            await _served_within(client, serve, 30)
            await asyncio.gather(*tasks)
            return results

    results = asyncio.run(run())
    for prompt, r in zip(LONG_PROMPTS, results, strict=True):
        assert r.ok, r
        assert r.text == long_reference.texts[prompt], (r, long_reference.texts[prompt])
    assert _migrations(serve) > before or "dispatching it again" in serve.log("scheduler")
    serve.wait_registered(CLUSTER_WORKERS, 240)
    serve.wait_idle_and_whole()
