"""EngineCoreProc: one EngineCore's busy loop in a process of its own.

    client process                          engine-core process
    ──────────────                          ───────────────────
    command pipe ── COMMAND frames ──▶ input thread ─▶ queue ─┐
                                                               ▼
                                       busy loop: commands (in order), then engine.step()
    output pipe ◀── READY / STEP / REPLY ── output thread ◀─ queue ◀─┘

The engine and the service that feeds it no longer share one GIL: the process spends its
time on the model, the scheduler and encoding one frame per step (`tandem.engine.serial`).
Commands run in arrival order, all of them before the next step, so a command sees the
effects of every earlier one, and a reply leaves before the outputs of any later step. A
command names an engine operation (dispatched through the one table, `tandem.engine.ops`, to
the EngineCore method) or a control command (`ping`, `shutdown`). Under late planning
(`--async-scheduling late`) the loop also takes commands while a step runs, until shortly
before it is predicted to end (`take_commands_until`): requests that arrive meanwhile join the
next step.

The KV cache is shared with the client process: on CUDA through an IPC handle of its storage
(the client opens it; peers receive the same handle), on the CPU by moving the storage into a
shared-memory file before the first step (views keep working: the storage is moved in
place). The client process reads and writes blocks there (KV hand-off) while this process
owns their allocation.

The process exits when its command pipe closes (the client went away), on SHUTDOWN, or when
a step raises (after a FATAL frame naming the error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tandem.config import EngineConfig
from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.core.outputs import EngineCoreOutput, FinishReason
from tandem.engine import serial
from tandem.engine.core import EngineCore, InvalidRequestError
from tandem.engine.ops import ENGINE_OPS
from tandem.request import EngineCoreRequest
from tandem.worker.shared_kv import SharedKVCache

logger = logging.getLogger(__name__)

_IDLE_STEP_PAUSE_S = 0.001
# How often late planning's wait looks whether the step in flight has landed.
_LATE_POLL_S = 0.0002

assert not {serial.PING, serial.SHUTDOWN} & ENGINE_OPS.keys(), "a control command is no op"


class WaitEnd(enum.Enum):
    """How late planning's wait ended."""

    DEADLINE = "deadline"  # the planned time came: the step in flight still runs
    LANDED = "landed"  # the step in flight finished first: the device waits for the plan
    STOP = "stop"  # a command asked the loop to stop


@dataclass(frozen=True)
class EngineProcOptions:
    """What the engine-core process does beyond stepping.

    `report_held_blocks`: with each step, the blocks every finished `hold_kv` request holds
    (a prefill worker sends them). `publish_cache_events`: with every frame, the prefix-cache
    changes since the last one (a worker that feeds the directory). `share_kv_cache`: export
    the KV cache to the client (needed for KV hand-off; off for unified workers).
    """

    report_held_blocks: bool = False
    publish_cache_events: bool = False
    share_kv_cache: bool = False


@dataclass(frozen=True)
class EngineInfo:
    """An engine's constants, sent once when it is ready."""

    pid: int
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    model_path: str
    kv_device: str
    # Rank 0's cache, and every rank's in rank order (one engine of several ranks).
    shared_kv_cache: SharedKVCache | None
    shared_kv_caches: tuple[SharedKVCache, ...] = ()
    # The cache's groups by attention kind (a KV hand-off moves entries of each group).
    kv_cache_spec: KVCacheSpec | None = None

    @classmethod
    def of(
        cls, engine: EngineCore, pid: int, shared: tuple[SharedKVCache, ...] | None
    ) -> EngineInfo:
        return cls(
            pid=pid,
            block_size=engine.block_size,
            num_blocks=engine.num_blocks,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_id=engine.eos_token_id,
            model_path=str(engine.model_path),
            kv_device=engine.executor.device.type,
            shared_kv_cache=shared[0] if shared else None,
            shared_kv_caches=shared or (),
            kv_cache_spec=engine.kv_cache_spec,
        )


class _Stop:
    pass


def share_kv_caches(engine: EngineCore) -> tuple[SharedKVCache, ...]:
    """Export every rank's KV cache, in rank order (from the processes they live in); call
    before the first step."""
    return engine.executor.export_kv_caches()


