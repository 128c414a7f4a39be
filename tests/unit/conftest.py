"""Fixtures shared by unit-test files: the speculative-decoding tests' references (runs
without speculation that several files and cases compare with, computed once a session); the
hooks that start the Triton interpreter's child as soon as the session is collected."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tandem import SamplingParams
from tests.spec_decode_cases import (
    SMOLLM2_CODE_ENGINE,
    SMOLLM2_CODE_PARAMS,
    SMOLLM2_CODE_PROMPT,
    run_engine,
)


def _interp_module(items: Sequence[pytest.Item]) -> Any:
    """tests/unit/test_kernels_interp.py's module object when any of its tests is selected."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.endswith(".test_kernels_interp"):
            return module
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the interpreter child of the selected kernel cases now, so it runs beside the
    files before it (its ~7 CPU minutes hidden on this machine's second core)."""
    if session.config.option.collectonly:
        return
    module = _interp_module(session.items)
    cases = module.selected_cases(session.items) if module is not None else []
    if cases:
        session.config.stash[module.INTERP_CHILD] = module.InterpChild(cases)


def pytest_sessionfinish(session: pytest.Session) -> None:
    module = _interp_module(session.items)
    child = session.config.stash.get(module.INTERP_CHILD, None) if module is not None else None
    if child is not None:
        child.stop()


@pytest.fixture(scope="session")
def smollm2_code_reference(smollm2_path: Path) -> Any:
    """SmolLM2's greedy completion of SMOLLM2_CODE_PROMPT (SMOLLM2_CODE_PARAMS) on
    `run_engine`'s engine with SMOLLM2_CODE_ENGINE, without speculation."""
    ref, _ = run_engine(
        smollm2_path, [SMOLLM2_CODE_PROMPT], SMOLLM2_CODE_PARAMS, **SMOLLM2_CODE_ENGINE
    )
    return ref[0]


@pytest.fixture(scope="session")
def greedy_reference(
    tiny_model_path: Callable[[str], Path],
) -> Callable[[str, Sequence[list[int]], int], list[Any]]:
    """`greedy_reference(arch, prompts, max_tokens)`: the completions of the tiny `arch`
    model for `prompts` on `run_engine`'s default engine without speculation, greedy, EOS
    ignored, one logprob per token; each distinct call runs once a session."""
    cache: dict[tuple[str, tuple[tuple[int, ...], ...], int], list[Any]] = {}

    def get(arch: str, prompts: Sequence[list[int]], max_tokens: int) -> list[Any]:
        key = (arch, tuple(tuple(p) for p in prompts), max_tokens)
        if key not in cache:
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1
            )
            cache[key] = run_engine(tiny_model_path(arch), list(prompts), params)[0]
        return cache[key]

    return get
