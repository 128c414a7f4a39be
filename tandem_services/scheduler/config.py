"""The scheduler's configuration: flags and environment, read once in `__main__`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tandem.kv_transfer.placement import CONNECTOR_CHOICES
from tandem_services.common.channels import PLAINTEXT, TlsConfig, TlsConfigError
from tandem_services.common.directory import add_directory_args, directory_config_from
from tandem_services.common.server import env_default
from tandem_services.common.tls import TLS_DESTS, add_tls_args, tls_config_from
from tandem_services.directory import DirectoryConfig
from tandem_services.scheduler.admission import AdmissionConfigError, AdmissionLimits
from tandem_services.scheduler.routing import ROUTING_CHOICES, RoutingWeights


class SchedulerServiceConfigError(ValueError):
    """A `SchedulerServiceConfig` that cannot run: a flag or environment value is wrong."""


@dataclass(frozen=True)
class SchedulerServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50050
    # Requests waiting for a worker; one more is refused with RESOURCE_EXHAUSTED ...
    max_queue_len: int = 1024
    # ... as is one whose prompt would bring the tokens waiting past this (0: no bound).
    max_queued_tokens: int = 0
    # A queued request that no worker takes within this long fails with UNAVAILABLE.
    queue_timeout_s: float = 60.0
    # Workers send a load report this often ...
    report_interval_s: float = 0.25
    # ... and are dropped (their requests fail with UNAVAILABLE) after this long without one.
    dead_after_s: float = 5.0
    max_inflight_per_worker: int = 256
    max_inflight_prefills: int = 64
    # A frontend whose event stream stays closed this long has its requests aborted.
    orphan_timeout_s: float = 10.0
    rpc_timeout_s: float = 10.0
    # A dispatch that fails retriably (the worker is unreachable or did not answer within
    # rpc_timeout_s) is tried again, at most this many attempts in all, after its abort is
    # answered and a jittered back-off: dispatch_backoff_s doubling per attempt, capped at
    # dispatch_backoff_max_s, each drawn from [half, all] of that.
    max_dispatch_attempts: int = 4
    dispatch_backoff_s: float = 0.05
    dispatch_backoff_max_s: float = 1.0
    grace_period_s: float = 5.0
    # Prometheus /metrics port (0: any free port, -1: off).
    metrics_port: int = -1
    # KV transport per prefill-decode pair: "auto" (from where the two workers are), or one
    # forced: "tcp", "cuda-ipc", "nccl" (tandem.kv_transfer.placement).
    kv_connector: str = "auto"
    # Which prefill (or unified) worker takes a prompt: "prefix" (cached prefix weighed
    # against load; tandem_services/scheduler/routing/prefix.py), "round-robin" or "load".
    routing: str = "prefix"
    routing_weights: RoutingWeights = field(default_factory=RoutingWeights)
    # Life of the scheduler's own record of where it sent which prefixes (seconds);
    # < 0: automatic (2 with a directory server, 300 without), 0: no record.
    prefix_hint_ttl_s: float = -1.0
    directory: DirectoryConfig = field(default_factory=DirectoryConfig)
    ready_file: str = ""
    log_level: str = "info"
    # TLS on the scheduler's port (mutual: workers and frontends need client certificates)
    # and to the workers (tandem_services.common.channels).
    tls: TlsConfig = PLAINTEXT

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_CHOICES:
            raise SchedulerServiceConfigError(
                f"routing must be one of {', '.join(ROUTING_CHOICES)}, got {self.routing!r}"
            )
        if not (0 <= self.port < 65536):
            raise SchedulerServiceConfigError(f"port must be in [0, 65535], got {self.port}")
        if not (-1 <= self.metrics_port < 65536):
            raise SchedulerServiceConfigError(
                f"metrics_port must be in [-1, 65535], got {self.metrics_port}"
            )
        if self.kv_connector not in CONNECTOR_CHOICES:
            raise SchedulerServiceConfigError(
                f"kv_connector must be one of {', '.join(CONNECTOR_CHOICES)}, "
                f"got {self.kv_connector!r}"
            )
        try:
            self.admission_limits  # noqa: B018 (validates)
        except AdmissionConfigError as exc:
            raise SchedulerServiceConfigError(str(exc)) from None
        if self.report_interval_s <= 0 or self.dead_after_s <= self.report_interval_s:
            raise SchedulerServiceConfigError(
                "dead_after_s must exceed report_interval_s, both > 0; got "
                f"{self.dead_after_s} and {self.report_interval_s}"
            )
        for name in ("queue_timeout_s", "rpc_timeout_s", "orphan_timeout_s"):
            if getattr(self, name) <= 0:
                raise SchedulerServiceConfigError(f"{name} must be > 0")
        if self.grace_period_s < 0:
            raise SchedulerServiceConfigError("grace_period_s must be >= 0")
        if self.max_dispatch_attempts < 1:
            raise SchedulerServiceConfigError(
                f"max_dispatch_attempts must be >= 1, got {self.max_dispatch_attempts}"
            )
        if not (0 <= self.dispatch_backoff_s <= self.dispatch_backoff_max_s):
            raise SchedulerServiceConfigError(
                "need 0 <= dispatch_backoff_s <= dispatch_backoff_max_s; got "
                f"{self.dispatch_backoff_s} and {self.dispatch_backoff_max_s}"
            )
        if self.max_inflight_per_worker < 1 or self.max_inflight_prefills < 1:
            raise SchedulerServiceConfigError("max_inflight_per_worker and _prefills must be >= 1")

    @property
    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_queue_len, self.max_queued_tokens)


def build_parser() -> argparse.ArgumentParser:
    d = SchedulerServiceConfig()
    p = argparse.ArgumentParser(
        prog="tandem scheduler",
        description="Global scheduler. Every flag also reads TANDEM_SCHEDULER_<FLAG>.",
    )

    def env(name: str, default: object) -> str:
        return env_default(f"TANDEM_SCHEDULER_{name.upper()}", str(default))

    p.add_argument("--host", default=env("host", d.host))
    p.add_argument("--port", type=int, default=env("port", d.port))
    p.add_argument(
        "--max-queue-len",
        "--max-queued-requests",
        dest="max_queue_len",
        type=int,
        default=env("max_queue_len", d.max_queue_len),
        help="requests waiting for a worker; more are refused at once (429, Retry-After)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=env("max_queued_tokens", d.max_queued_tokens),
        help="prompt tokens waiting for a worker; more are refused at once (0: no bound)",
    )
    p.add_argument(
        "--queue-timeout-s", type=float, default=env("queue_timeout_s", d.queue_timeout_s)
    )
    p.add_argument(
        "--report-interval-s", type=float, default=env("report_interval_s", d.report_interval_s)
    )
    p.add_argument("--dead-after-s", type=float, default=env("dead_after_s", d.dead_after_s))
    p.add_argument(
        "--max-inflight-per-worker",
        type=int,
        default=env("max_inflight_per_worker", d.max_inflight_per_worker),
    )
    p.add_argument(
        "--max-inflight-prefills",
        type=int,
        default=env("max_inflight_prefills", d.max_inflight_prefills),
    )
    p.add_argument(
        "--orphan-timeout-s", type=float, default=env("orphan_timeout_s", d.orphan_timeout_s)
    )
    p.add_argument("--rpc-timeout-s", type=float, default=env("rpc_timeout_s", d.rpc_timeout_s))
    p.add_argument(
        "--max-dispatch-attempts",
        type=int,
        default=env("max_dispatch_attempts", d.max_dispatch_attempts),
        help="attempts to dispatch a request whose worker is unreachable or too slow to answer",
    )
    p.add_argument(
        "--dispatch-backoff-s",
        type=float,
        default=env("dispatch_backoff_s", d.dispatch_backoff_s),
        help="back-off before the first retry of a dispatch (doubles per attempt, jittered)",
    )
    p.add_argument(
        "--dispatch-backoff-max-s",
        type=float,
        default=env("dispatch_backoff_max_s", d.dispatch_backoff_max_s),
        help="longest back-off between dispatch attempts",
    )
    p.add_argument("--grace-period-s", type=float, default=env("grace_period_s", d.grace_period_s))
    p.add_argument(
        "--metrics-port",
        type=int,
        default=env("metrics_port", d.metrics_port),
        help="serve Prometheus /metrics here (0: any free port, -1: off)",
    )
    p.add_argument(
        "--kv-connector",
        choices=CONNECTOR_CHOICES,
        default=env("kv_connector", d.kv_connector),
        help="KV transport between prefill and decode workers (auto: CUDA IPC on one host, "
        "NCCL between GPU hosts, TCP otherwise)",
    )
    p.add_argument("--ready-file", default=env("ready_file", ""))
    p.add_argument("--log-level", default=env("log_level", d.log_level))
    r = p.add_argument_group("routing")
    r.add_argument(
        "--routing",
        choices=ROUTING_CHOICES,
        default=env("routing", d.routing),
        help="prefix: where the prompt's prefix is cached, weighed against load (the "
        "default); round-robin; load: the least loaded",
    )
    w = d.routing_weights
    r.add_argument(
        "--routing-uncached-token-weight",
        type=float,
        default=env("routing_uncached_token_weight", w.uncached_token),
        help="cost of one prompt token the worker must compute",
    )
    r.add_argument(
        "--routing-queued-token-weight",
        type=float,
        default=env("routing_queued_token_weight", w.queued_token),
        help="cost of one prompt token already queued on the worker",
    )
    r.add_argument(
        "--routing-running-request-weight",
        type=float,
        default=env("routing_running_request_weight", w.running_request),
        help="cost of one request running on the worker",
    )
    r.add_argument(
        "--routing-waiting-request-weight",
        type=float,
        default=env("routing_waiting_request_weight", w.waiting_request),
        help="cost of one request waiting in the worker's engine",
    )
    r.add_argument(
        "--prefix-hint-ttl-s",
        type=float,
        default=env("prefix_hint_ttl_s", d.prefix_hint_ttl_s),
        help="keep the scheduler's record of where it sent which prefixes this long "
        "(<0: 2 with Redis, 300 without; 0: off, the directory alone)",
    )
    add_directory_args(p, "TANDEM_SCHEDULER_")
    add_tls_args(p)
    return p


_WEIGHT_FLAGS = {
    "routing_uncached_token_weight": "uncached_token",
    "routing_queued_token_weight": "queued_token",
    "routing_running_request_weight": "running_request",
    "routing_waiting_request_weight": "waiting_request",
}
_DIRECTORY_FLAGS = (
    "redis_url",
    "redis_username",
    "redis_password",
    "redis_tls",
    "redis_tls_ca_certs",
    "redis_tls_certfile",
    "redis_tls_keyfile",
    "redis_tls_no_check_hostname",
    "directory_key_prefix",
    "directory_ttl_s",
    "directory_timeout_s",
)


def config_from_args(argv: list[str]) -> SchedulerServiceConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = dict(vars(ns))
    try:
        tls = tls_config_from(ns)
    except TlsConfigError as exc:
        parser.error(str(exc))
    try:
        weights = RoutingWeights(**{f: values.pop(k) for k, f in _WEIGHT_FLAGS.items()})
        directory = directory_config_from(ns)
    except ValueError as exc:
        raise SchedulerServiceConfigError(str(exc)) from exc
    for k in (*_DIRECTORY_FLAGS, *TLS_DESTS):
        values.pop(k)
    return SchedulerServiceConfig(**values, routing_weights=weights, directory=directory, tls=tls)
