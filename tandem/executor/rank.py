"""One rank of a `MultiprocExecutor`: a process that owns a `Worker` and serves its executor.

    executor (engine process)                         rank r (this module's `main`)
      ── spawn (RankSpec on stdin) ──────────────────>  connect to the command channel, HELLO
                                                       Worker(rank r): device, groups, model
      <─────────────────────────── READY(info) | FAILED(traceback)
      ── STEP(seq, scheduler output, grammar?) ──────>  execute_async (every rank)
      ── BITMASK ───────────────────────────────────>  (last stage, grammar steps only)
      <─────────────────────────── OUTPUT(seq, ModelRunnerOutput)   (the driver rank only)
      ── CALL(method, args, reply?) ────────────────>  getattr(worker, method)(*args)
      <─────────────────────────── REPLY(value) | ERROR(traceback)
      ── STOP ──────────────────────────────────────>  shutdown, leave the groups, exit 0

Messages are pickled `RankMessage`s over one `multiprocessing.connection.Connection` per rank
(a TCP socket, so a rank may sit on another host). Steps are launched as they arrive; the driver
sends each step's output once its sampled ids are on the host, but launches a step that is
already waiting first, so the device never idles on the host's round trip (async scheduling
across the process boundary). A rank exits when its channel closes (the engine is gone) and,
on Linux, is killed with its parent process (`PR_SET_PDEATHSIG`), even inside a collective.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import pickle
import signal
import socket
import sys
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.distributed.init import DistributedInit

logger = logging.getLogger(__name__)

# How long the driver waits for the next command before it checks its launched steps.
_POLL_S = 50e-6


class MsgKind(enum.Enum):
    HELLO = "hello"  # rank -> executor: (rank, authkey)
    READY = "ready"  # rank -> executor: RankInfo
    FAILED = "failed"  # rank -> executor: traceback text (start-up failed)
    STEP = "step"  # executor -> ranks: (seq, SchedulerOutput, has_grammar)
    BITMASK = "bitmask"  # executor -> last-stage ranks: GrammarBitmask
    OUTPUT = "output"  # driver -> executor: (seq, ModelRunnerOutput)
    CALL = "call"  # executor -> ranks: (method, args, kwargs, want_reply)
    REPLY = "reply"  # rank -> executor: the call's value
    ERROR = "error"  # rank -> executor: traceback text (a call or a step failed)
    STOP = "stop"  # executor -> ranks


@dataclass(frozen=True)
class RankMessage:
    kind: MsgKind
    payload: Any = None


@dataclass(frozen=True)
class RankSpec:
    """What a rank process is started with (pickled on its stdin)."""

    config: EngineConfig
    model_path: Path
    hf_config: Any
    max_model_len: int
    eos_token_id: int | None
    local_rank: int
    dist_init: DistributedInit
    # The executor's command channel (host, port) and the key a rank proves itself with.
    channel: tuple[str, int]
    authkey: bytes


@dataclass(frozen=True)
class RankInfo:
    """What the executor learns of a started rank."""

    rank: int
    pid: int
    device: str
    vocab_size: int
    kv_cache_spec: KVCacheSpec
    is_driver: bool
    is_last_stage: bool


def send(conn: Connection, kind: MsgKind, payload: Any = None) -> None:
    conn.send_bytes(pickle.dumps(RankMessage(kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> RankMessage:
    msg = pickle.loads(conn.recv_bytes())
    assert isinstance(msg, RankMessage)
    return msg


def connect(channel: tuple[str, int], rank: int, authkey: bytes) -> Connection:
    """This rank's end of the command channel (a TCP socket; HELLO sent)."""
    sock = socket.create_connection(channel, timeout=60)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Connection(sock.detach())
    send(conn, MsgKind.HELLO, (rank, authkey))
    return conn


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it exits."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent left before the call took effect
        os._exit(1)


