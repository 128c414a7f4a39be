"""`tandem bench serve`'s workload, figures and SSE parsing, on exact inputs."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest

from tandem_services.bench.client import sse_events
from tandem_services.bench.metrics import ClientCpu, RequestResult, record_times, summarize
from tandem_services.bench.serve import build_parser, goodput_limits
from tandem_services.bench.workload import arrival_times, length_range, random_workload


def test_random_dataset_lengths_span_the_issue_ranges() -> None:
    wl = random_workload(400, 1000, 200, 0.5, 49152, seed=3)
    assert length_range(1000, 0.5) == (500, 1500) and length_range(200, 0.5) == (100, 300)
    ins = [len(p) for p in wl.prompts]
    assert min(ins) >= 500 and max(ins) <= 1500
    assert min(ins) < 530 and max(ins) > 1470  # the whole range is drawn, not its middle
    assert min(wl.output_lens) >= 100 and max(wl.output_lens) <= 300
    assert min(wl.output_lens) < 106 and max(wl.output_lens) > 294
    assert all(100 <= t < 49152 for p in wl.prompts for t in p)
    again = random_workload(400, 1000, 200, 0.5, 49152, seed=3)
    assert again == wl
    assert random_workload(400, 1000, 200, 0.5, 49152, seed=4) != wl


def test_zero_range_ratio_gives_fixed_lengths() -> None:
    wl = random_workload(10, 64, 32, 0.0, 1000, seed=0)
    assert {len(p) for p in wl.prompts} == {64} and set(wl.output_lens) == {32}
    with pytest.raises(ValueError):
        random_workload(1, 64, 32, 1.0, 1000, seed=0)


def test_arrivals_poisson_and_bursty() -> None:
    gaps = [b - a for a, b in itertools.pairwise(arrival_times(4000, 25.0, 0))]
    assert statistics.mean(gaps) == pytest.approx(1 / 25, rel=0.06)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / 25, rel=0.1)
    t = arrival_times(4000, 25.0, 0, burstiness=4.0)
    steady = [b - a for a, b in itertools.pairwise(t)]
    assert statistics.mean(steady) == pytest.approx(1 / 25, rel=0.06)
    assert statistics.pstdev(steady) == pytest.approx(1 / 25 / 2, rel=0.12)  # 1/sqrt(shape)
    assert arrival_times(5, math.inf, 0) == [0.0] * 5


def _result(prompt: int, t_send: float, times: list[float], tokens: int) -> RequestResult:
    r = RequestResult(prompt)
    record_times(r, t_send, times)
    r.output_len = tokens
    r.ok = True
    return r


def test_summary_has_vllm_names_and_exact_values() -> None:
    # Request a: TTFT 100 ms, then messages 10 and 30 ms apart (3 tokens): TPOT 20 ms.
    # Request b: TTFT 300 ms, then one message 40 ms later carrying 2 tokens (3 in all).
    a = _result(10, 1.0, [1.1, 1.11, 1.14], 3)
    b = _result(20, 2.0, [2.3, 2.34], 3)
    failed = RequestResult(5, error="got 0 tokens")
    s = summarize(
        [a, b, failed],
        2.0,
        goodput_ttft_ms=200.0,
        percentiles=[50, 75],
        client_cpu=ClientCpu(0.5, 2.0, 2, (0.1, 0.3)),
    )
    assert s["completed"] == 2 and s["failed"] == 1 and s["num_ok"] == 2
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 6
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)
    assert s["p75_ttft_ms"] == pytest.approx(250.0)
    assert s["mean_tpot_ms"] == pytest.approx(20.0)
    # ITL per message: 10, 30 (a) and 40 (b).
    assert s["mean_itl_ms"] == pytest.approx(80 / 3)
    assert s["median_itl_ms"] == pytest.approx(30.0)
    assert s["mean_e2el_ms"] == pytest.approx((140 + 340) / 2)
    assert s["itl_ms"]["p90"] == pytest.approx(38.0)
    assert s["request_goodput"] == pytest.approx(0.5)  # only a within 200 ms TTFT
    assert s["goodput"] == s["request_goodput"]
    assert s["client_cores_used"] == pytest.approx(0.25)
    assert s["client_max_proc_cores_used"] == pytest.approx(0.15)
    assert s["num_client_procs"] == 2
    assert s["errors"] == ["got 0 tokens"]


def test_goodput_specs() -> None:
    assert goodput_limits(["ttft:200", "e2el:900"], tpot_ms=9.0) == {
        "ttft": 200.0,
        "tpot": 9.0,
        "e2el": 900.0,
    }
    with pytest.raises(ValueError, match="ttft:MS"):
        goodput_limits(["itl:3"])


def test_bench_flags_take_vllm_names() -> None:
    flags = (
        "--url x --dataset-name random --random-input-len 1000 --random-range-ratio 0.5 "
        "--random-output-len 200 --ignore-eos --num-prompts 150 --request-rate 5,15,25,inf "
        "--burstiness 1 --seed 7 --num-client-procs 3 --goodput ttft:200"
    )
    ns = build_parser().parse_args(flags.split())
    assert (ns.input_len, ns.output_len, ns.range_ratio) == (1000, 200, 0.5)
    assert ns.ignore_eos and ns.num_prompts == 150 and ns.burstiness == 1.0
    assert ns.num_client_procs == 3 and ns.goodput == ["ttft:200"] and ns.seed == 7
    # The older names still parse into the same fields.
    old = build_parser().parse_args(["--input-len", "9", "--output-len", "3", "--no-ignore-eos"])
    assert (old.input_len, old.output_len, old.ignore_eos) == (9, 3, False)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_sse_events_across_reads_and_chunks() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    e1 = b'data: {"choices":[{"text":" a"}]}\n\n'
    e2 = b'data: {"choices":[{"text":" b"}]}\n\n'
    e3 = b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    body = _chunk(e1) + _chunk(e2[:10]) + _chunk(e2[10:]) + _chunk(e3) + b"0\r\n\r\n"
    raw = head + body
    # Three reads: the head and e1 plus half of e2's first chunk; the rest of e2; the end.
    cut1 = len(head) + len(_chunk(e1)) + 5
    cut2 = len(head) + len(_chunk(e1)) + len(_chunk(e2[:10])) + len(_chunk(e2[10:]))
    parts = [raw[:cut1], raw[cut1:cut2], raw[cut2:]]
    status, events = sse_events(parts, [1.0, 2.0, 3.0])
    assert status == 200
    assert [t for _, t in events] == [1.0, 2.0, 3.0, 3.0]
    assert json.loads(events[1][0])["choices"][0]["text"] == " b"
    assert events[3][0] == b"[DONE]"
    # Close-delimited (no chunked framing): each read's bytes keep the read's time.
    plain = b"HTTP/1.1 200 OK\r\n\r\n" + e1 + e2[:7]
    status, events = sse_events([plain, e2[7:]], [5.0, 6.0])
    assert [t for _, t in events] == [5.0, 6.0]
    status, _ = sse_events([b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"], [1.0])
    assert status == 404
