"""The workload scripts/compose_e2e.sh runs through a `compose up` CPU deployment.

    python -m tests.deploy.compose_e2e_workload --engine podman --project tandem-e2e \\
        --http 127.0.0.1:18000 --started-at <epoch s of `compose up`>

Every check talks to the deployment the way a user does (the official openai client on the
frontend's published port, 127.0.0.1 only) or looks inside a container through the engine
(`<engine> exec` / `kill`); every wait is bounded. Steps, each one failing the run:

1. ready: the frontend answers GET /v1/models, the scheduler's /metrics lists every prefill
   and decode replica as ready, and a completion comes back (time to first answer reported).
2. parity: greedy completions equal the offline engine's (tandem.LLM, same prompts, same
   default model) text for text, and usage counts their tokens.
3. streaming: streamed deltas (completions and chat) concatenate to the full answer.
4. prefix routing: prompts sharing a long prefix all land on the prefill replica that cached
   it (its prefix-cache hit tokens grow, the other replica's do not), and the containerised
   Redis holds the directory's keys.
5. a worker lost: one decode container is killed (SIGKILL); every request after it is still
   answered, with the same greedy text.

Prints one `compose_e2e: <step> ok ...` line per step and a final JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import openai

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
# ~300 tokens, many 16-token blocks: a prefix a prefill worker caches and the directory names.
LONG_PREFIX = (
    "You are a careful assistant. Answer in one short sentence. Here is the context. "
    + " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))
    + " Question: "
)
SUFFIXES = ["what is 3 squared?", "what is 7 squared?", "what is 11 squared?", "what is 2?"]
METRICS_PORT = 9400

T = TypeVar("T")


class CheckFailed(AssertionError):
    """One step of the workload did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def say(step: str, detail: str = "") -> None:
    print(f"compose_e2e: {step} ok {detail}".rstrip(), flush=True)


