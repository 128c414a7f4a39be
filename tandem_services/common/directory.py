"""The prefix-cache directory at the services' edge: flags, and metrics of its clients.

Every service that talks to the directory (the scheduler reads it, prefill and unified
workers publish to it) takes the same flags, mapped onto one `DirectoryConfig`:

    --redis-url URL            redis://, rediss:// (TLS) or unix://; empty: no server
    --redis-username NAME      ACL user
    --redis-password PASS      (better: the environment, see below)
    --redis-tls                TLS even with a redis:// URL
    --redis-tls-ca-certs FILE  CA bundle to verify the server
    --redis-tls-certfile FILE  client certificate (mutual TLS) ...
    --redis-tls-keyfile FILE   ... and its key
    --redis-tls-no-check-hostname
    --directory-key-prefix P   key namespace (several deployments on one server)
    --directory-ttl-s S        a worker's entries expire S seconds after its last heartbeat
    --directory-timeout-s S    connect / socket timeout of one directory call

Each flag's default comes from the service's own variable (`TANDEM_SCHEDULER_REDIS_URL`,
...), else from the deployment-wide one (`TANDEM_REDIS_URL`, `TANDEM_REDIS_PASSWORD`, ...),
so compose files and config maps set Redis once for all services.

Without a URL there is no shared directory: services run in separate processes, so an
in-memory directory in one of them would see nothing the others cache. Workers then publish
nothing, and the scheduler's prefix-aware routing uses only its own record of where it sent
which prompts (see `tandem_services/scheduler/routing/prefix.py`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from tandem_services.common.metrics import counter, gauge
from tandem_services.common.server import env_default
from tandem_services.directory import DirectoryConfig, DirectoryPublisher

_TRUE = ("1", "true", "yes", "on")


def add_directory_args(parser: argparse.ArgumentParser, env_prefix: str) -> None:
    """Add the directory flags; defaults from `<env_prefix><FLAG>`, then `TANDEM_<FLAG>`."""
    d = DirectoryConfig()

    def env(name: str, default: object) -> str:
        shared = env_default(f"TANDEM_{name.upper()}", "" if default is None else str(default))
        return env_default(f"{env_prefix}{name.upper()}", shared)

    g = parser.add_argument_group("prefix-cache directory")
    g.add_argument(
        "--redis-url",
        default=env("redis_url", d.redis_url),
        help="Redis holding the prefix-cache directory (redis://host:port/db, rediss:// for "
        "TLS, unix://path); empty: none (the scheduler routes on its own dispatch record)",
    )
    g.add_argument("--redis-username", default=env("redis_username", ""))
    g.add_argument(
        "--redis-password",
        default=env("redis_password", ""),
        help="prefer setting TANDEM_REDIS_PASSWORD: a flag shows in the process list",
    )
    g.add_argument(
        "--redis-tls",
        action="store_true",
        default=env("redis_tls", "").lower() in _TRUE,
        help="use TLS (implied by a rediss:// URL)",
    )
    g.add_argument("--redis-tls-ca-certs", default=env("redis_tls_ca_certs", ""))
    g.add_argument("--redis-tls-certfile", default=env("redis_tls_certfile", ""))
    g.add_argument("--redis-tls-keyfile", default=env("redis_tls_keyfile", ""))
    g.add_argument(
        "--redis-tls-no-check-hostname",
        action="store_true",
        default=env("redis_tls_no_check_hostname", "").lower() in _TRUE,
    )
    g.add_argument("--directory-key-prefix", default=env("directory_key_prefix", d.key_prefix))
    g.add_argument(
        "--directory-ttl-s",
        type=float,
        default=env("directory_ttl_s", d.worker_ttl_s),
        help="a worker's directory entries expire this long after its last heartbeat",
    )
    g.add_argument(
        "--directory-timeout-s",
        type=float,
        default=env("directory_timeout_s", d.socket_timeout_s),
        help="connect and socket timeout of one directory call",
    )


def directory_config_from(ns: argparse.Namespace) -> DirectoryConfig:
    """The `DirectoryConfig` of parsed directory flags (raises ValueError when invalid)."""
    return DirectoryConfig(
        redis_url=ns.redis_url,
        redis_password=ns.redis_password or None,
        redis_username=ns.redis_username or None,
        redis_tls=ns.redis_tls,
        redis_tls_ca_certs=ns.redis_tls_ca_certs or None,
        redis_tls_certfile=ns.redis_tls_certfile or None,
        redis_tls_keyfile=ns.redis_tls_keyfile or None,
        redis_tls_check_hostname=not ns.redis_tls_no_check_hostname,
        key_prefix=ns.directory_key_prefix,
        worker_ttl_s=ns.directory_ttl_s,
        socket_timeout_s=ns.directory_timeout_s,
    )


def publisher_metrics(publisher: DirectoryPublisher) -> Iterator[Metric]:
    """A worker's directory publisher, read at scrape time (on the worker's event loop).

    tandem_directory_publish_batches_total       batches published
    tandem_directory_published_hashes_total      hash changes (added or evicted) published
    tandem_directory_dropped_hashes_total        changes dropped while the directory was away
    tandem_directory_republishes_total           full republishes (start, after an outage)
    tandem_directory_unavailable_errors_total    directory calls that failed
    tandem_directory_pending_hashes              changes waiting for the next batch
    tandem_directory_in_sync                     1 when the directory holds this worker's set
    """
    yield counter("tandem_directory_publish_batches", "Batches published.", publisher.num_flushes)
    yield counter(
        "tandem_directory_published_hashes",
        "Block-hash changes (added or evicted) published.",
        publisher.num_published_hashes,
    )
    yield counter(
        "tandem_directory_dropped_hashes",
        "Block-hash changes dropped while the directory was unreachable (a full republish "
        "follows).",
        publisher.num_dropped_hashes,
    )
    yield counter(
        "tandem_directory_republishes",
        "Full republishes of the worker's cached block hashes.",
        publisher.num_republishes,
    )
    yield counter(
        "tandem_directory_unavailable_errors",
        "Directory calls that failed (server unreachable).",
        publisher.num_unavailable_errors,
    )
    yield gauge(
        "tandem_directory_pending_hashes",
        "Changes waiting for the next batch.",
        publisher.num_pending,
    )
    yield gauge(
        "tandem_directory_in_sync",
        "1 when the directory holds this worker's current set of block hashes.",
        0.0 if publisher.dirty else 1.0,
    )
