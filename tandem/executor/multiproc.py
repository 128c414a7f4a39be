"""One worker process per rank, started and watched by the engine's process.

    engine process                                     rank processes (tandem.executor.rank)
    EngineCore ── MultiprocExecutor ── TCPStore ──────  c10d rendezvous (torch.distributed)
                                   └── channel (TCP) ── rank 0 .. W-1: Worker, ModelRunner

- Start: the executor serves a c10d `TCPStore` (`master_addr:master_port`, where every rank
  meets to form its NCCL / gloo groups) and a command channel (a TCP listener whose address it
  writes into the store). It starts this host's ranks (`python -m tandem.executor.rank`, a
  `RankSpec` on stdin); on other hosts `tandem rank-host` starts theirs (`serve_rank_host`).
  Each rank connects, proves the key, builds its Worker and says READY (or FAILED with its
  traceback: the executor stops every rank and raises, naming the rank and the error).
- Steps: every step's scheduler output is pickled once and written to every rank's channel;
  a grammar step's bitmask follows to the last stage's ranks. Only the driver (the last
  stage's first TP rank) answers, one OUTPUT per step; `RemoteStep.result()` waits for it.
- `collective_rpc(method, ...)` is the one way to call every rank's Worker; it answers with
  each rank's value, in rank order.
- Failure: a rank that exits, closes its channel or reports an error fails the executor at
  once (`RankFailedError`, naming the rank and how it ended): every rank process is killed and
  reaped, and every later call raises the same error. A rank dies with the engine's process
  (`PR_SET_PDEATHSIG`) and leaves when its channel closes.
- Sizes: the KV cache holds what the rank with the least free memory can (`determine_num_blocks`
  is the minimum over ranks); each rank holds its own heads' share of every block.

On one host with one rank, the in-process `UniprocExecutor` stays the default (see
`ParallelConfig.uses_multiproc`); `--distributed-executor-backend mp` runs one rank here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import os
import pickle
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

import tandem
from tandem.config import ConfigError, DeviceConfig, EngineConfig, parse_core_list
from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.core.outputs import GrammarBitmaskSource, ModelRunnerOutput, SchedulerOutput
from tandem.distributed.init import STORE_PREFIX, DistributedInit, connect_store
from tandem.executor.base import Executor
from tandem.executor.rank import MsgKind, RankInfo, RankMessage, RankSpec, recv
from tandem.worker.shared_kv import SharedKVCache, open_shared_kv_cache

logger = logging.getLogger(__name__)

# Every process an executor starts keeps NVLink multicast off (it can take a host's GPUs down).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_CHANNEL_KEY = "executor_channel"
_AUTHKEY_KEY = "executor_authkey"
_START_TIMEOUT_S = 600.0
_STOP_GRACE_S = 5.0
_WATCH_S = 0.5


class RankFailedError(RuntimeError):
    """A rank of the engine exited, closed its channel or failed; the message says which and
    how. The executor is unusable afterwards."""


def rank_device_configs(device: DeviceConfig, num_local: int) -> list[DeviceConfig]:
    """Each local rank's device settings. CPU ranks split the cores this process may use (or
    those `cpu_cores` lists) into disjoint runs, one thread per core; GPU ranks keep theirs
    (rank i takes GPU `device_index + i`)."""
    if device.resolved_device() != "cpu":
        return [device] * num_local
    from tandem.worker.cpu_threads import process_cpu_cores

    spec = device.cpu_cores
    cores = list(parse_core_list(spec) if spec not in ("auto", "all", "none") else ())
    cores = cores or list(process_cpu_cores()) or list(range(os.cpu_count() or 1))
    if device.num_threads > 0:
        cores = cores[: device.num_threads * num_local]
    out = []
    for i in range(num_local):
        mine = cores[i * len(cores) // num_local : (i + 1) * len(cores) // num_local]
        mine = mine or [cores[i % len(cores)]]
        text = ",".join(str(c) for c in mine)
        cpu_cores = "none" if spec == "none" else text
        out.append(dataclasses.replace(device, cpu_cores=cpu_cores, num_threads=len(mine)))
    return out


def check_devices(device: str, device_index: int | None, num_local: int) -> None:
    """Raise ConfigError when this host's ranks need more GPUs than are visible."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = (device_index or 0) + num_local
    if need > count:
        raise ConfigError(
            f"{num_local} ranks on this host from GPU {device_index or 0} needs {need} GPUs, "
            f"but {count} are visible"
        )


