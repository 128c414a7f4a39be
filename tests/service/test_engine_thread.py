"""EngineThread: commands run between steps in order, outputs reach the loop, errors travel."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.engine_thread import EngineThread, EngineThreadError


class _CountingEngine:
    """Each request emits one token per step until it has `n`."""

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.thread: threading.Thread | None = None
        self.log: list[str] = []

    def add(self, rid: str, n: int) -> None:
        self.thread = threading.current_thread()
        self.log.append(f"add {rid}")
        self.remaining[rid] = n

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def step(self) -> list[EngineCoreOutput]:
        assert threading.current_thread() is self.thread
        outs = []
        for rid in list(self.remaining):
            self.remaining[rid] -= 1
            done = self.remaining[rid] == 0
            if done:
                del self.remaining[rid]
            outs.append(EngineCoreOutput(rid, [7], finish_reason="length" if done else None))
        self.log.append("step")
        return outs


async def _run() -> None:
    loop = asyncio.get_running_loop()
    steps: list[tuple[list[EngineCoreOutput], object]] = []
    got_all = asyncio.Event()

    def on_step(outputs: list[EngineCoreOutput], extra: object) -> None:
        assert threading.current_thread() is threading.main_thread()
        steps.append((outputs, extra))
        if sum(o.finished for out, _ in steps for o in out) == 2:
            got_all.set()

    thread: EngineThread[_CountingEngine] = EngineThread(
        _CountingEngine,
        loop,
        on_step,
        post_step=lambda e, outs: len(outs),
        snapshot=lambda e: dict(e.remaining),
    )
    engine = await thread.start()
    assert thread.latest_snapshot == {}
    await thread.call(lambda e: e.add("a", 3))
    thread.call_nowait(lambda e: e.add("b", 1))
    await asyncio.wait_for(got_all.wait(), 5)
    assert engine.thread is not threading.main_thread()
    tokens = {}
    for outs, extra in steps:
        assert extra == len(outs)
        for o in outs:
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
    assert tokens == {"a": 3, "b": 1}
    assert thread.latest_snapshot == {}
    # Both adds ran before the step that followed them.
    assert engine.log.index("add b") < engine.log.index("step", engine.log.index("add b"))
    with pytest.raises(ZeroDivisionError):
        await thread.call(lambda e: 1 / 0)
    assert await thread.call(lambda e: len(e.remaining)) == 0
    await thread.stop()
    with pytest.raises(EngineThreadError):
        await thread.call(lambda e: None)


def test_engine_thread() -> None:
    asyncio.run(_run())


def test_engine_build_error_surfaces() -> None:
    async def run() -> None:
        def broken() -> _CountingEngine:
            raise ValueError("no such model")

        thread: EngineThread[_CountingEngine] = EngineThread(
            broken, asyncio.get_running_loop(), lambda o, e: None
        )
        with pytest.raises(ValueError, match="no such model"):
            await thread.start()

    asyncio.run(run())
