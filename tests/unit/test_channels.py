"""One channel pool with one set of options (tandem_services/common/channels.py), used by the
services and the KV movers, against a real gRPC server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem_services.common import channels
from tandem_services.common import server as common_server


def test_services_use_the_one_definition() -> None:
    assert common_server.ChannelPool is channels.ChannelPool
    assert common_server.insecure_channel is channels.insecure_channel
    assert common_server.CHANNEL_OPTIONS is channels.CHANNEL_OPTIONS
    assert common_server.SERVER_OPTIONS is channels.SERVER_OPTIONS


def test_pool_one_channel_per_address_closed_together() -> None:
    async def run() -> None:
        server = grpc.aio.server(options=channels.SERVER_OPTIONS)
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        address = f"127.0.0.1:{port}"
        pool = channels.ChannelPool()
        try:
            first = pool.get(address)
            assert pool.get(address) is first and address in pool and len(pool) == 1
            other = pool.get(f"localhost:{port}")
            assert other is not first and len(pool) == 2
            for channel in (first, other):
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await pool.discard(f"localhost:{port}")
            assert len(pool) == 1
            await pool.close()
            assert len(pool) == 0
            with pytest.raises(grpc.aio.UsageError):
                await health_pb2_grpc.HealthStub(first).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert pool.get(address) is not first  # a new one after close
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(run())