class EngineCoreProc:
    """The busy loop of one engine in its own process (see the module docstring)."""

    def __init__(
        self,
        engine: EngineCore,
        options: EngineProcOptions,
        commands: Connection,
        outputs: Connection,
    ) -> None:
        self.engine = engine
        self.options = options
        self._commands = commands
        self._outputs = outputs
        self._inbox: queue.SimpleQueue[serial.Command | _Stop] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[bytes | _Stop] = queue.SimpleQueue()
        self._cache_events: list[tuple[list[bytes], list[bytes]]] = []
        self._held: dict[str, list[int]] = {}
        # What the last frame said of the engine's work (an idle engine says so once).
        self._said_unfinished = False
        self.num_steps = 0
        # Late planning's waits by how they ended, and their time (logged at exit).
        self.late_waits = dict.fromkeys((WaitEnd.DEADLINE, WaitEnd.LANDED), 0)
        self.late_wait_s = 0.0
        if options.publish_cache_events:
            engine.scheduler.kv_cache_manager.publish_cache_events(self._record_cache_event)
        self._reader = threading.Thread(target=self._read_commands, name="engine-in", daemon=True)
        self._writer = threading.Thread(target=self._write_outputs, name="engine-out", daemon=True)

    # ------------------------------------------------------------------ threads

    def _read_commands(self) -> None:
        try:
            while True:
                self._inbox.put(serial.decode_command(self._commands.recv_bytes()))
        except (EOFError, OSError):
            self._inbox.put(_Stop())  # the client went away

    def _write_outputs(self) -> None:
        while True:
            frame = self._outbox.get()
            if isinstance(frame, _Stop):
                return
            try:
                self._outputs.send_bytes(frame)
            except (BrokenPipeError, OSError):
                return

    def _record_cache_event(self, added: list[bytes], evicted: list[bytes]) -> None:
        self._cache_events.append((list(added), list(evicted)))

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self._reader.start()
        self._writer.start()
        try:
            self._loop()
        finally:
            if any(self.late_waits.values()):
                logger.info(
                    "late planning: %d waits ended by their deadline, %d by the step landing "
                    "first (the device then waited for a plan); %.1f s waited in all",
                    self.late_waits[WaitEnd.DEADLINE],
                    self.late_waits[WaitEnd.LANDED],
                    self.late_wait_s,
                )
            self._outbox.put(_Stop())
            self._writer.join(timeout=5.0)

    def _piggyback(self) -> serial.Piggyback:
        unfinished = self.engine.has_unfinished_requests()
        pig = serial.Piggyback(stats=self.engine.stats(), has_unfinished_requests=unfinished)
        self._said_unfinished = unfinished
        if self._held:
            pig.held_block_ids, self._held = self._held, {}
        if self._cache_events:
            pig.cache_events, self._cache_events = self._cache_events, []
        return pig

    def _run_command(self, item: serial.Command) -> bool:
        """Run one command; False when it asks the loop to stop."""
        call_id, name, args, kwargs = item
        if name == serial.SHUTDOWN:
            if call_id:
                self._outbox.put(serial.encode_reply(call_id, True, None, self._piggyback()))
            return False
        try:
            result = self.num_steps if name == serial.PING else self._run_op(name, args, kwargs)
        except Exception as exc:
            if not call_id:
                logger.warning("engine command %s failed: %s", name, exc)
                return True
            if not isinstance(exc, InvalidRequestError | KeyError | ValueError):
                logger.exception("engine command %s failed", name)
            self._outbox.put(serial.encode_reply(call_id, False, _portable(exc), self._piggyback()))
            return True
        if call_id:
            self._outbox.put(serial.encode_reply(call_id, True, result, self._piggyback()))
        return True

    def _run_op(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One engine operation, by its entry in the table."""
        op = ENGINE_OPS.get(name)
        if op is None:
            raise ValueError(f"unknown engine operation {name!r}")
        for arg in (*args, *kwargs.values()):
            # Request ids travel NUL-joined in STEP frames.
            if isinstance(arg, EngineCoreRequest) and "\x00" in arg.request_id:
                raise InvalidRequestError("request id must not contain NUL characters")
        return getattr(self.engine, op.name)(*args, **kwargs)

    def _loop(self) -> None:
        engine = self.engine
        inbox = self._inbox
        while True:
            busy = engine.has_unfinished_requests()
            if not busy and self._said_unfinished:
                # The engine ran out of work with no frame saying so (an abort's steps
                # produced no output, a told command): say it before waiting.
                self._outbox.put(serial.encode_step([], self._piggyback()))
            try:
                item = inbox.get(block=not busy)
            except queue.Empty:
                item = None
            while item is not None:
                if isinstance(item, _Stop) or not self._run_command(item):
                    return
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    item = None
            if not engine.has_unfinished_requests():
                continue
            deadline = engine.plan_deadline()
            if deadline is not None:
                waited = time.perf_counter()
                end = take_commands_until(
                    inbox, deadline, engine.in_flight_landed, self._run_unless_stop
                )
                if end is WaitEnd.STOP:
                    return
                self.late_waits[end] += 1
                self.late_wait_s += time.perf_counter() - waited
            t0 = time.perf_counter()
            outputs = engine.step()
            self.num_steps += 1
            if self.options.report_held_blocks:
                self._collect_held(outputs)
            if outputs or self._held or self._cache_events:
                self._outbox.put(serial.encode_step(outputs, self._piggyback()))
            elif engine.last_step_idle and time.perf_counter() - t0 < _IDLE_STEP_PAUSE_S:
                # Work remains but nothing could be scheduled: wait for a command briefly
                # rather than spin.
                try:
                    item = inbox.get(timeout=_IDLE_STEP_PAUSE_S)
                except queue.Empty:
                    continue
                if isinstance(item, _Stop) or not self._run_command(item):
                    return

    def _run_unless_stop(self, item: serial.Command | _Stop) -> bool:
        return not isinstance(item, _Stop) and self._run_command(item)

    def _collect_held(self, outputs: list[EngineCoreOutput]) -> None:
        """The KV blocks each finished prefill holds, read before anything can change them."""
        held = self.engine.scheduler.held
        done = (FinishReason.STOP, FinishReason.LENGTH)
        for out in outputs:
            if out.finish_reason in done and out.request_id in held:
                self._held[out.request_id] = self.engine.get_held_block_ids(out.request_id)


def take_commands_until(
    inbox: queue.SimpleQueue[Any],
    deadline: float,
    landed: Callable[[], bool],
    run: Callable[[Any], bool],
) -> WaitEnd:
    """Late planning's wait (`EngineCore.plan_deadline`): run the commands that arrive until
    `deadline` (`time.perf_counter()`) or until `landed()`, whichever is first, polling every
    `_LATE_POLL_S`; STOP as soon as `run` returns False (a command asked the loop to stop)."""
    while True:
        if landed():
            return WaitEnd.LANDED
        left = deadline - time.perf_counter()
        if left <= 0:
            return WaitEnd.DEADLINE
        try:
            item = inbox.get(timeout=min(left, _LATE_POLL_S))
        except queue.Empty:
            continue
        if not run(item):
            return WaitEnd.STOP


def run_engine_core(
    config: EngineConfig,
    options: EngineProcOptions,
    commands: Connection,
    outputs: Connection,
    log_level: int = logging.INFO,
) -> None:
    """Entry point of the engine-core process (spawned by an MP client)."""
    logging.basicConfig(
        level=log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.device.cpu_cores == "auto":
        # This process runs only the engine: a CPU engine binds its threads to its cores.
        from tandem.worker.cpu_threads import engine_process_cpu_cores

        cores = engine_process_cpu_cores(config.device)
        config = dataclasses.replace(
            config, device=dataclasses.replace(config.device, cpu_cores=cores)
        )
    try:
        engine = EngineCore(config)
        shared = share_kv_caches(engine) if options.share_kv_cache else None
        info = EngineInfo.of(engine, os.getpid(), shared)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            outputs.send_bytes(serial.encode_pickled(serial.FATAL, _portable(exc)))
        raise
    outputs.send_bytes(serial.encode_pickled(serial.READY, info))
    proc = EngineCoreProc(engine, options, commands, outputs)
    code = 0
    try:
        proc.run()
    except BaseException as exc:
        logger.exception("engine-core loop failed")
        with contextlib.suppress(Exception):
            outputs.send_bytes(serial.encode_pickled(serial.FATAL, _portable(exc)))
        code = 1
    # Every frame is written (the output thread was joined). Leave without the interpreter's
    # teardown, which takes seconds on a busy machine (torch, the model, a shared KV cache
    # file): the OS frees the process's memory, and a worker's stop is not held up by it.
    logging.shutdown()
    os._exit(code)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
