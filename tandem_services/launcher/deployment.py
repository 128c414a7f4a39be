"""The whole system as child processes on one machine (`tandem serve`, tests, benchmarks).

    scheduler ──▶ prefill worker(s) + decode worker (or unified worker(s)) ──▶ frontend

Each service runs as `python -m services.<name>` in its own session (so a Ctrl-C reaches only
this launcher), reports its bound addresses through a ready file, and is stopped in order on
Ctrl-C / SIGTERM: the frontend first (it finishes what clients are waiting for), then the
workers, then the scheduler. It lives with the services it starts: `tandem serve` execs
`python -m tandem_services.launcher` (tandem never imports the services).

GPUs: `--gpus 0,1` puts the workers on those GPUs round robin in role order (prefill workers,
then the decode worker; or each unified worker), as `--device cuda:<index>` on each worker's
command line. A worker of R = TP x PP ranks takes the next R GPUs of the list, which must be
consecutive indices (its rank r runs on `cuda:<first + r>`). Every worker still sees every GPU
(no CUDA_VISIBLE_DEVICES): NCCL and CUDA IPC between workers on different GPUs need both
visible. `worker_commands` is that plan, as data.

The workers' engine flags are the one definition in `tandem.config` (`engine_argv` turns
values back into flags); the command line itself is `tandem_services/launcher/cli.py`.

Prefix-cache directory: with `--redis-url` the scheduler reads, and the prefill workers
publish, which worker caches which prompt prefix in that Redis (a password travels in the
children's environment, TANDEM_REDIS_PASSWORD, never on their command lines). Without it
there is no shared directory (each service is its own process): the scheduler's prefix-aware
routing then goes by its own record of where it sent which prompts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tandem.config import world_size_from_argv
from tandem_services.common.channels import PLAINTEXT, TlsConfig
from tandem_services.common.tls import tls_argv
from tandem_services.directory.factory import DirectoryConfig

_STOP_ORDER = ("frontend", "prefill", "decode", "unified", "scheduler")


class LaunchError(RuntimeError):
    """A service failed to start; the message carries the end of its log when there is one."""


@dataclass(frozen=True)
class ServeConfig:
    model: str = "default"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    # 0: any free port.
    scheduler_port: int = 0
    unified: bool = False
    api_key: str = ""
    # Flags for the workers (engine arguments), passed through verbatim.
    worker_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    frontend_args: tuple[str, ...] = ()
    grace_period_s: float = 10.0
    # Service logs go to files here ("" : this process's stderr).
    log_dir: str = ""
    startup_timeout_s: float = 600.0
    python: str = sys.executable
    # Prefill workers (disaggregated): "prefill" (worker id prefill-0), "prefill-1", ...
    num_prefill_workers: int = 1
    # Unified workers (with `unified`): "unified" (worker id unified-0), "unified-1", ...
    num_unified_workers: int = 1
    # Decode workers (disaggregated): "decode" (worker id decode-0), "decode-1", ...
    num_decode_workers: int = 1
    # GPU indices the workers go to, round robin in role order (): `--device` as given).
    gpus: tuple[int, ...] = ()
    # The prefix-cache directory for the scheduler and the workers ("": none).
    directory: DirectoryConfig = field(default_factory=DirectoryConfig)
    # The scheduler's --routing ("": its default, prefix-aware).
    routing: str = ""
    # TLS between the services, passed to each as --tls-* flags (tandem_services.common.channels).
    tls: TlsConfig = PLAINTEXT

    def __post_init__(self) -> None:
        if self.grace_period_s < 0 or self.startup_timeout_s <= 0:
            raise ValueError("grace_period_s must be >= 0 and startup_timeout_s > 0")
        if self.num_prefill_workers < 1:
            raise ValueError(f"num_prefill_workers must be >= 1, got {self.num_prefill_workers}")
        if self.num_unified_workers < 1:
            raise ValueError(f"num_unified_workers must be >= 1, got {self.num_unified_workers}")
        if self.num_decode_workers < 1:
            raise ValueError(f"num_decode_workers must be >= 1, got {self.num_decode_workers}")
        if self.num_decode_workers > 1 and self.unified:
            raise ValueError("num_decode_workers > 1 needs disaggregated workers (no --unified)")
        if self.num_unified_workers > 1 and not self.unified:
            raise ValueError("num_unified_workers > 1 needs unified workers (--unified)")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"GPU indices must be >= 0, got {list(self.gpus)}")
        if self.gpus and "--device" in self.worker_args:
            raise ValueError(
                "--gpus sets each worker's --device (cuda:<index>); give --gpus or --device"
            )

    @property
    def worker_roles(self) -> list[tuple[str, str]]:
        """(service name, role) of each worker to start, in role order."""
        if self.unified:
            return [
                ("unified" if i == 0 else f"unified-{i}", "unified")
                for i in range(self.num_unified_workers)
            ]
        prefill = [
            ("prefill" if i == 0 else f"prefill-{i}", "prefill")
            for i in range(self.num_prefill_workers)
        ]
        decode = [
            ("decode" if i == 0 else f"decode-{i}", "decode")
            for i in range(self.num_decode_workers)
        ]
        return [*prefill, *decode]


@dataclass(frozen=True)
class WorkerCommand:
    """One worker to start: `python -m <module> <args>` under service name `name`."""

    name: str
    role: str
    worker_id: str
    module: str
    args: tuple[str, ...]

    @property
    def device(self) -> str:
        """The worker's --device ("auto" when not given)."""
        args = list(self.args)
        return args[args.index("--device") + 1] if "--device" in args else "auto"


