"""The frontend's request validation: microseconds to parse and check one OpenAI body
(`parse_completion`, `parse_chat`: every field read, limits, sampling values, structured
outputs and tools; the token-count checks come later, in `FrontendEngine.inputs`).

Bodies: a minimal one, a typical one (sampling parameters, stop strings, logprobs, a
stream) and a heavy one (a JSON schema, or tools with `tool_choice`). Each is parsed `--reps`
times in a row, `--rounds` times; the figure is the median round's time per parse. The same
body again and again, as a client with one schema sends it; `schema_fresh` gives every
request a schema never seen before.

    python -m benchmarks.request_parse --out request_parse.json

It imports the frontend from wherever `tandem_services` resolves, so the same file times
another checkout: `PYTHONPATH=/path/to/other python benchmarks/request_parse.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from tandem_services.frontend.limits import RequestLimits
from tandem_services.frontend.openai_protocol import parse_chat, parse_completion

_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
_SAMPLING = {
    "temperature": 0.7,
    "top_p": 0.9,
    "max_tokens": 128,
    "stop": ["\n\n", "END"],
    "seed": 3,
    "presence_penalty": 0.1,
    "stream": True,
    "stream_options": {"include_usage": True},
}

COMPLETION_BODIES: dict[str, dict[str, Any]] = {
    "minimal": {"model": "default", "prompt": "The capital of France is"},
    "typical": {"model": "default", "prompt": "The capital of France is", "logprobs": 2}
    | _SAMPLING,
    "schema": {
        "model": "default",
        "prompt": "A person as JSON:",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": _SCHEMA},
        },
    }
    | _SAMPLING,
}
CHAT_BODIES: dict[str, dict[str, Any]] = {
    "minimal": {"model": "default", "messages": _MESSAGES[1:]},
    "typical": {"model": "default", "messages": _MESSAGES, "logprobs": True, "top_logprobs": 2}
    | _SAMPLING,
    "tools": {
        "model": "default",
        "messages": _MESSAGES,
        "tools": [_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    | _SAMPLING,
}


def time_parse(parse: Callable[[], object], reps: int, rounds: int) -> dict[str, float]:
    """Microseconds per call: the median, fastest and slowest of `rounds` rounds of `reps`."""
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            parse()
        per_call.append((time.perf_counter() - start) / reps * 1e6)
    return {
        "median_us": round(statistics.median(per_call), 2),
        "min_us": round(min(per_call), 2),
        "max_us": round(max(per_call), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="")
    ns = ap.parse_args()
    limits = RequestLimits()
    rows: dict[str, dict[str, float]] = {}
    for name, body in COMPLETION_BODIES.items():
        rows[f"completion/{name}"] = time_parse(
            lambda b=body: parse_completion(b, limits), ns.reps, ns.rounds
        )
    for name, body in CHAT_BODIES.items():
        rows[f"chat/{name}"] = time_parse(lambda b=body: parse_chat(b, limits), ns.reps, ns.rounds)
    # A schema never seen before in every request (a property named by a counter).
    fresh = iter(range(10**9))

    def fresh_schema() -> object:
        schema = {**_SCHEMA, "properties": {f"p{next(fresh)}": {"type": "string"}}}
        body = {**COMPLETION_BODIES["schema"]}
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": False},
        }
        body["response_format"]["json_schema"]["schema"]["required"] = []
        return parse_completion(body, limits)

    rows["completion/schema_fresh"] = time_parse(fresh_schema, max(ns.reps // 10, 1), ns.rounds)
    for key, row in rows.items():
        print(f"{key:20s} {row['median_us']:8.2f} us  ({row['min_us']:.2f}-{row['max_us']:.2f})")
    if ns.out:
        result = {
            "benchmark": "request_parse",
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "reps": ns.reps,
            "rounds": ns.rounds,
            "rows": rows,
        }
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
