"""KV-aware routing across two prefill workers, with a real Redis directory.

One deployment for the module (scheduler, two prefill workers, a decode worker, frontend;
the embedded model, one torch thread per worker) on a private redis-server that the outage
test stops and starts again. The scheduler's dispatch record is off (`--prefix-hint-ttl-s 0`)
so every routing decision here rests on what the workers published to the directory.

Which worker served a request: the prefill workers' prefix-cache counters (the one whose
looked-up tokens grew by the prompt's length), cross-checked with the directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem.core.kv_cache_utils import compute_block_hashes
from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.directory import DirectoryConfig
from tandem_services.directory.redis_directory import RedisDirectory
from tandem_services.launcher import Deployment, ServeConfig, start_deployment, stop_process
from tests.redis_server import RedisServer
from tests.service.conftest import list_workers, wait_until, worker_stats

BLOCK_SIZE = 16
PREFILL = ("prefill", "prefill-1")
KEY_PREFIX = "tandem-routing-test:"
# Short enough that a worker notices a restarted, empty Redis quickly (heartbeat: ttl / 3).
DIRECTORY_TTL_S = 6.0
WORKER_ARGS = (
    "--max-model-len", "512",
    "--num-gpu-blocks", "128",
    "--num-threads", "1",
    "--directory-publish-delay-s", "0.02",
)  # fmt: skip
SCHEDULER_ARGS = (
    "--dead-after-s", "5",
    "--report-interval-s", "0.2",
    "--metrics-port", "0",
)  # fmt: skip

_rng = random.Random(1234)


def make_prefix(num_blocks: int = 3) -> list[int]:
    return [_rng.randrange(1000, 40000) for _ in range(num_blocks * BLOCK_SIZE)]


def with_question(prefix: list[int], length: int = 6) -> list[int]:
    return prefix + [_rng.randrange(1000, 40000) for _ in range(length)]


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


def two_prefill_config(
    log_dir: Path, scheduler_args: tuple[str, ...] = SCHEDULER_ARGS, **kwargs: Any
) -> ServeConfig:
    """Two prefill workers and a decode worker with WORKER_ARGS, every port free; `kwargs`:
    more ServeConfig fields."""
    return ServeConfig(
        http_port=0,
        grpc_port=0,
        num_prefill_workers=2,
        worker_args=WORKER_ARGS,
        scheduler_args=scheduler_args,
        grace_period_s=5.0,
        log_dir=str(log_dir),
        startup_timeout_s=300.0,
        **kwargs,
    )


@pytest.fixture(scope="module")
def cluster(redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    config = two_prefill_config(
        tmp_path_factory.mktemp("logs-prefix-routing"),
        # The directory alone: the scheduler's own dispatch record is off.
        scheduler_args=(*SCHEDULER_ARGS, "--prefix-hint-ttl-s", "0"),
        directory=DirectoryConfig(
            redis_url=redis.url, key_prefix=KEY_PREFIX, worker_ttl_s=DIRECTORY_TTL_S
        ),
        routing="prefix",
    )
    dep = start_deployment(config)
    try:
        yield dep
    finally:
        codes = dep.stop(timeout_s=20)
        for name, code in codes.items():
            if code not in (0, -signal.SIGKILL):  # the last test kills a worker
                print(f"---- {name} log (exit {code}) ----\n{dep.services[name].log_tail(60)}")


# ----------------------------------------------------------------------------- helpers


def generate(dep: Deployment, tokens: list[int]) -> frontend_pb2.Usage:
    """One request through the frontend (2 greedy tokens); its usage."""
    request = frontend_pb2.GenerateRequest(
        token_ids=frontend_pb2.TokenIds(ids=tokens),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    )
    with grpc.insecure_channel(dep.grpc_address) as channel:
        responses = list(frontend_pb2_grpc.FrontendStub(channel).Generate(request, timeout=120))
    assert sum(len(c.token_ids) for r in responses for c in r.choices) == 2
    return responses[-1].usage


def counters(dep: Deployment) -> dict[str, tuple[int, int]]:
    """Per prefill worker, prompt tokens looked up in its prefix cache so far and found."""
    out = {}
    for n in PREFILL:
        s = worker_stats(dep.address(n))
        out[n] = (s.prefix_cache_queries, s.prefix_cache_hits)
    return out


def idle(dep: Deployment) -> bool:
    workers = list_workers(dep)
    return workers.num_inflight == 0 and all(
        w.stats.num_running == 0 and w.stats.num_waiting == 0 for w in workers.workers
    )


def worker_id(name: str) -> str:
    return "prefill-0" if name == "prefill" else name


def served_by(dep: Deployment, tokens: list[int]) -> tuple[str, int]:
    """Send one request alone; (the prefill worker that ran it, prompt tokens it found
    cached). The usage's cached_tokens would not do: the decode worker caches too.

    Sent once the scheduler sees the workers idle, so that the choice rests on the cache
    alone (these prompts are short: a just-finished request's load could outweigh it)."""
    wait_until(lambda: idle(dep), 10, "the scheduler to see idle workers")
    before = counters(dep)
    generate(dep, tokens)
    wait_until(lambda: counters(dep) != before, 10, "the prefill worker's counters")
    after = counters(dep)
    grew = [n for n in PREFILL if after[n][0] > before[n][0]]
    assert len(grew) == 1, (before, after)
    name = grew[0]
    assert after[name][0] - before[name][0] == len(tokens)
    return worker_id(name), after[name][1] - before[name][1]


def holders(redis: RedisServer, tokens: list[int]) -> dict[str, int]:
    """What the directory says: worker -> leading blocks of `tokens` it holds."""

    async def ask() -> dict[str, int]:
        directory = RedisDirectory(redis.url, key_prefix=KEY_PREFIX)
        try:
            return await directory.longest_prefix(compute_block_hashes(tokens, BLOCK_SIZE))
        finally:
            await directory.close()

    return asyncio.run(ask())


def worker_hashes(redis: RedisServer, worker: str) -> set[bytes]:
    async def ask() -> set[bytes]:
        directory = RedisDirectory(redis.url, key_prefix=KEY_PREFIX)
        try:
            return set(await directory._client.smembers(directory.worker_key(worker)))
        finally:
            await directory.close()

    return asyncio.run(ask())


def scheduler_metrics(dep: Deployment) -> dict[str, float]:
    url = f"http://{dep.services['scheduler'].info['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tandem_scheduler_prefix_") or line.startswith(
            "tandem_scheduler_routing_info"
        ):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def land_apart(dep: Deployment, redis: RedisServer) -> dict[str, list[int]]:
    """Two new prefixes sent together: the scheduler spreads them by load (the first one is
    queued on its worker when the second is routed). Returns worker -> prefix it now holds,
    once the directory says so."""
    a, b = make_prefix(), make_prefix()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: generate(dep, with_question(p)), (a, b)))
    full = len(a) // BLOCK_SIZE
    wait_until(
        lambda: (
            sorted(holders(redis, a).values()) == [full]
            and sorted(holders(redis, b).values()) == [full]
        ),
        15,
        "both prefixes published by one worker each",
    )
    ha, hb = next(iter(holders(redis, a))), next(iter(holders(redis, b)))
    assert {ha, hb} == {"prefill-0", "prefill-1"}, "the two new prefixes landed on one worker"
    return {ha: a, hb: b}


