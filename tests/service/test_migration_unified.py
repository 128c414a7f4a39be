"""Requests survive a lost unified worker (issue 15): `tandem serve --unified` with two unified
workers; one SIGKILLed once every stream has tokens out: each stream goes on on the other
worker (the frontend submits prompt + the tokens sent, as a new engine request) and ends with
the offline engine's greedy text, no token repeated or missing; a new request is served within
30 s; the killed worker comes back and the pools are whole."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.service.healing import (
    HEAL_ARGS,
    HEAL_PROMPTS,
    HealReference,
    Serve,
    StreamResult,
    streams_flowing,
    tandem_serve,
)

pytestmark = pytest.mark.timeout(600)

WORKERS = {"unified-0", "unified-1"}


@pytest.fixture(scope="module")
def unified_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    args = [
        "--unified",
        "--num-unified-workers",
        "2",
        "--max-worker-restarts",
        "10",
        "--restart-backoff-s",
        "0.5",
        *HEAL_ARGS,
    ]
    with tandem_serve(args, tmp_path_factory.mktemp("logs-unified-pair")) as serve:
        yield serve
        assert "Traceback" not in serve.output, serve.output


def test_unified_worker_killed_mid_stream(
    unified_pair: Serve, heal_reference: HealReference
) -> None:
    serve = unified_pair
    serve.wait_registered(WORKERS, 300)
    mark = len(serve.lines)

    async def run() -> tuple[list[StreamResult], str]:
        async with httpx.AsyncClient() as client:
            results, tasks = await streams_flowing(client, serve.http, HEAL_PROMPTS)
            # The worker with the most requests running (both may have some).
            listed = await asyncio.to_thread(serve.workers)
            victim = max(listed.workers, key=lambda w: w.stats.num_inflight).worker_id
            serve.kill_worker(victim)
            r = await client.post(
                f"http://{serve.http}/v1/completions",
                json={"model": "default", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
                timeout=30,
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
            await asyncio.gather(*tasks)
            return results, victim

    results, victim = asyncio.run(run())
    for prompt, r in zip(HEAL_PROMPTS, results, strict=True):
        assert r.ok, r
        assert r.text == heal_reference.texts[prompt], (r, heal_reference.texts[prompt])
    migrated = re.findall(r"migrating after (\d+) tokens", serve.log("frontend"))
    assert migrated and all(int(n) >= 2 for n in migrated), serve.log("frontend")[-3000:]
    serve.wait_output(r"unified(-1)?: restarted, serving at", 240, start=mark)
    serve.wait_registered(WORKERS, 60)
    serve.wait_idle_and_whole()
    print(f"{victim} killed: {len(migrated)} streams migrated")
