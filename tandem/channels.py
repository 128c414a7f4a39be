"""gRPC channels and servers: one set of options for every tandem process, and one channel pool.

The services (through `tandem_services.common.server`, which re-exports this) and the library's KV
movers (`tandem/kv_transfer/`) dial each other with the same limits and keepalive, so a KV
block run that one side may send the other may receive, and a server permits the pings its
clients send. (The definition lives in `tandem/` because the library cannot import
`tandem_services/`.)
"""

from __future__ import annotations

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


def insecure_channel(address: str) -> grpc.aio.Channel:
    """A plaintext asyncio channel to `address` with `CHANNEL_OPTIONS`."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class ChannelPool:
    """One channel per address, made on first use (`insecure_channel`), closed together.

    Not thread-safe: use it from one event loop. A channel reconnects by itself after a peer
    restarts, so entries are kept until `close()` (or `discard` of an address gone for good).
    """

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return channel

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
