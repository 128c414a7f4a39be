"""EngineCoreClient: how callers reach an EngineCore, in this process or in its own.

    InprocClient     the engine in the caller's process; `get_output()` runs one step
                     (the offline `LLM`, tests)
    SyncMPClient     the engine in an EngineCoreProc; blocking calls, `get_output()` waits for
                     the next step's frame
    AsyncMPClient    the engine in an EngineCoreProc; asyncio calls, each step's outputs handed
                     to a callback on the event loop (worker services)

Every client offers the same operations, those of the one table (`tandem.engine.ops`): add,
abort, the disaggregation hooks (hold via `add_request(hold_kv=True)`, reserve, add
prefilled, release held, held block ids), stats, the pool's state and the cached block
hashes. They are methods of every client through the table (`client.reserve(req)`); a client
implements only `call(op, ...)` and `tell(op, ...)`, and its life cycle (outputs, start,
shutdown). `EngineCoreClient` is the blocking interface, `AsyncEngineCoreClient` the asyncio
one (each operation a coroutine). A multiprocess client's calls run in order with the
engine's steps (see `tandem.engine.core_proc`); a call that the engine refuses raises the
engine's error (InvalidRequestError naming the problem, KeyError, ...). When the engine
process dies, every pending and later call raises EngineDeadError, and the async client
calls `on_dead` once.

The async client also tells a stalled engine from a busy one (`stall_timeout_s` > 0): its
watchdog sends a `ping` now and then, which the engine answers between two steps (at once
when idle). A ping unanswered for `stall_timeout_s` means a step has been in flight that long,
or the process is stopped: `stalled` turns True and `on_stall(True)` runs; the next answer
turns it back (`on_stall(False)`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any, ParamSpec, TypeVar

import torch

from tandem.config import EngineConfig
from tandem.core.outputs import EngineCoreOutput
from tandem.engine import serial
from tandem.engine.core import EngineCore, EngineStats
from tandem.engine.core_proc import EngineInfo, EngineProcOptions, run_engine_core
from tandem.engine.ops import EngineOp, EngineOps
from tandem.worker.shared_kv import open_shared_kv_cache

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

OnStep = Callable[[list[EngineCoreOutput], serial.Piggyback], None]

_MAX_FRAMES_PER_WAKEUP = 16
_WATCH_INTERVAL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine-core process has exited; the message says how."""


def _check_tell(op: EngineOp[..., Any]) -> None:
    if not op.tell:
        raise TypeError(f"engine operation {op.name!r} answers: call it, do not tell it")