class RankServer:
    """The rank's loop over its command channel (see the module docstring)."""

    def __init__(self, conn: Connection, worker: Any, info: RankInfo) -> None:
        self.conn = conn
        self.worker = worker
        self.info = info
        # Launched steps whose output the driver has not sent yet, in launch order.
        self.pending: deque[tuple[int, Any]] = deque()

    def flush(self, wait: bool) -> None:
        """Send the outputs of launched steps that are done (all of them when `wait`)."""
        while self.pending and (wait or self.pending[0][1].is_ready()):
            seq, step = self.pending.popleft()
            send(self.conn, MsgKind.OUTPUT, (seq, step.result()))

    def next_message(self) -> RankMessage:
        """The next command; meanwhile the driver sends outputs as their steps finish."""
        while self.pending and not self.conn.poll(_POLL_S):
            self.flush(wait=False)
        return recv(self.conn)

    def grammar_source(self) -> Any:
        """The bitmask of a grammar step: the executor fills it once this rank's forward is
        launched, after it has read the previous step's output, so flush that first."""

        def source() -> Any:
            self.flush(wait=True)
            msg = recv(self.conn)
            if msg.kind is not MsgKind.BITMASK:
                raise RuntimeError(f"expected the step's grammar bitmask, got {msg.kind}")
            return msg.payload

        return source

    def run(self) -> None:
        while True:
            try:
                msg = self.next_message()
            except EOFError:
                logger.error("rank %d: the executor closed the channel", self.info.rank)
                return
            if msg.kind is MsgKind.STOP:
                self.flush(wait=True)
                return
            try:
                if msg.kind is MsgKind.STEP:
                    seq, so, has_grammar = msg.payload
                    grammar = has_grammar and self.info.is_last_stage
                    source = self.grammar_source() if grammar else None
                    step = self.worker.execute_async(so, source)
                    if self.info.is_driver:
                        self.pending.append((seq, step))
                        if not step.is_async:
                            self.flush(wait=True)
                elif msg.kind is MsgKind.CALL:
                    method, args, kwargs, want_reply = msg.payload
                    self.flush(wait=True)
                    value = getattr(self.worker, method)(*args, **kwargs)
                    if want_reply:
                        send(self.conn, MsgKind.REPLY, value)
                else:
                    raise RuntimeError(f"unexpected message {msg.kind}")
            except BaseException:
                text = traceback.format_exc()
                logger.error("rank %d failed:\n%s", self.info.rank, text)
                send(self.conn, MsgKind.ERROR, text)
                raise


def main() -> None:
    """Entry point of a rank process (`start_rank` runs it), a `RankSpec`
    pickled on stdin."""
    die_with_parent()
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    rank = spec.dist_init.rank
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
    )
    conn = connect(spec.channel, rank, spec.authkey)
    try:
        from tandem.worker.worker import Worker

        worker = Worker(
            spec.config,
            spec.model_path,
            spec.hf_config,
            spec.max_model_len,
            spec.eos_token_id,
            rank=rank,
            local_rank=spec.local_rank,
            dist_init=spec.dist_init,
        )
        runner = worker.model_runner
        assert worker.parallel is not None
        info = RankInfo(
            rank=rank,
            pid=os.getpid(),
            device=str(worker.device),
            vocab_size=runner.vocab_size,
            kv_cache_spec=runner.kv_cache_spec,
            is_driver=worker.parallel.is_driver,
            is_last_stage=runner.is_last_stage,
        )
    except BaseException:
        send(conn, MsgKind.FAILED, traceback.format_exc())
        raise
    send(conn, MsgKind.READY, info)
    code = 0
    try:
        RankServer(conn, worker, info).run()
    except BaseException:
        code = 1
    finally:
        try:
            worker.shutdown()
            from tandem.distributed.init import destroy_parallel_state

            destroy_parallel_state()
        except Exception:
            logger.exception("rank %d: shutdown failed", rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
