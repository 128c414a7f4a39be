"""gRPC channels and servers: one set of options for every tandem process, one channel pool,
and one transport security setting (`TlsConfig`).

The services (through `tandem_services.common.server`, which re-exports this) and the workers'
KV movers (`tandem_services/worker/kv_*.py`) dial each other with the same limits and
keepalive, so a KV block run that one side may send the other may receive, and a server
permits the pings its clients send.

Transport security, the same `TlsConfig` on both ends of every link::

    cert + key            servers speak TLS with this certificate; clients dial TLS, verifying
                          the server against `ca` (or the system roots without one)
    cert + key + ca       mutual TLS: servers also require a client certificate signed by `ca`
                          (a worker without one cannot register with the scheduler); clients
                          present `cert` as theirs
    none                  plaintext (the default, for loopback and trusted networks)

`server_name` overrides the host name a client checks in the server's certificate (one
certificate for every service, `--tls-server-name tandem.internal`, whatever address a worker
advertises).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

# KV block runs are a few MB; leave room above them.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Servers permit the clients' keepalive pings (every 10 s, even without calls).
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


class TlsConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TlsConfig:
    """PEM files of this process's certificate, its key and the CA that signs its peers
    (see the module docstring). Empty: plaintext."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise TlsConfigError("--tls-cert and --tls-key go together")
        if self.ca_file and not self.cert_file:
            raise TlsConfigError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise TlsConfigError(f"{name.replace('_file', '')} file not found: {path}")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.ca_file)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes(), ca

    def server_credentials(self) -> grpc.ServerCredentials:
        """This certificate; with a CA, client certificates are required and verified."""
        key, cert, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify servers against the CA (system roots without one); present this
        certificate as the client's."""
        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def channel_options(self) -> list[tuple[str, str | int]]:
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


PLAINTEXT = TlsConfig()


def insecure_channel(address: str) -> grpc.aio.Channel:
    """A plaintext asyncio channel to `address` with `CHANNEL_OPTIONS`."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def channel(address: str, tls: TlsConfig = PLAINTEXT) -> grpc.aio.Channel:
    """An asyncio channel to `address` with `CHANNEL_OPTIONS`: TLS when `tls` is enabled."""
    if not tls.enabled:
        return insecure_channel(address)
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*CHANNEL_OPTIONS, *tls.channel_options()]
    )


def sync_channel(address: str, tls: TlsConfig = PLAINTEXT) -> grpc.Channel:
    """A blocking channel to `address` (probes and command-line tools), TLS like `channel`."""
    if not tls.enabled:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(
        address, tls.channel_credentials(), options=[*CHANNEL_OPTIONS, *tls.channel_options()]
    )


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig = PLAINTEXT) -> int:
    """Bind `server` to `address`, with TLS when `tls` is enabled; the bound port (0: failed)."""
    if not tls.enabled:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


class ChannelPool:
    """One channel per address, made on first use (`channel`, with `tls`), closed together.

    Not thread-safe: use it from one event loop. A channel reconnects by itself after a peer
    restarts, so entries are kept until `close()` (or `discard` of an address gone for good).
    """

    def __init__(self, tls: TlsConfig = PLAINTEXT) -> None:
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, self.tls)
        return ch

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    def __len__(self) -> int:
        return len(self._channels)

    async def discard(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
