"""Served entry points may default engine flags differently from the offline `LLM` (vLLM's
serving token budget): the worker services and `tandem serve` parse with
SERVING_ENGINE_DEFAULTS, `LLM` / `EngineArgs` keep the fields' defaults, and a launcher forwards
a value to its workers exactly when it differs from the workers' own default."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import serve_offline
from tandem.config import SERVING_ENGINE_DEFAULTS, SchedulerConfig, add_engine_args, engine_argv
from tandem.engine_args import EngineArgs
from tandem_services.launcher.cli import build_parser as serve_parser
from tandem_services.worker.config import build_parser as worker_parser
from tandem_services.worker.states import Role

OFFLINE_BUDGET = SchedulerConfig().max_num_batched_tokens
SERVED = {"max_num_batched_tokens": 8192}


def _parse(defaults: dict[str, Any] | None, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p, environ={}, defaults=defaults)
    return p.parse_args(argv)


def test_a_parser_takes_its_entry_point_defaults_and_flags_still_win() -> None:
    assert _parse(None, []).max_num_batched_tokens == OFFLINE_BUDGET
    assert _parse(SERVED, []).max_num_batched_tokens == 8192
    assert _parse(SERVED, ["--max-num-batched-tokens", "512"]).max_num_batched_tokens == 512


def test_a_launcher_forwards_what_differs_from_the_workers_default() -> None:
    # The workers' default is the served one: an explicit offline figure must be forwarded,
    # the served default need not be.
    explicit = _parse(SERVED, ["--max-num-batched-tokens", str(OFFLINE_BUDGET)])
    assert engine_argv(explicit, defaults=SERVED) == [
        "--max-num-batched-tokens",
        str(OFFLINE_BUDGET),
    ]
    assert engine_argv(_parse(SERVED, []), defaults=SERVED) == []
    # Round trip: what the worker parses is what the launcher was given.
    for argv in ([], ["--max-num-batched-tokens", str(OFFLINE_BUDGET)]):
        launcher = _parse(SERVED, argv)
        worker = _parse(SERVED, engine_argv(launcher, defaults=SERVED))
        assert worker.max_num_batched_tokens == launcher.max_num_batched_tokens


def test_served_parsers_use_the_serving_defaults_and_llm_keeps_its_own() -> None:
    served = SERVING_ENGINE_DEFAULTS.get("max_num_batched_tokens", OFFLINE_BUDGET)
    # serve_offline's engine is the one a served run is held against: the same defaults.
    for parser in (
        worker_parser("worker", Role.UNIFIED),
        serve_parser(),
        serve_offline.build_parser(),
    ):
        ns = parser.parse_args([])
        assert ns.max_num_batched_tokens == served
        for name, value in SERVING_ENGINE_DEFAULTS.items():
            assert getattr(ns, name) == value
    assert EngineArgs().max_num_batched_tokens == OFFLINE_BUDGET
