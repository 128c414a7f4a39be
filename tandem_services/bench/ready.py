"""Waiting, before a load starts, until the frontend can serve it.

The frontend's `/v1/models` answers 503 with Retry-After until a worker serves (the frontend's
health.py), and clients of vLLM poll it as the readiness signal; so does `tandem bench serve`
given `--url` of a running server: it polls `GET /v1/models` until the answer is 200, sleeping
what Retry-After asks (capped) between tries and retrying refused connections, and gives up
after `--ready-check-timeout-sec` (vLLM's flag) with a message naming the URL and the last
answer; a 401/403 (a wrong API key) ends the wait at once, a 404 (a server without
`/v1/models`, e.g. bench's own stream server) is not waited on. Nothing is timed before it
returns.

With `--backend grpc` the frontend's HTTP address is `--ready-url`: without it only the gRPC
channel is awaited (a gRPC `Generate` is queued by the scheduler, not refused, until a worker
serves; the warm-up requests wait there, outside the timing).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

# Never sleep longer than this between tries, whatever Retry-After says.
MAX_POLL_S = 5.0
DEFAULT_POLL_S = 0.5


class NotReadyError(RuntimeError):
    """The frontend did not answer `/v1/models` with 200 within the timeout."""


def http_base(address: str) -> str:
    """`host:port` or `http://host:port[/]` -> `http://host:port`."""
    address = address.strip().rstrip("/")
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


def _retry_after_s(value: str | None) -> float:
    try:
        return min(max(float(value or DEFAULT_POLL_S), 0.05), MAX_POLL_S)
    except ValueError:  # an HTTP date: not what the frontend sends
        return DEFAULT_POLL_S


def wait_until_serving(
    url: str,
    timeout_s: float,
    api_key: str = "",
    log: Callable[[str], None] = print,
) -> float:
    """Poll `GET <url>/v1/models` until it answers 200; return the seconds waited.

    Raises NotReadyError after `timeout_s` (the message names the URL, the time waited and the
    last status and body, or the last connection error). Says once, through `log`, that it is
    waiting, and when the frontend became ready if it had to wait.
    """
    target = f"{http_base(url)}/v1/models"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last = "no answer yet"
    told = False
    while True:
        pause = DEFAULT_POLL_S
        try:
            request = urllib.request.Request(target, headers=headers)
            with urllib.request.urlopen(request, timeout=max(1.0, min(10.0, timeout_s))) as r:
                if r.status == 200:
                    waited = time.monotonic() - t0
                    if told:
                        log(f"{target}: 200 after {waited:.1f} s; starting the load")
                    return waited
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as exc:
            body = exc.read()[:200].decode("utf-8", "replace")
            last = f"HTTP {exc.code}: {body}"
            if exc.code == 404:  # not an OpenAI server's /v1/models: nothing to wait for
                log(f"{target} answered 404: readiness not awaited")
                return time.monotonic() - t0
            if exc.code in (401, 403):  # waiting will not change these
                raise NotReadyError(f"{target} answered {last}") from None
            pause = _retry_after_s(exc.headers.get("retry-after"))
        except (urllib.error.URLError, OSError) as exc:
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        now = time.monotonic()
        if now >= deadline:
            raise NotReadyError(
                f"{target} did not answer 200 within {timeout_s:g} s "
                f"(--ready-check-timeout-sec); last answer: {last}"
            )
        if not told:
            log(f"waiting for {target} to answer 200 (now: {last}), up to {timeout_s:g} s")
            told = True
        time.sleep(min(pause, deadline - now))