def worker_gpus(gpus: Sequence[int], num_workers: int, ranks: int) -> list[int]:
    """The first GPU of each worker: worker i takes the next `ranks` GPUs of `gpus` (round
    robin), which must be consecutive indices (its ranks run on first, first + 1, ...)."""
    firsts = []
    for i in range(num_workers):
        block = [gpus[(i * ranks + r) % len(gpus)] for r in range(ranks)]
        if block != list(range(block[0], block[0] + ranks)):
            raise ValueError(
                f"worker {i} of {ranks} ranks would take GPUs {block}: a worker's ranks need "
                "consecutive GPU indices (give --gpus so that each run of "
                f"{ranks} is consecutive)"
            )
        firsts.append(block[0])
    return firsts


def worker_commands(config: ServeConfig, scheduler_address: str) -> list[WorkerCommand]:
    """The command line of every worker (no ready file), in role order. With `config.gpus`,
    worker i gets `--device cuda:<first GPU of its block>` (`worker_gpus`). CPU workers get
    `--num-threads` (this machine's cores shared among them; a worker's ranks split its
    share) unless the worker args set it or a device."""
    roles = config.worker_roles
    shared = list(config.worker_args)
    firsts = (
        worker_gpus(config.gpus, len(roles), world_size_from_argv(shared)) if config.gpus else []
    )
    core_sets: list[str] = []
    if "--num-threads" not in shared and "--device" not in shared and not config.gpus:
        threads = default_cpu_threads(len(roles))
        shared += ["--num-threads", str(threads)]
        if "--cpu-cores" not in shared:
            core_sets = default_cpu_core_sets(len(roles), threads)
    commands = []
    for i, (name, role) in enumerate(roles):
        module = (
            "tandem_services.prefill_worker"
            if role == "prefill"
            else "tandem_services.decode_worker"
        )
        worker_id = f"{role}-{name.rpartition('-')[2] if '-' in name else 0}"
        args = [
            "--host",
            config.host,
            "--port",
            "0",
            "--scheduler",
            scheduler_address,
            "--worker-id",
            worker_id,
            "--model",
            config.model,
            "--grace-period-s",
            str(config.grace_period_s),
        ]
        if role == "unified":
            args.append("--unified")
        args += directory_flags(config.directory)
        args += tls_argv(config.tls)
        if firsts:
            args += ["--device", f"cuda:{firsts[i]}"]
        if core_sets:
            args += ["--cpu-cores", core_sets[i]]
        args += shared
        commands.append(WorkerCommand(name, role, worker_id, module, tuple(args)))
    return commands


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path | None
    info: dict[str, str] = field(default_factory=dict)
    # `python -m <module> <args>` (without the ready file): how to start it again.
    module: str = ""
    args: tuple[str, ...] = ()

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@dataclass
class Deployment:
    """Running services by name: "scheduler", "frontend", and "prefill" + "decode" or
    "unified"."""

    config: ServeConfig
    services: dict[str, Service]
    workdir: Path

    @property
    def http_address(self) -> str:
        return self.services["frontend"].info["http"]

    @property
    def grpc_address(self) -> str:
        return self.services["frontend"].info["grpc"]

    @property
    def scheduler_address(self) -> str:
        return self.services["scheduler"].info["grpc"]

    def address(self, name: str) -> str:
        return self.services[name].info["grpc"]

    def pid(self, name: str) -> int:
        return self.services[name].process.pid

    def failed(self) -> list[str]:
        return [name for name, s in self.services.items() if s.process.poll() is not None]

    def stop(self, timeout_s: float | None = None) -> dict[str, int]:
        """SIGTERM each service in order and wait for it; returns exit codes (killed: -9)."""
        timeout = self.config.grace_period_s + 10.0 if timeout_s is None else timeout_s
        codes: dict[str, int] = {}
        rank = {kind: i for i, kind in enumerate(_STOP_ORDER)}
        for name in sorted(self.services, key=lambda n: rank.get(n.split("-")[0], 0)):
            codes[name] = stop_process(self.services[name].process, timeout)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return codes


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode is not None
    return process.returncode


