"""The TLS flags of every service, declared once: `--tls-cert`, `--tls-key`, `--tls-ca`,
`--tls-server-name` (environment TANDEM_TLS_CERT, ... : the same for every container of a
deployment). What they mean: `tandem_services.common.channels.TlsConfig`."""

from __future__ import annotations

import argparse

from tandem_services.common.channels import TlsConfig
from tandem_services.common.server import env_default

_FLAGS = {
    "tls_cert": ("cert_file", "PEM certificate of this service (TLS between services)"),
    "tls_key": ("key_file", "PEM private key of --tls-cert"),
    "tls_ca": (
        "ca_file",
        "PEM CA bundle that signs the peers' certificates; set: mutual TLS (servers require "
        "and verify client certificates)",
    ),
    "tls_server_name": (
        "server_name",
        "host name to check in servers' certificates instead of the address dialled",
    ),
}


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS between services")
    for dest, (_, help_) in _FLAGS.items():
        group.add_argument(
            "--" + dest.replace("_", "-"),
            dest=dest,
            default=env_default(f"TANDEM_{dest.upper()}", ""),
            help=help_,
        )


def tls_config_from(ns: argparse.Namespace) -> TlsConfig:
    """The TlsConfig of parsed flags (raises TlsConfigError, a ValueError)."""
    return TlsConfig(**{field: getattr(ns, dest) for dest, (field, _) in _FLAGS.items()})


def tls_argv(tls: TlsConfig) -> list[str]:
    """Flags that give a child service the same `tls` (the launcher)."""
    argv: list[str] = []
    for dest, (field, _) in _FLAGS.items():
        value = getattr(tls, field)
        if value:
            argv += ["--" + dest.replace("_", "-"), value]
    return argv


TLS_DESTS = tuple(_FLAGS)