# ----------------------------------------------------------------------------- tests


def test_hashes_equal_in_scheduler_code_and_worker_process(
    cluster: Deployment, redis: RedisServer
) -> None:
    prompt = [*make_prefix(4), 7, 8, 9]
    served, _ = served_by(cluster, prompt)
    # The scheduler's hashing, in a fresh interpreter with another hash seed.
    code = (
        "import json, sys; from tandem_services.scheduler.routing import prompt_block_hashes; "
        "t = json.load(sys.stdin); print(json.dumps([h.hex() for h in "
        f"prompt_block_hashes(t, {BLOCK_SIZE}, None)]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="4242")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(prompt),
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    scheduler_chain = [bytes.fromhex(h) for h in json.loads(out.stdout)]
    assert len(scheduler_chain) == 4
    wait_until(
        lambda: set(scheduler_chain) <= worker_hashes(redis, served),
        10,
        "the worker's published hashes",
    )
    assert holders(redis, prompt) == {served: 4}


def test_requests_sharing_a_prefix_go_to_the_worker_that_holds_it(
    cluster: Deployment, redis: RedisServer
) -> None:
    held = land_apart(cluster, redis)
    before = scheduler_metrics(cluster)
    for _ in range(3):
        for worker, prefix in held.items():  # interleaved: the two prefixes alternate
            served, cached = served_by(cluster, with_question(prefix))
            assert served == worker
            assert cached == len(prefix)
    after = scheduler_metrics(cluster)
    assert (
        after["tandem_scheduler_prefix_routed_to_cache_requests_total"]
        - before["tandem_scheduler_prefix_routed_to_cache_requests_total"]
        == 6
    )
    assert (
        after["tandem_scheduler_prefix_directory_fallbacks_total"]
        == before["tandem_scheduler_prefix_directory_fallbacks_total"]
    )


def test_redis_outage_never_fails_a_request_and_routing_recovers(
    cluster: Deployment, redis: RedisServer
) -> None:
    held = land_apart(cluster, redis)
    redis.stop()
    try:
        prompts = [with_question(p) for p in held.values() for _ in range(3)]
        prompts += [with_question(make_prefix()) for _ in range(2)]
        with ThreadPoolExecutor(4) as pool:
            usages = list(pool.map(lambda t: generate(cluster, t), prompts))
        assert len(usages) == len(prompts)  # every one succeeded (generate asserts tokens)
        during = scheduler_metrics(cluster)
        assert during["tandem_scheduler_prefix_directory_fallbacks_total"] >= 1
        assert during["tandem_scheduler_prefix_directory_up"] == 0.0
    finally:
        redis.start()  # same port, empty
    # The workers republish what they hold (a failed publish, or a heartbeat, tells them).
    wait_until(
        lambda: all(w in holders(redis, p) for w, p in held.items()),
        20,
        "each worker's entries back in the directory",
    )
    # Routing uses it again: new prefixes, landed apart, followed to their holders.
    again = land_apart(cluster, redis)
    answers = scheduler_metrics(cluster)["tandem_scheduler_prefix_directory_answers_total"]
    for worker, prefix in again.items():
        served, cached = served_by(cluster, with_question(prefix))
        assert (served, cached) == (worker, len(prefix))
    after = scheduler_metrics(cluster)
    assert after["tandem_scheduler_prefix_directory_answers_total"] >= answers + 2
    assert after["tandem_scheduler_prefix_directory_up"] == 1.0


def test_workers_leaving_take_their_entries_with_them(
    cluster: Deployment, redis: RedisServer
) -> None:
    held = land_apart(cluster, redis)
    assert set(held) == {"prefill-0", "prefill-1"}
    # Drained (SIGTERM): the worker removes its entries itself; the other one's stay.
    assert stop_process(cluster.services["prefill-1"].process, 30) == 0
    assert worker_hashes(redis, "prefill-1") == set()
    assert "prefill-0" in holders(redis, held["prefill-0"])
    # Killed: the scheduler drops it when its report stream ends, and removes its entries
    # (they would otherwise expire DIRECTORY_TTL_S after its last heartbeat).
    process = cluster.services["prefill"].process
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    # Within 3 s: sooner than expiry could (at least DIRECTORY_TTL_S - ttl / 3 = 4 s).
    wait_until(lambda: not worker_hashes(redis, "prefill-0"), 3, "the killed worker's entries")
