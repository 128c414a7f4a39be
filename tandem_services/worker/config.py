"""A worker's configuration: flags and environment, read once in `__main__`."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field

from tandem.config import SERVING_ENGINE_DEFAULTS, EngineConfig, add_engine_args
from tandem.engine_args import EngineArgs
from tandem_services.common.channels import PLAINTEXT, TlsConfig, TlsConfigError
from tandem_services.common.directory import add_directory_args, directory_config_from
from tandem_services.common.server import env_default
from tandem_services.common.tls import add_tls_args, tls_config_from
from tandem_services.directory import DirectoryConfig
from tandem_services.worker.states import Role


class WorkerServiceConfigError(ValueError):
    """A `WorkerServiceConfig` that cannot run: a flag or environment value is wrong."""


@dataclass(frozen=True)
class WorkerServiceConfig:
    role: Role
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    # host:port others use to reach this worker (default: host and the bound port).
    advertise_address: str = ""
    scheduler_address: str = ""
    worker_id: str = ""
    grace_period_s: float = 10.0
    # Outputs for a frontend without an open stream are kept this long, then its requests are
    # aborted.
    destination_timeout_s: float = 10.0
    kv_max_message_bytes: int = 4 * 1024 * 1024
    rpc_timeout_s: float = 30.0
    # A step in flight this long (the engine process stalled or stopped): health NOT_SERVING
    # and load reports paused until steps run again (0: no stall detection). Generous by
    # default: on a starved CPU host a long prefill step can take a minute (vLLM's iteration
    # timeout is 60 s; lower it where steps are known to be short).
    engine_stall_timeout_s: float = 300.0
    # Prometheus /metrics port (0: any free port, -1: off).
    metrics_port: int = -1
    # Prefix-cache directory: prefill and unified workers publish their cached block hashes
    # there when it names a server (batches at most `directory_publish_delay_s` late).
    directory: DirectoryConfig = field(default_factory=DirectoryConfig)
    directory_publish_delay_s: float = 0.05
    ready_file: str = ""
    log_level: str = "info"
    # TLS on the worker's port and to the scheduler and peers, KV hand-off streams included
    # (tandem_services.common.channels).
    tls: TlsConfig = PLAINTEXT

    def __post_init__(self) -> None:
        if self.directory_publish_delay_s < 0:
            raise WorkerServiceConfigError("directory_publish_delay_s must be >= 0")
        if self.role not in ("prefill", "decode", "unified"):
            raise WorkerServiceConfigError(
                f"role must be prefill, decode or unified, got {self.role}"
            )
        if not (0 <= self.port < 65536):
            raise WorkerServiceConfigError(f"port must be in [0, 65535], got {self.port}")
        if not (-1 <= self.metrics_port < 65536):
            raise WorkerServiceConfigError(
                f"metrics_port must be in [-1, 65535], got {self.metrics_port}"
            )
        if self.grace_period_s < 0 or self.destination_timeout_s <= 0:
            raise WorkerServiceConfigError("grace_period_s must be >= 0, destination_timeout_s > 0")
        if self.engine_stall_timeout_s < 0:
            raise WorkerServiceConfigError("engine_stall_timeout_s must be >= 0")
        if self.kv_max_message_bytes < 1024:
            raise WorkerServiceConfigError("kv_max_message_bytes must be >= 1024")
        if self.engine.parallel.nnodes > 1 and self.role != "unified":
            raise WorkerServiceConfigError(
                f"a {self.role} worker hands KV over from its ranks' caches, which must be on "
                f"its host; nnodes {self.engine.parallel.nnodes} runs --unified workers only"
            )


def build_parser(service: str, default_role: Role) -> argparse.ArgumentParser:
    prefix = f"TANDEM_{service.upper()}_"
    p = argparse.ArgumentParser(
        prog=f"tandem {service.replace('_', '-')}",
        description=f"A tandem worker. Flags also read {prefix}<FLAG> from the environment.",
    )

    def env(name: str, default: object) -> str:
        return env_default(prefix + name.upper(), str(default))

    d = WorkerServiceConfig.__dataclass_fields__
    p.add_argument(
        "--unified",
        action="store_true",
        default=env("unified", "") not in ("", "0", "false"),
        help="run prefill and decode in one engine (no KV hand-off)",
    )
    p.add_argument("--host", default=env("host", d["host"].default))
    p.add_argument("--port", type=int, default=env("port", d["port"].default))
    p.add_argument("--advertise-address", default=env("advertise_address", ""))
    p.add_argument(
        "--scheduler",
        default=env("scheduler", os.environ.get("TANDEM_SCHEDULER_ADDRESS", "127.0.0.1:50050")),
        help="scheduler host:port to register with ('' for none)",
    )
    p.add_argument("--worker-id", default=env("worker_id", ""))
    p.add_argument(
        "--grace-period-s", type=float, default=env("grace_period_s", d["grace_period_s"].default)
    )
    p.add_argument(
        "--destination-timeout-s",
        type=float,
        default=env("destination_timeout_s", d["destination_timeout_s"].default),
    )
    p.add_argument(
        "--kv-max-message-bytes",
        type=int,
        default=env("kv_max_message_bytes", d["kv_max_message_bytes"].default),
    )
    p.add_argument(
        "--rpc-timeout-s", type=float, default=env("rpc_timeout_s", d["rpc_timeout_s"].default)
    )
    p.add_argument(
        "--engine-stall-timeout-s",
        type=float,
        default=env("engine_stall_timeout_s", d["engine_stall_timeout_s"].default),
        help="a step in flight this long marks the worker NOT_SERVING (0: off)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=env("metrics_port", d["metrics_port"].default),
        help="serve Prometheus /metrics here (0: any free port, -1: off)",
    )
    p.add_argument("--ready-file", default=env("ready_file", ""))
    p.add_argument("--log-level", default=env("log_level", "info"))
    add_directory_args(p, prefix)
    p.add_argument(
        "--directory-publish-delay-s",
        type=float,
        default=env("directory_publish_delay_s", d["directory_publish_delay_s"].default),
        help="publish cache changes to the directory at most this late (batched)",
    )
    add_tls_args(p)
    add_engine_args(p, defaults=SERVING_ENGINE_DEFAULTS)
    p.set_defaults(_default_role=default_role)
    return p


def config_from_args(service: str, default_role: Role, argv: list[str]) -> WorkerServiceConfig:
    parser = build_parser(service, default_role)
    ns = parser.parse_args(argv)
    role = Role.UNIFIED if ns.unified else Role(default_role)
    try:
        # Resolved here, once: the model path, its HF config and max_model_len.
        engine = EngineArgs.from_cli_args(ns).create_engine_config()
    except ValueError as exc:  # ConfigError, ModelNotFoundError: one line, exit code 2
        parser.error(str(exc))
    try:
        tls = tls_config_from(ns)
    except TlsConfigError as exc:
        parser.error(str(exc))
    worker_id = ns.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
    return WorkerServiceConfig(
        role=role,
        engine=engine,
        host=ns.host,
        port=ns.port,
        advertise_address=ns.advertise_address,
        scheduler_address=ns.scheduler,
        worker_id=worker_id,
        grace_period_s=ns.grace_period_s,
        destination_timeout_s=ns.destination_timeout_s,
        kv_max_message_bytes=ns.kv_max_message_bytes,
        rpc_timeout_s=ns.rpc_timeout_s,
        engine_stall_timeout_s=ns.engine_stall_timeout_s,
        metrics_port=ns.metrics_port,
        directory=directory_config_from(ns),
        directory_publish_delay_s=ns.directory_publish_delay_s,
        ready_file=ns.ready_file,
        log_level=ns.log_level,
        tls=tls,
    )