def read_ready(path: Path) -> dict[str, str] | None:
    """The key=value lines of a service's ready file; None until it is written."""
    if not path.exists():
        return None
    info = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        info[key] = value
    return info


def directory_flags(directory: DirectoryConfig) -> list[str]:
    """Service flags for `directory`, without the password (that goes in the environment)."""
    d = DirectoryConfig()
    argv: list[str] = []
    if directory.redis_url:
        argv += ["--redis-url", directory.redis_url]
    if directory.redis_username:
        argv += ["--redis-username", directory.redis_username]
    if directory.redis_tls:
        argv.append("--redis-tls")
    for flag, value in (
        ("--redis-tls-ca-certs", directory.redis_tls_ca_certs),
        ("--redis-tls-certfile", directory.redis_tls_certfile),
        ("--redis-tls-keyfile", directory.redis_tls_keyfile),
    ):
        if value:
            argv += [flag, value]
    if not directory.redis_tls_check_hostname:
        argv.append("--redis-tls-no-check-hostname")
    if directory.key_prefix != d.key_prefix:
        argv += ["--directory-key-prefix", directory.key_prefix]
    if directory.worker_ttl_s != d.worker_ttl_s:
        argv += ["--directory-ttl-s", str(directory.worker_ttl_s)]
    if directory.socket_timeout_s != d.socket_timeout_s:
        argv += ["--directory-timeout-s", str(directory.socket_timeout_s)]
    return argv


def spawn_service(
    config: ServeConfig, name: str, module: str, args: list[str], workdir: Path
) -> Service:
    """Start `python -m <module> <args> --ready-file <workdir>/<name>.ready`."""
    ready = workdir / f"{name}.ready"
    log_path = Path(config.log_dir) / f"{name}.log" if config.log_dir else None
    out: IO[bytes] | None = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 (the child keeps it)
    env = dict(os.environ)
    if config.directory.redis_password:
        env["TANDEM_REDIS_PASSWORD"] = config.directory.redis_password
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(
        [config.python, "-m", module, *args, "--ready-file", str(ready)],
        stdout=out,
        stderr=subprocess.STDOUT if out is not None else None,
        env=env,
        start_new_session=True,
    )
    if out is not None:
        out.close()
    return Service(name, process, ready, log_path, module=module, args=tuple(args))


def respawn_service(deployment: Deployment, service: Service) -> Service:
    """Start `service` (which has exited) again with the same command line; its log file
    gets the new process's output appended. Not ready until its ready file is written."""
    if service.process.poll() is None:
        raise RuntimeError(f"{service.name} is still running")
    service.ready_file.unlink(missing_ok=True)
    return spawn_service(
        deployment.config, service.name, service.module, list(service.args), deployment.workdir
    )


