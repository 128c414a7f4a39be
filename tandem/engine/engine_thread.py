"""Runs an EngineCore on its own thread so an asyncio event loop never waits on the model.

    event loop                         engine thread (sole owner of the EngineCore)
    ──────────                         ─────────────────────────────────────────────
    call(fn) / call_nowait(fn) ──inbox──▶ between steps: fn(engine) for every command
                                          while work remains: outputs = engine.step()
                                                              extra = post_step(engine, outputs)
    on_step(outputs, extra)  ◀──call_soon_threadsafe──┘

Commands run in arrival order, all of them before the next step, so a command sees the
effects of every earlier one. The thread blocks on the inbox while the engine has no work.
`post_step` runs on the engine thread right after each step (for state that must be read
before the next step changes it); its result travels with the outputs. `snapshot`, when given,
is run after every step and every batch of commands; its latest result is `latest_snapshot`
(an immutable value the loop may read at any time without waiting for a step to end).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from tandem.core.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)

E = TypeVar("E")  # the engine type (EngineCore; anything with step/has_unfinished_requests)
T = TypeVar("T")

_IDLE_STEP_PAUSE_S = 0.001

OnStep = Callable[[list[EngineCoreOutput], Any], None]
PostStep = Callable[[E, list[EngineCoreOutput]], Any]


class EngineThreadError(RuntimeError):
    pass


class _Stop:
    pass


class EngineThread(Generic[E]):
    """Owns one engine on a dedicated thread; the event loop talks to it through an inbox."""

    def __init__(
        self,
        make_engine: Callable[[], E],
        loop: asyncio.AbstractEventLoop,
        on_step: OnStep,
        post_step: PostStep[E] | None = None,
        name: str = "engine",
        snapshot: Callable[[E], Any] | None = None,
    ) -> None:
        self._make_engine = make_engine
        self._loop = loop
        self._on_step = on_step
        self._post_step = post_step
        self._snapshot = snapshot
        self.latest_snapshot: Any = None
        self._inbox: queue.SimpleQueue[
            tuple[Callable[[E], Any], concurrent.futures.Future[Any] | None] | _Stop
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready: concurrent.futures.Future[E] = concurrent.futures.Future()
        self._stopped = threading.Event()
        self.num_steps = 0
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ loop side

    async def start(self) -> E:
        """Build the engine on its thread; returns it once ready (raises what building raised).

        The returned object may be read for constants (block size, max_model_len); anything
        that changes must go through `call`.
        """
        self._thread.start()
        return await asyncio.wrap_future(self._ready)

    async def call(self, fn: Callable[[E], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; returns its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put(fn, fut)
        return await asyncio.wrap_future(fut)

    def call_nowait(self, fn: Callable[[E], Any]) -> None:
        """Queue `fn(engine)` without waiting; an exception is logged."""
        self._put(fn, None)

    async def stop(self) -> None:
        """Stop after the current step; queued commands still run first."""
        if not self._thread.is_alive():
            return
        self._inbox.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def _put(self, fn: Callable[[E], Any], fut: concurrent.futures.Future[Any] | None) -> None:
        if self._stopped.is_set():
            raise EngineThreadError("the engine thread has stopped") from self.error
        self._inbox.put((fn, fut))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            engine = self._make_engine()
        except BaseException as exc:
            self.error = exc
            self._stopped.set()
            self._ready.set_exception(exc)
            return
        if self._snapshot is not None:
            self.latest_snapshot = self._snapshot(engine)
        self._ready.set_result(engine)
        try:
            self._loop_forever(engine)
        except BaseException as exc:  # a step failed: the engine is unusable
            logger.exception("engine thread failed")
            self.error = exc
        finally:
            self._stopped.set()
            self._fail_pending()

    def _loop_forever(self, engine: Any) -> None:
        inbox = self._inbox
        while True:
            busy = engine.has_unfinished_requests()
            try:
                item = inbox.get(block=not busy)
            except queue.Empty:
                item = None
            ran_commands = item is not None
            while item is not None:
                if isinstance(item, _Stop):
                    return
                self._run_command(engine, *item)
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    item = None
            if ran_commands and self._snapshot is not None:
                self.latest_snapshot = self._snapshot(engine)
            if not engine.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            outputs = engine.step()
            self.num_steps += 1
            extra = self._post_step(engine, outputs) if self._post_step is not None else None
            if self._snapshot is not None:
                self.latest_snapshot = self._snapshot(engine)
            if outputs or extra:
                self._loop.call_soon_threadsafe(self._on_step, outputs, extra)
            elif getattr(engine, "last_step_idle", True) and (
                time.perf_counter() - t0 < _IDLE_STEP_PAUSE_S
            ):
                # Work remains but nothing could be scheduled: wait for a command briefly
                # rather than spin.
                try:
                    item = inbox.get(timeout=_IDLE_STEP_PAUSE_S)
                except queue.Empty:
                    continue
                if isinstance(item, _Stop):
                    return
                self._run_command(engine, *item)

    @staticmethod
    def _run_command(
        engine: Any, fn: Callable[[Any], Any], fut: concurrent.futures.Future[Any] | None
    ) -> None:
        if fut is not None and not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(engine)
        except BaseException as exc:
            if fut is None:
                logger.exception("engine command failed")
            else:
                fut.set_exception(exc)
            return
        if fut is not None:
            fut.set_result(result)

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not isinstance(item, _Stop) and item[1] is not None:
                item[1].set_exception(EngineThreadError("the engine thread has stopped"))