def rank_env() -> dict[str, str]:
    """A rank process's environment: this one's, multicast off, and tandem importable."""
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    root = str(Path(tandem.__file__).resolve().parents[1])
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    return env


def start_rank(spec: RankSpec) -> subprocess.Popen[bytes]:
    """Start one rank process on this host."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tandem.executor.rank import main; main()"],
        stdin=subprocess.PIPE,
        env=rank_env(),
    )
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
    proc.stdin.close()
    return proc


def describe_exit(proc: subprocess.Popen[bytes] | None) -> str:
    if proc is None:
        return "on another host"
    code = proc.poll()
    if code is None:
        return f"pid {proc.pid}, still running"
    if code < 0:
        return f"pid {proc.pid}, killed by {signal.Signals(-code).name}"
    return f"pid {proc.pid}, exit code {code}"


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Wait up to `grace_s` for `procs` to exit, then kill and reap the rest."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class RemoteStep:
    """A step launched on the ranks; `result()` waits for the driver's output of it."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor = executor
        self.seq = seq
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor.step_output(self.seq)
        return self._output


class MultiprocExecutor(Executor):
    """Drives one rank process per rank (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        hf_config: Any,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> None:
        super().__init__(config, model_path, hf_config, max_model_len, eos_token_id)
        par = config.parallel
        self.world_size = par.world_size
        self._procs: list[subprocess.Popen[bytes]] = []
        self._proc_of: dict[int, subprocess.Popen[bytes]] = {}
        self._conns: dict[int, Connection] = {}
        self._rank_of: dict[Connection, int] = {}
        self._infos: dict[int, RankInfo] = {}
        self._failure: RankFailedError | None = None
        self._shut_down = False
        # Step outputs by sequence number, and call replies by rank, as they arrive.
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._replies: dict[int, list[Any]] = {}
        self._next_seq = 0
        self._last_output_seq = -1
        self._synced_seq = -1
        # Requests whose sampling reads their whole output (mirrors the runners' InputBatch).
        self._history: set[str] = set()
        self._kv_cache: torch.Tensor | None = None
        self._shared_kv: SharedKVCache | None = None
        host = par.master_addr if par.nnodes > 1 else "127.0.0.1"
        self._store = torch.distributed.TCPStore(
            host, par.master_port, None, True, wait_for_workers=False
        )
        self.master_port = int(self._store.port)
        self._listener = socket.create_server((host, 0))
        authkey = secrets.token_bytes(16)
        channel = (host, int(self._listener.getsockname()[1]))
        prefixed = torch.distributed.PrefixStore(STORE_PREFIX, self._store)
        prefixed.set(_CHANNEL_KEY, f"{channel[0]}:{channel[1]}")
        prefixed.set(_AUTHKEY_KEY, authkey.hex())
        try:
            check_devices(
                config.device.resolved_device(), config.device.device_index, par.ranks_per_node
            )
            devices = rank_device_configs(config.device, par.ranks_per_node)
            for local_rank in range(par.ranks_per_node):
                spec = self._spec(local_rank, local_rank, devices[local_rank], channel, authkey)
                proc = start_rank(spec)
                self._procs.append(proc)
                self._proc_of[local_rank] = proc
            self._accept(authkey)
            self._wait_ready()
        except BaseException:
            self._kill_all()
            raise
        self.driver_rank = next(r for r, i in self._infos.items() if i.is_driver)
        self._last_stage = [r for r, i in sorted(self._infos.items()) if i.is_last_stage]
        logger.info(
            "multiprocess executor: %d ranks (tp %d x pp %d), driver rank %d",
            self.world_size,
            par.tensor_parallel_size,
            par.pipeline_parallel_size,
            self.driver_rank,
        )

    def _spec(
        self,
        rank: int,
        local_rank: int,
        device: DeviceConfig,
        channel: tuple[str, int],
        authkey: bytes,
    ) -> RankSpec:
        par = self.config.parallel
        return RankSpec(
            config=dataclasses.replace(self.config, device=device),
            model_path=self.model_path,
            hf_config=self.hf_config,
            max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id,
            local_rank=local_rank,
            dist_init=DistributedInit(
                master_addr=par.master_addr if par.nnodes > 1 else "127.0.0.1",
                master_port=self.master_port,
                rank=rank,
                world_size=self.world_size,
                tp_size=par.tensor_parallel_size,
                pp_size=par.pipeline_parallel_size,
            ),
            channel=channel,
            authkey=authkey,
        )

    # ----------------------------------------------------------------- start-up

    def _accept(self, authkey: bytes) -> None:
        """Take every rank's channel (local ranks are watched while they connect)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(self._conns) < self.world_size:
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"{self.world_size - len(self._conns)} ranks did not connect in "
                    f"{_START_TIMEOUT_S:.0f}s"
                )
            self._check_processes()
            ready, _, _ = select.select([self._listener], [], [], _WATCH_S)
            if not ready:
                continue
            sock, _ = self._listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock.detach())
            if not conn.poll(30):
                conn.close()
                continue
            msg = recv(conn)
            rank, key = msg.payload
            if msg.kind is not MsgKind.HELLO or not hmac.compare_digest(key, authkey):
                conn.close()
                logger.warning("refused a connection that is not one of this engine's ranks")
                continue
            self._conns[rank] = conn
            self._rank_of[conn] = rank
            self._replies[rank] = []

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(self._infos) < self.world_size:
            if time.monotonic() > deadline:
                silent = ", ".join(
                    f"rank {r} ({describe_exit(self._proc_of.get(r))})"
                    for r in sorted(self._conns)
                    if r not in self._infos
                )
                raise RankFailedError(
                    f"ranks did not start in {_START_TIMEOUT_S:.0f}s: {silent} connected but "
                    "never reported ready"
                )
            waiting = [c for r, c in self._conns.items() if r not in self._infos]
            for conn in wait(waiting, timeout=_WATCH_S):
                rank = self._rank_of[conn]
                try:
                    msg = recv(conn)
                except (EOFError, OSError):
                    raise self._fail(f"rank {rank} failed to start ({self._exit(rank)})") from None
                if msg.kind is MsgKind.FAILED:
                    self._check_processes(but=rank)
                    raise self._fail(f"rank {rank} failed to start: {_last_line(msg.payload)}")
                assert msg.kind is MsgKind.READY
                self._infos[rank] = msg.payload
            self._check_processes()

    # ----------------------------------------------------------------- failure

    def _exit(self, rank: int) -> str:
        proc = self._proc_of.get(rank)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
        return describe_exit(proc)

    def _check_processes(self, but: int | None = None) -> None:
        """Fail naming the first rank process that exited (a rank's error that follows from
        another's death names the dead one). `but`: a rank expected to exit."""
        for rank, proc in self._proc_of.items():
            if rank != but and proc.poll() is not None:
                raise self._fail(f"rank {rank} died ({describe_exit(proc)})")

    def _fail(self, reason: str) -> RankFailedError:
        """Stop every rank and remember why; the error to raise."""
        if self._failure is None:
            logger.error("engine ranks failed: %s", reason)
            self._failure = RankFailedError(reason)
            self._kill_all()
        return self._failure

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        stop_processes(self._procs, 0.0)
        self._close_channels()

    def _close_channels(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._rank_of.clear()
        self._listener.close()

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._shut_down:
            raise RuntimeError("the executor is shut down")

    # ----------------------------------------------------------------- channel

    def _send(self, ranks: Sequence[int], kind: MsgKind, payload: Any = None) -> None:
        data = pickle.dumps(RankMessage(kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in ranks:
            try:
                self._conns[rank].send_bytes(data)
            except (OSError, EOFError):
                raise self._fail(f"rank {rank} closed its channel ({self._exit(rank)})") from None

    def _pump(self, done: Callable[[], bool]) -> None:
        """Read what the ranks send until `done()`; a rank that ends or errs fails us."""
        while not done():
            self._check_usable()
            ready = wait(list(self._conns.values()), timeout=_WATCH_S)
            if not ready:
                self._check_processes()
                continue
            for conn in ready:
                rank = self._rank_of[conn]
                try:
                    msg = recv(conn)
                except (EOFError, OSError):
                    how = self._exit(rank)  # waits for the process to be gone
                    self._check_processes()
                    raise self._fail(f"rank {rank} died ({how})") from None
                if msg.kind is MsgKind.OUTPUT:
                    seq, output = msg.payload
                    self._outputs[seq] = output
                    self._last_output_seq = max(self._last_output_seq, seq)
                elif msg.kind is MsgKind.REPLY:
                    self._replies[rank].append(msg.payload)
                elif msg.kind is MsgKind.ERROR:
                    time.sleep(0.1)  # a rank that died first is the cause: name it
                    self._check_processes(but=rank)
                    raise self._fail(f"rank {rank} failed: {_last_line(msg.payload)}")
                else:
                    raise self._fail(f"rank {rank} sent an unexpected {msg.kind}")

    def collective_rpc(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int] | None = None,
        reply: bool = True,
        **kwargs: Any,
    ) -> list[Any]:
        """Call `method` of every rank's Worker (or of `ranks`'); each one's value, in rank
        order (nothing when `reply` is False: the call is only sent)."""
        self._check_usable()
        targets = sorted(ranks) if ranks is not None else list(range(self.world_size))
        self._send(targets, MsgKind.CALL, (method, args, kwargs, reply))
        if not reply:
            return []
        self._pump(lambda: all(self._replies[r] for r in targets))
        return [self._replies[r].pop(0) for r in targets]

    # ----------------------------------------------------------------- what rank 0 is

    @property
    def rank_pids(self) -> list[int | None]:
        """Each rank's process id (None: a rank on another host)."""
        return [
            self._proc_of[r].pid if r in self._proc_of else None for r in range(self.world_size)
        ]

    @property
    def device(self) -> torch.device:
        return torch.device(self._infos[0].device)

    @property
    def vocab_size(self) -> int:
        return self._infos[self.driver_rank].vocab_size

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self._infos[0].kv_cache_spec

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """Rank 0's KV cache, opened in this process (host-local ranks only)."""
        if self._kv_cache is None and not self._shut_down and self._failure is None:
            self._kv_cache = open_shared_kv_cache(self.export_kv_cache())
        return self._kv_cache

    def export_kv_cache(self, rank: int = 0) -> SharedKVCache:
        if rank == 0 and self._shared_kv is not None:
            return self._shared_kv
        (shared,) = self.collective_rpc("export_kv_cache", ranks=[rank])
        if rank == 0:
            self._shared_kv = shared
        return shared

    def export_kv_caches(self) -> tuple[SharedKVCache, ...]:
        if self.config.parallel.nnodes > 1:
            raise RuntimeError("ranks on other hosts cannot share their KV caches with this one")
        shared = tuple(self.collective_rpc("export_kv_cache"))
        self._shared_kv = shared[0]
        return shared

    # ----------------------------------------------------------------- collective

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_async(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: GrammarBitmaskSource | None = None,
    ) -> RemoteStep:
        self._check_usable()
        seq = self._next_seq
        self._next_seq += 1
        payload = (seq, scheduler_output, grammar_bitmask is not None)
        self._send(range(self.world_size), MsgKind.STEP, payload)
        self._track_history(scheduler_output)
        if grammar_bitmask is not None:
            self._send(self._last_stage, MsgKind.BITMASK, grammar_bitmask())
        return RemoteStep(self, seq)

    def step_output(self, seq: int) -> ModelRunnerOutput:
        """The driver's output of step `seq` (waits for it)."""
        self._pump(lambda: seq in self._outputs)
        return self._outputs.pop(seq)

    def _track_history(self, so: SchedulerOutput) -> None:
        self._history -= so.finished_req_ids | so.preempted_req_ids
        self._history |= {
            r.req_id for r in so.scheduled_new_reqs if r.sampling_params.needs_output_history
        }

    def drop_requests(self, req_ids: set[str]) -> None:
        self._history -= req_ids
        self.collective_rpc("drop_requests", req_ids, reply=False)

    def needs_prior_tokens(self, scheduler_output: SchedulerOutput) -> bool:
        so = scheduler_output
        if any(r.sampling_params.needs_output_history for r in so.scheduled_new_reqs):
            return True
        return bool(self._history) and any(
            r.req_id in self._history for r in so.scheduled_cached_reqs
        )

    def may_write_blocks(self, block_ids: list[int]) -> bool:
        # The driver's output of step s means every rank finished step s (its logits needed
        # every TP rank's and every earlier stage's layers): only later steps may still write.
        if not block_ids:
            return False
        return self._next_seq - 1 > max(self._last_output_seq, self._synced_seq)

    def take_expert_load(self) -> list[list[int]] | None:
        # Every TP rank routes every token of its stage: the first TP rank of each stage
        # holds that stage's layers' load; stages in order give the whole model's.
        par = self.config.parallel
        tp = par.tensor_parallel_size
        firsts = [stage * tp for stage in range(par.pipeline_parallel_size)]
        parts = self.collective_rpc("take_expert_load", ranks=firsts)
        if all(p is None for p in parts):
            return None
        return [row for part in parts if part is not None for row in part]

    def synchronize(self) -> None:
        self.collective_rpc("synchronize")
        self._synced_seq = self._next_seq - 1

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        self._kv_cache = None
        if self._failure is None and self._conns:
            with contextlib.suppress(RankFailedError):
                self._send(list(self._conns), MsgKind.STOP)
        stop_processes(self._procs, _STOP_GRACE_S)
        self._close_channels()


def _last_line(text: str) -> str:
    """The last line of a traceback (the exception and its message)."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def serve_rank_host(config: EngineConfig) -> int:
    """`tandem rank-host`: start this host's ranks of an engine whose executor runs on the
    host of node 0 (`master_addr:master_port`), and wait for them; the exit code is the
    first failing rank's (0 when all stopped cleanly)."""
    par = config.parallel
    if par.node_rank == 0:
        raise ValueError("node 0 runs the engine itself; rank-host is for --node-rank >= 1")
    from tandem.loader.resolve import resolve_engine_config

    config = resolve_engine_config(config)
    store = connect_store(par.master_addr, par.master_port, _START_TIMEOUT_S)
    host, port = store.get(_CHANNEL_KEY).decode().rsplit(":", 1)
    authkey = bytes.fromhex(store.get(_AUTHKEY_KEY).decode())
    devices = rank_device_configs(config.device, par.ranks_per_node)
    first = par.node_rank * par.ranks_per_node
    m = config.model
    from tandem.loader import get_eos_token_ids

    eos = get_eos_token_ids(m.model_path) if m.model_path is not None else []
    procs = []
    for local_rank in range(par.ranks_per_node):
        spec = RankSpec(
            config=dataclasses.replace(config, device=devices[local_rank]),
            model_path=m.model_path,  # type: ignore[arg-type]
            hf_config=m.hf_config,
            max_model_len=m.max_model_len,
            eos_token_id=eos[0] if eos else None,
            local_rank=local_rank,
            dist_init=DistributedInit(
                master_addr=par.master_addr,
                master_port=par.master_port,
                rank=first + local_rank,
                world_size=par.world_size,
                tp_size=par.tensor_parallel_size,
                pp_size=par.pipeline_parallel_size,
            ),
            channel=(host, int(port)),
            authkey=authkey,
        )
        procs.append(start_rank(spec))
    code = 0
    try:
        while procs:
            for proc in list(procs):
                status = proc.poll()
                if status is None:
                    continue
                procs.remove(proc)
                if status and not code:
                    code = status if status > 0 else 128 - status
                    stop_processes(procs, _STOP_GRACE_S)
            time.sleep(_WATCH_S)
    except KeyboardInterrupt:
        stop_processes(procs, 0.0)
        code = 130
    return code