def wait_ready(services: list[Service], deadline: float) -> None:
    """Wait for each service's ready file (monotonic `deadline`); raise LaunchError."""
    pending = list(services)
    while pending:
        for s in list(pending):
            info = read_ready(s.ready_file)
            if info is not None:
                s.info = info
                pending.remove(s)
            elif s.process.poll() is not None:
                raise LaunchError(
                    f"{s.name} exited with code {s.process.returncode} during start-up"
                    + (f":\n{s.log_tail()}" if s.log_path else "")
                )
        if pending and time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending)
            raise LaunchError(f"{names} not ready in time")
        time.sleep(0.05)


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, which a container's cpuset or
    `taskset` narrows; every core where the OS has no masks)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cores or list(range(os.cpu_count() or 1))


def default_cpu_threads(num_workers: int) -> int:
    """Intra-op threads per CPU worker. One worker gets every core: its engine's
    `CpuThreadGovernor` runs each step on the cores the frontend, scheduler and clients leave
    free (served on this 2-core machine, bf16: 304-318 output tok/s at 4 req/s and 492-567 all
    at once, against 236-254 and 337-382 with one thread). Several workers share the cores
    less one for the other services (more threads than free cores in all makes every step
    wait on busy cores)."""
    cores = len(usable_cores())
    if num_workers == 1:
        return cores
    return max(1, (cores - 1) // num_workers)


def default_cpu_core_sets(num_workers: int, threads: int) -> list[str]:
    """The cores each CPU worker's engine threads are bound to (its `--cpu-cores`): the cores
    this process may use. One worker with a thread a core takes them all (see
    `default_cpu_threads`); otherwise the first is left to the frontend, scheduler and
    clients when there are two or more, the rest dealt out `threads` per worker in order
    (wrapping round when there are fewer cores than threads in all)."""
    cores = usable_cores()
    whole = num_workers == 1 and threads >= len(cores)
    pool = cores[1:] if len(cores) > 1 and not whole else cores
    sets = []
    for i in range(num_workers):
        picked = sorted({pool[(i * threads + j) % len(pool)] for j in range(threads)})
        sets.append(",".join(str(c) for c in picked))
    return sets


def start_deployment(config: ServeConfig) -> Deployment:
    """Start every service and wait until each is ready (workers registered)."""
    workdir = Path(tempfile.mkdtemp(prefix="tandem-serve-"))
    services: dict[str, Service] = {}
    deployment = Deployment(config, services, workdir)
    deadline = time.monotonic() + config.startup_timeout_s
    grace = ["--grace-period-s", str(config.grace_period_s)]
    directory = directory_flags(config.directory)
    routing = ["--routing", config.routing] if config.routing else []
    try:
        services["scheduler"] = spawn_service(
            config,
            "scheduler",
            "tandem_services.scheduler",
            [
                "--host",
                config.host,
                "--port",
                str(config.scheduler_port),
                *grace,
                *directory,
                *routing,
                *tls_argv(config.tls),
                *config.scheduler_args,
            ],
            workdir,
        )
        wait_ready([services["scheduler"]], deadline)
        scheduler = services["scheduler"].info["grpc"]
        roles = config.worker_roles
        for cmd in worker_commands(config, scheduler):
            services[cmd.name] = spawn_service(
                config, cmd.name, cmd.module, list(cmd.args), workdir
            )
        frontend_args = [
            "--host",
            config.host,
            "--http-port",
            str(config.http_port),
            "--grpc-port",
            str(config.grpc_port),
            "--scheduler",
            scheduler,
            "--model",
            config.model,
            "--wait-for-workers-s",
            str(config.startup_timeout_s),
            *grace,
            *tls_argv(config.tls),
            *config.frontend_args,
        ]
        if config.api_key:
            frontend_args += ["--api-key", config.api_key]
        services["frontend"] = spawn_service(
            config, "frontend", "tandem_services.frontend", frontend_args, workdir
        )
        wait_ready([services[name] for name, _ in roles] + [services["frontend"]], deadline)
    except BaseException:
        deployment.stop(timeout_s=10.0)
        raise
    return deployment