@dataclass(frozen=True)
class Containers:
    """The compose project's containers, reached through the container engine's CLI."""

    engine: str
    project: str

    def _run(self, *args: str, timeout_s: float = 60.0) -> str:
        proc = subprocess.run(
            [self.engine, *args], capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            raise CheckFailed(f"{self.engine} {' '.join(args)}: {proc.stderr.strip()[-500:]}")
        return proc.stdout

    def names(self, service: str) -> list[str]:
        """Running containers of `service`, sorted by name."""
        out = self._run(
            "ps",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
            "--format",
            "{{.Names}}",
        )
        return sorted(line.strip() for line in out.splitlines() if line.strip())

    def exec(self, container: str, *argv: str, timeout_s: float = 60.0) -> str:
        return self._run("exec", container, *argv, timeout_s=timeout_s)

    def metrics(self, container: str) -> str:
        """The container's Prometheus page, fetched from inside it (127.0.0.1)."""
        code = (
            "import urllib.request;"
            f"print(urllib.request.urlopen('http://127.0.0.1:{METRICS_PORT}/metrics',"
            " timeout=10).read().decode())"
        )
        return self.exec(container, "python", "-c", code)

    def kill(self, container: str) -> None:
        self._run("kill", "--signal", "KILL", container)


def metric(page: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on a Prometheus text page whose labels include `labels`."""
    total = 0.0
    for line in page.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(?P<labels>[^}}]*)\}})? (?P<value>\S+)$", line)
        if not m:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels") or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group("value"))
    return total


def poll(what: str, deadline: float, attempt: Callable[[], T | None], every_s: float = 1.0) -> T:
    """`attempt()` until it returns a value (exceptions count as not yet) or the deadline."""
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = attempt()
            if value is not None:
                return value
        except Exception as exc:  # not up yet: connection refused, 503, ...
            last = exc
        time.sleep(every_s)
    raise CheckFailed(f"timed out waiting for {what} (last error: {last!r})")


def offline_reference() -> tuple[list[str], list[int], str]:
    """The offline engine's greedy texts (and token counts) for PROMPTS, and for CHAT."""
    from tandem import LLM, SamplingParams

    llm = LLM(
        model="default", dtype="float32", max_model_len=2048, num_gpu_blocks=256, num_threads=1
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    chat = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    texts = [o.outputs[0].text for o in outs]
    counts = [len(o.outputs[0].token_ids) for o in outs]
    del llm
    return texts, counts, chat.text


def wait_ready(
    client: openai.OpenAI, http: str, containers: Containers, replicas: int, deadline: float
) -> float:
    """Block until the deployment answers a completion; the wall-clock time it did."""

    def models() -> bool | None:
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=5) as reply:
            return True if reply.status == 200 else None

    poll("the frontend's /v1/models", deadline, models)

    def workers_ready() -> bool | None:
        (scheduler,) = containers.names("scheduler")
        page = containers.metrics(scheduler)
        ready = {
            role: metric(page, "tandem_scheduler_workers", role=role, state="ready")
            for role in ("prefill", "decode")
        }
        return True if all(v >= replicas for v in ready.values()) else None

    poll(f"{replicas} ready prefill and decode workers", deadline, workers_ready, every_s=2.0)

    def answer() -> str | None:
        out = client.completions.create(
            model="default", prompt=PROMPTS[0], max_tokens=2, temperature=0
        )
        return out.choices[0].text

    poll("a first completion", deadline, answer)
    return time.time()


def check_parity(client: openai.OpenAI, texts: list[str], counts: list[int]) -> None:
    batch = client.completions.create(
        model="default", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    got = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    check(got == texts, f"greedy texts differ from the offline engine: {got!r} != {texts!r}")
    check(
        batch.usage is not None and batch.usage.completion_tokens == sum(counts),
        f"usage {batch.usage!r} does not count {sum(counts)} tokens",
    )


def check_streaming(client: openai.OpenAI, texts: list[str], chat_text: str) -> int:
    stream = client.completions.create(
        model="default", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    check("".join(chunks) == texts[1], f"streamed {chunks!r} != {texts[1]!r}")
    check(sum(1 for c in chunks if c) > 1, f"one chunk only: {chunks!r}")
    chat = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    check(text == chat_text, f"streamed chat {text!r} != offline {chat_text!r}")
    return len(chunks)


def check_prefix_routing(client: openai.OpenAI, containers: Containers) -> dict[str, float]:
    prefills = containers.names("prefill")
    check(len(prefills) >= 2, f"prefill replicas: {prefills}")

    def hits() -> dict[str, tuple[float, float]]:
        out = {}
        for name in prefills:
            page = containers.metrics(name)
            out[name] = (
                metric(page, "tandem_worker_prefix_cache_queried_tokens_total"),
                metric(page, "tandem_worker_prefix_cache_hit_tokens_total"),
            )
        return out

    before = hits()
    client.completions.create(
        model="default", prompt=LONG_PREFIX + SUFFIXES[0], max_tokens=2, temperature=0
    )
    after_first = hits()
    owners = [n for n in prefills if after_first[n][0] > before[n][0]]
    check(len(owners) == 1, f"the first long prompt ran on {owners} (queries {after_first})")
    (owner,) = owners
    # Let the prefill worker publish its block hashes to the directory.
    time.sleep(1.0)
    for suffix in SUFFIXES[1:]:
        client.completions.create(
            model="default", prompt=LONG_PREFIX + suffix, max_tokens=2, temperature=0
        )
    after = hits()
    gained = {n: after[n][1] - after_first[n][1] for n in prefills}
    others = {n: g for n, g in gained.items() if n != owner}
    # Each repeat reuses at least a few hundred prefix tokens on the owner, none elsewhere.
    check(
        gained[owner] >= 100 * (len(SUFFIXES) - 1) and not any(others.values()),
        f"prefix hits by replica {gained} (owner {owner})",
    )
    (redis,) = containers.names("redis")
    keys = int(containers.exec(redis, "redis-cli", "dbsize").strip() or 0)
    check(keys > 0, "the containerised Redis holds no directory keys")
    return {"prefix_hit_tokens_owner": gained[owner], "redis_keys": float(keys)}


def check_worker_lost(client: openai.OpenAI, containers: Containers, texts: list[str]) -> str:
    decodes = containers.names("decode")
    check(len(decodes) >= 2, f"decode replicas: {decodes}")
    victim = decodes[0]
    containers.kill(victim)
    for round_ in range(3):
        for i, prompt in enumerate(PROMPTS):
            out = client.completions.create(
                model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            check(
                out.choices[0].text == texts[i],
                f"after killing {victim}, round {round_}: {out.choices[0].text!r} != {texts[i]!r}",
            )
    return victim


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="podman or docker")
    parser.add_argument("--project", required=True, help="the compose project name")
    parser.add_argument("--http", required=True, help="the frontend's published HOST:PORT")
    parser.add_argument("--replicas", type=int, default=2, help="prefill and decode replicas")
    parser.add_argument("--started-at", type=float, default=time.time(), help="epoch s of up")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    check(args.http.startswith("127.0.0.1:"), "the frontend must be reached on 127.0.0.1")
    containers = Containers(args.engine, args.project)
    # The offline reference first: it runs while the containers start.
    texts, counts, chat_text = offline_reference()
    say("offline reference", f"({len(texts)} prompts)")
    client = openai.OpenAI(
        base_url=f"http://{args.http}/v1", api_key="unused", max_retries=0, timeout=120.0
    )
    since_up = time.time() - args.started_at
    ready_at = wait_ready(
        client,
        args.http,
        containers,
        args.replicas,
        time.monotonic() + max(60.0, args.ready_timeout_s - since_up),
    )
    first_answer_s = ready_at - args.started_at
    say("ready", f"(first answer {first_answer_s:.1f} s after compose up)")
    check_parity(client, texts, counts)
    say("greedy parity with the offline engine")
    chunks = check_streaming(client, texts, chat_text)
    say("streaming", f"({chunks} chunks)")
    routing = check_prefix_routing(client, containers)
    say("prefix-aware routing through Redis", json.dumps(routing))
    victim = check_worker_lost(client, containers, texts)
    say("worker lost", f"({victim} killed, {3 * len(PROMPTS)} requests answered after)")
    print(json.dumps({"first_answer_s": round(first_answer_s, 1), **routing}), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckFailed as exc:
        print(f"compose_e2e: FAILED: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except urllib.error.URLError as exc:
        print(f"compose_e2e: FAILED: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