class EngineCoreClient(EngineOps, abc.ABC):
    """Blocking access to one engine: every operation of `EngineOps` is a method that
    returns the engine's result (see the module docstring), plus the life cycle."""

    info: EngineInfo

    @abc.abstractmethod
    def call(self, op: EngineOp[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run one engine operation; its result, or the engine's error raised."""

    @abc.abstractmethod
    def tell(self, op: EngineOp[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        """Run an operation marked `tell` with no reply awaited (a failure is logged)."""

    @abc.abstractmethod
    def get_output(self) -> list[EngineCoreOutput]:
        """The next step's outputs (the in-process client runs the step)."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    @staticmethod
    def make(config: EngineConfig, multiprocess: bool = False) -> EngineCoreClient:
        return SyncMPClient(config) if multiprocess else InprocClient(config)


class InprocClient(EngineCoreClient):
    """The engine in this process; `get_output()` runs one step."""

    def __init__(self, config: EngineConfig | None = None, engine: EngineCore | None = None):
        if engine is None:
            assert config is not None
            engine = EngineCore(config)
        self.engine = engine
        self.info = EngineInfo.of(engine, 0, None)

    def call(self, op: EngineOp[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        method: Callable[P, R] = getattr(self.engine, op.name)
        return method(*args, **kwargs)

    def tell(self, op: EngineOp[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        _check_tell(op)
        try:
            self.call(op, *args, **kwargs)
        except Exception as exc:
            logger.warning("engine command %s failed: %s", op.name, exc)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def shutdown(self) -> None:
        self.engine.shutdown()


class _EngineProcess:
    """The engine-core child process and the two pipes to it (shared by the MP clients)."""

    def __init__(self, config: EngineConfig, options: EngineProcOptions, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self.commands = ctx.Pipe(duplex=False)
        self.outputs, out_send = ctx.Pipe(duplex=False)
        self.process: BaseProcess = ctx.Process(
            target=run_engine_core,
            args=(config, options, cmd_recv, out_send, logging.getLogger().getEffectiveLevel()),
            name=name,
            daemon=True,
        )
        self.process.start()
        # The child's ends live in the child only: its exit then closes the output pipe.
        cmd_recv.close()
        out_send.close()
        self._ids = itertools.count(1)
        self.dead: str | None = None

    def next_call_id(self) -> int:
        return next(self._ids)

    def send(
        self,
        call_id: int,
        name: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            self.commands.send_bytes(serial.encode_command(call_id, name, args, kwargs))
        except (BrokenPipeError, OSError) as exc:
            raise EngineDeadError(f"the engine process is gone ({exc})") from exc

    def exited(self) -> bool:
        """Whether the process has exited (waitpid, not the sentinel pipe: a process the
        engine started, such as torch's shared-memory manager, may hold the sentinel open)."""
        return self.process.exitcode is not None

    def wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.exited():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def exit_reason(self, fatal: BaseException | None = None) -> str:
        self.wait_exit(1.0)
        code = self.process.exitcode
        how = f"exit code {code}" if code is not None else "no exit code yet"
        if fatal is not None:
            return f"the engine process failed: {type(fatal).__name__}: {fatal} ({how})"
        return f"the engine process exited ({how})"

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(Exception):
            self.commands.close()
        if not self.wait_exit(timeout_s):
            self.process.kill()
            self.wait_exit(5.0)
        with contextlib.suppress(Exception):
            self.outputs.close()


def _expect_ready(frame: bytes, proc: _EngineProcess) -> EngineInfo:
    if frame[0] == serial.READY:
        return serial.decode_pickled(frame)
    if frame[0] == serial.FATAL:
        exc = serial.decode_pickled(frame)
        proc.dead = proc.exit_reason(exc)
        raise exc
    raise EngineDeadError(f"unexpected first frame {frame[0]} from the engine process")


class SyncMPClient(EngineCoreClient):
    """The engine in its own process, reached with blocking calls."""

    def __init__(
        self,
        config: EngineConfig,
        options: EngineProcOptions | None = None,
        name: str = "engine-core",
    ) -> None:
        self._proc = _EngineProcess(config, options or EngineProcOptions(), name)
        try:
            self.info = _expect_ready(self._recv(), self._proc)
        except BaseException:
            self._proc.close()
            raise
        self._steps: list[list[EngineCoreOutput]] = []
        # The latest frame's: whether the engine has unfinished requests comes from it.
        self.latest_piggyback = serial.Piggyback()

    def _recv(self) -> bytes:
        try:
            return self._proc.outputs.recv_bytes()
        except (EOFError, OSError) as exc:
            self._proc.dead = self._proc.exit_reason()
            raise EngineDeadError(self._proc.dead) from exc

    def _take(self, frame: bytes) -> tuple[int, bool, Any] | None:
        """Handle one frame; a reply is returned, a step is queued."""
        kind = frame[0]
        if kind == serial.STEP:
            outputs, pig = serial.decode_step(frame)
            self.latest_piggyback = pig
            if outputs:
                self._steps.append(outputs)
            return None
        if kind == serial.REPLY:
            call_id, ok, result, pig = serial.decode_pickled(frame)
            self.latest_piggyback = pig
            return call_id, ok, result
        if kind == serial.FATAL:
            exc = serial.decode_pickled(frame)
            self._proc.dead = self._proc.exit_reason(exc)
            raise EngineDeadError(self._proc.dead) from exc
        raise EngineDeadError(f"unexpected frame {kind} from the engine process")

    def call(self, op: EngineOp[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        call_id = self._proc.next_call_id()
        self._proc.send(call_id, op.name, args, kwargs)
        while True:
            reply = self._take(self._recv())
            if reply is None:
                continue
            got_id, ok, result = reply
            assert got_id == call_id, (got_id, call_id)
            if not ok:
                raise result
            return result  # type: ignore[no-any-return]

    def tell(self, op: EngineOp[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        _check_tell(op)
        self._proc.send(0, op.name, args, kwargs)

    def get_output(self) -> list[EngineCoreOutput]:
        while not self._steps:
            if not self.latest_piggyback.has_unfinished_requests:
                return []
            self._take(self._recv())
        return self._steps.pop(0)

    def has_unfinished_requests(self) -> bool:
        return bool(self._steps) or self.latest_piggyback.has_unfinished_requests

    def shutdown(self) -> None:
        if self._proc.dead is None:
            with contextlib.suppress(EngineDeadError):
                self._proc.send(0, serial.SHUTDOWN)
        self._proc.dead = self._proc.dead or "the client shut the engine down"
        self._proc.close()


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve a probe's outcome, so a dead engine's error is not logged as unretrieved."""
    if not fut.cancelled():
        fut.exception()


class AsyncEngineCoreClient(EngineOps, abc.ABC):
    """Access to one engine from an asyncio event loop: every operation of `EngineOps` is a
    coroutine method (`await client.reserve(req)`), plus the life cycle."""

    info: EngineInfo | None

    @abc.abstractmethod
    async def call(self, op: EngineOp[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run one engine operation; its result, or the engine's error raised."""

    @abc.abstractmethod
    def tell(self, op: EngineOp[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        """Send an operation marked `tell`, awaiting no reply (a failure is logged by the
        engine; nothing is sent to an engine that is gone)."""

    @abc.abstractmethod
    async def start(self) -> EngineInfo:
        """Bring the engine up; its constants."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine (commands already sent still run first)."""


class AsyncMPClient(AsyncEngineCoreClient):
    """The engine in its own process, reached from an asyncio event loop.

    Each STEP frame's outputs go to `on_step(outputs, piggyback)` on the loop, in step order;
    a reply's piggyback (stats, held blocks, cache events) goes to `on_piggyback` first, so
    that what the engine did before a reply is known when the call returns. `on_dead(reason)`
    runs once when the engine process is gone.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_step: OnStep,
        options: EngineProcOptions | None = None,
        name: str = "engine-core",
        on_dead: Callable[[str], None] | None = None,
        on_piggyback: Callable[[serial.Piggyback], None] | None = None,
        stall_timeout_s: float = 0.0,
        on_stall: Callable[[bool], None] | None = None,
    ) -> None:
        self.config = config
        self.options = options or EngineProcOptions()
        self.name = name
        self._on_step = on_step
        self._on_dead = on_dead
        self._on_piggyback = on_piggyback
        self._proc: _EngineProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ready: asyncio.Future[EngineInfo] | None = None
        self.info: EngineInfo | None = None
        self.latest_stats: EngineStats | None = None
        self.num_step_frames = 0
        self._kv_cache: torch.Tensor | None = None
        self._closing = False
        self._watchdog: asyncio.Task[None] | None = None
        # Stall detection (0: off): see the module docstring.
        self.stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall
        self.stalled = False

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> EngineInfo:
        """Spawn the engine process; returns its constants once it is ready (raises what
        building the engine raised)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._proc = _EngineProcess(self.config, self.options, self.name)
        self._loop.add_reader(self._proc.outputs.fileno(), self._on_readable)
        self._watchdog = self._loop.create_task(self._watch())
        try:
            self.info = await self._ready
            self.latest_stats = await self.stats()
        except BaseException:
            self._stop_reading()
            self._proc.close(timeout_s=5.0)
            raise
        return self.info

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.dead is None

    @property
    def pid(self) -> int | None:
        return self._proc.process.pid if self._proc is not None else None

    @property
    def dead_reason(self) -> str | None:
        return self._proc.dead if self._proc is not None else None

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine after its current step (queued commands still run first)."""
        proc = self._proc
        if proc is None:
            return
        self._closing = True
        if proc.dead is None:
            with contextlib.suppress(EngineDeadError, asyncio.TimeoutError):
                await asyncio.wait_for(self._send(serial.SHUTDOWN), timeout_s)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, proc.close, timeout_s)
        self._mark_dead("the engine was shut down")

    def kv_cache(self) -> torch.Tensor:
        """The engine's KV cache tensor, opened in this process (needs share_kv_cache)."""
        if self._kv_cache is None:
            assert self.info is not None
            if self.info.shared_kv_cache is None:
                raise RuntimeError("the engine was started without share_kv_cache")
            self._kv_cache = open_shared_kv_cache(self.info.shared_kv_cache)
        return self._kv_cache

    def kv_caches(self) -> list[torch.Tensor]:
        """Every rank's KV cache, opened in this process, in rank order (one for an engine of
        one rank; needs share_kv_cache)."""
        assert self.info is not None
        shared = self.info.shared_kv_caches
        if len(shared) <= 1:
            return [self.kv_cache()]
        return [open_shared_kv_cache(s) for s in shared]

    def kv_cache_ipc_handle(self) -> tuple[Any, ...] | None:
        """The CUDA IPC handle (`_share_cuda_()` tuple) of the engine's KV cache, if any."""
        shared = self.info.shared_kv_cache if self.info is not None else None
        return shared.handle if shared is not None and shared.kind == "cuda" else None

    # ------------------------------------------------------------------ frames

    async def _watch(self) -> None:
        """Notices an exited engine process within `_WATCH_INTERVAL_S` even when its output
        pipe stays open (a process it started holds the pipe's other end)."""
        proc = self._proc
        assert proc is not None
        probe: asyncio.Future[Any] | None = None
        probe_sent = last_answer = time.monotonic()
        probe_every_s = min(1.0, self.stall_timeout_s / 2)
        while proc.dead is None:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if proc.dead is None and proc.exited():
                self._on_readable()  # the frames it wrote before it went (FATAL)
                self._mark_dead(proc.exit_reason() if not self._closing else "shut down")
            if self.stall_timeout_s <= 0 or proc.dead is not None or self._closing:
                continue
            if self.info is None:  # still loading: not a step
                probe_sent = last_answer = time.monotonic()
                continue
            now = time.monotonic()
            if probe is not None and probe.done():
                probe, last_answer = None, now
                self._set_stalled(False)
            if probe is None and now - last_answer >= probe_every_s:
                with contextlib.suppress(EngineDeadError):
                    probe, probe_sent = self._send(serial.PING), now
                    probe.add_done_callback(_consume)
            elif probe is not None and now - probe_sent > self.stall_timeout_s:
                self._set_stalled(True)

    def _set_stalled(self, stalled: bool) -> None:
        if stalled == self.stalled:
            return
        self.stalled = stalled
        if stalled:
            logger.error(
                "engine %s: no step has ended for %.1f s (stalled)", self.name, self.stall_timeout_s
            )
        else:
            logger.warning("engine %s: steps run again", self.name)
        if self._on_stall is not None:
            self._on_stall(stalled)

    def _stop_reading(self) -> None:
        if self._loop is not None and self._proc is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._proc.outputs.fileno())

    def _on_readable(self) -> None:
        proc = self._proc
        assert proc is not None
        try:
            # A bounded batch per wake-up: a fast engine cannot keep the loop from its other
            # work (the reader fires again while frames remain).
            for _ in range(_MAX_FRAMES_PER_WAKEUP):
                if not proc.outputs.poll():
                    return
                self._handle(proc.outputs.recv_bytes())
                if proc.dead is not None:
                    return
        except (EOFError, OSError):
            self._mark_dead(proc.exit_reason() if not self._closing else "shut down")

    def _handle(self, frame: bytes) -> None:
        kind = frame[0]
        if kind == serial.STEP:
            outputs, pig = serial.decode_step(frame)
            self.num_step_frames += 1
            self.latest_stats = pig.stats
            self._on_step(outputs, pig)
        elif kind == serial.REPLY:
            call_id, ok, result, pig = serial.decode_pickled(frame)
            self.latest_stats = pig.stats
            if self._on_piggyback is not None:
                self._on_piggyback(pig)
            fut = self._pending.pop(call_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(result)
                else:
                    fut.set_exception(result)
        elif kind == serial.READY:
            info: EngineInfo = serial.decode_pickled(frame)
            assert self._ready is not None
            if not self._ready.done():
                self._ready.set_result(info)
        elif kind == serial.FATAL:
            exc = serial.decode_pickled(frame)
            assert self._proc is not None
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(exc)
            self._mark_dead(self._proc.exit_reason(exc))

    def _mark_dead(self, reason: str) -> None:
        proc = self._proc
        if proc is None:
            return
        first = proc.dead is None
        if first:
            proc.dead = reason
        self._stop_reading()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        if first and not self._closing:
            logger.error("engine %s: %s", self.name, reason)
            if self._on_dead is not None:
                self._on_dead(reason)

    # ------------------------------------------------------------------ calls

    def _send(
        self, name: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> asyncio.Future[Any]:
        """Send one command; the future its REPLY resolves."""
        proc = self._proc
        if proc is None:
            raise EngineDeadError("the engine was not started")
        assert self._loop is not None
        call_id = proc.next_call_id()
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = fut
        try:
            proc.send(call_id, name, args, kwargs)
        except EngineDeadError:
            self._pending.pop(call_id, None)
            raise
        return fut

    async def call(self, op: EngineOp[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._send(op.name, args, kwargs)  # type: ignore[no-any-return]

    def tell(self, op: EngineOp[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        _check_tell(op)
        proc = self._proc
        if proc is None or proc.dead is not None:
            return
        with contextlib.suppress(EngineDeadError):
            proc.send(0, op.name, args, kwargs)

    async def ping(self) -> int:
        """The number of steps the engine has run (proves its loop is turning)."""
        return await self._send(serial.PING)  # type: ignore[no-any-return]
