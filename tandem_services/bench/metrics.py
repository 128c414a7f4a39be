"""Per-request timings and the run summary of `tandem bench serve`.

Definitions (those of vLLM's bench serve, so the two clients' figures compare):

- TTFT: first streamed message carrying output after the request was sent.
- ITL: the gap between consecutive streamed messages of one request (a message that carries
  several tokens is one gap, not several).
- TPOT: per request, (E2E - TTFT) / (output tokens - 1).
- E2E ("e2el"): the last message after the request was sent.
- Output throughput: output tokens of the finished requests over the run's duration; goodput:
  requests/s that finished within every given limit.

The summary carries both vLLM's flat names (`mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`,
`output_throughput`, `request_goodput`, `completed`, ...) and the nested form the serving
comparison reads (`ttft_ms: {mean, p50, p90, p99}`, `output_token_throughput`, `goodput`).
"""

from __future__ import annotations

import itertools
import math
import resource
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """What one request saw. Times in seconds from the moment it was sent."""

    prompt_len: int
    output_len: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    ok: bool = False
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else 0.0


def record_times(result: RequestResult, t_send: float, times: Sequence[float]) -> None:
    """TTFT, E2E and ITL of `result` from the arrival times of its messages (one per streamed
    message, ascending)."""
    if not times:
        return
    result.ttft_s = times[0] - t_send
    result.e2e_s = times[-1] - t_send
    result.itl_s = [b - a for a, b in itertools.pairwise(times)]


def percentile(values: Sequence[float], q: float, empty: float = 0.0) -> float:
    """The `q`-th percentile (0..100) of `values`, interpolated linearly between the two
    nearest ranks (numpy's default); `empty` when there are none."""
    if not values:
        return empty
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _pname(q: float) -> str:
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def _stats_ms(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    out = {
        "mean": sum(ms) / len(ms) if ms else 0.0,
        "median": percentile(ms, 50),
        "std": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
    }
    for q in percentiles:
        out[_pname(q)] = percentile(ms, q)
    return out


def _within(r: RequestResult, limits_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2e_s}
    return all(values[k] * 1000 <= v for k, v in limits_ms.items())


@dataclass(frozen=True)
class ClientCpu:
    """CPU the load generator itself used over a run: user + system seconds of its
    process(es), all threads, and the run's wall time."""

    cpu_s: float
    wall_s: float
    num_procs: int = 1
    # Each client process's own CPU seconds (their sum, with the parent's, is cpu_s).
    per_proc_cpu_s: tuple[float, ...] = ()

    @property
    def cores_used(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def max_proc_cores_used(self) -> float:
        """The busiest client process's cores (what must stay under one core)."""
        busiest = max(self.per_proc_cpu_s, default=self.cpu_s)
        return busiest / self.wall_s if self.wall_s > 0 else 0.0


def process_cpu_s() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def summarize(
    results: list[RequestResult],
    duration_s: float,
    goodput_ttft_ms: float | None = None,
    goodput_tpot_ms: float | None = None,
    *,
    goodput_e2el_ms: float | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    client_cpu: ClientCpu | None = None,
) -> dict[str, Any]:
    """The run's figures (see the module docstring for names and definitions)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    limits = {
        k: v
        for k, v in (
            ("ttft", goodput_ttft_ms),
            ("tpot", goodput_tpot_ms),
            ("e2el", goodput_e2el_ms),
        )
        if v is not None
    }
    good = [r for r in ok if _within(r, limits)]

    def per_s(x: float) -> float:
        return x / duration_s if duration_s else 0.0

    samples = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if r.output_len > 1],
        "itl": [x for r in ok for x in r.itl_s],
        "e2el": [r.e2e_s for r in ok],
    }
    # The nested form always has p50, p90 and p99 (the comparison and the table read them).
    qs = sorted({*percentiles, *DEFAULT_PERCENTILES})
    stats = {m: _stats_ms(samples[m], qs) for m in METRICS}
    out: dict[str, Any] = {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens),
        "goodput": per_s(len(good)),
        "goodput_limits_ms": limits,
        # vLLM bench serve's names.
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_throughput": per_s(out_tokens),
        "request_goodput": per_s(len(good)),
    }
    nested = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}
    for m in METRICS:
        s = stats[m]
        out[nested[m]] = {"mean": s["mean"], **{k: v for k, v in s.items() if k[0] == "p"}}
        for k, v in s.items():
            out[f"{k}_{m}_ms"] = v
    if client_cpu is not None:
        out["client_cpu_s"] = client_cpu.cpu_s
        out["client_wall_s"] = client_cpu.wall_s
        out["client_cores_used"] = client_cpu.cores_used
        out["num_client_procs"] = client_cpu.num_procs
        out["client_max_proc_cores_used"] = client_cpu.max_proc_cores_used
    return out
