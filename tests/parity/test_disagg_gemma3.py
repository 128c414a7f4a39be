"""Prefill in one engine, decode in another, for a model with a KV cache group per attention
kind (the tiny Gemma 3: layer 0 slides with an 8-token window, layer 1 is global): the same
greedy tokens as one unified engine, over the in-process and the TCP connectors.

The prefill engine chunks each prompt (its sliding group frees blocks as it goes) and holds
the tables; the decode engine reserves its own (hits from its prefix cache, the sliding
group's window at the prompt's end, null entries elsewhere); the entries
`KVCacheSpec.handoff_indices` names move, as the prefill worker's hand-off moves them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from tandem import LLM, SamplingParams
from tandem.kv_transfer.base import KVConnector, KVDestination, KVTransferError
from tandem.kv_transfer.inproc import InProcessKVConnector, InProcessKVHub
from tandem.request import EngineCoreRequest
from tandem_protos.v1 import worker_pb2_grpc
from tandem_services.worker.kv_tcp import TcpKVConnector

BS = 4
WINDOW = 8
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma3_engines(tiny_model_path) -> Any:
    kwargs: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": 128,
        "block_size": BS,
        "num_gpu_blocks": 160,
    }
    path = str(tiny_model_path("gemma3"))
    pair = LLM(path, **kwargs), LLM(path, **kwargs)
    yield pair
    for llm in pair:
        llm.shutdown()


class _NoEngine:
    async def call(self, fn: Callable[[Any], Any]) -> Any:
        raise AssertionError("not used here")


class _Receiver(worker_pb2_grpc.WorkerServicer):
    """The decode side of the TCP connector: ReceiveKV into the engine's reservations."""

    def __init__(self, connector: TcpKVConnector, reservations: dict[str, list[int]]) -> None:
        self.connector = connector
        self.reservations = reservations

    async def _reserved(self, request_id: str) -> list[int] | None:
        return self.reservations.get(request_id)

    async def ReceiveKV(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await self.connector.receive_stream(request_iterator, self._reserved)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


def _drain(engine: Any) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


async def _hand_off(
    pe: Any, de: Any, prompts: list[list[int]], params: SamplingParams, transport: str
) -> tuple[dict[str, list[int]], dict[str, list[int]], list[int]]:
    """Prefill every prompt in `pe`, move its KV into `de`'s reservation, decode in `de`.
    Returns (first tokens, the rest, the sliding group's blocks sent per prompt)."""
    eos = pe.eos_token_id
    for i, p in enumerate(prompts):
        req = EngineCoreRequest(f"d{i}", p, params.clone(max_tokens=1), eos_token_id=eos)
        pe.add_request(req, hold_kv=True)
    first = _drain(pe)
    assert pe.stats().num_held == len(prompts)

    reservations: dict[str, list[int]] = {}
    server = None
    sender: KVConnector
    if transport == "inproc":
        hub = InProcessKVHub()
        sender = InProcessKVConnector(pe.kv_cache, _NoEngine(), hub, "prefill")
        InProcessKVConnector(de.kv_cache, _NoEngine(), hub, "decode")
        address = "decode"
    else:
        server = grpc.aio.server()
        receiver = TcpKVConnector(de.kv_cache, _NoEngine())
        worker_pb2_grpc.add_WorkerServicer_to_server(_Receiver(receiver, reservations), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        # Two blocks a message at most: runs split.
        sender = TcpKVConnector(pe.kv_cache, _NoEngine(), 2 * receiver.layout.bytes_per_block)
    spec = de.kv_cache_spec
    sliding_sent = []
    try:
        for i, p in enumerate(prompts):
            rid = f"d{i}"
            reserved = de.reserve(EngineCoreRequest(rid, p, params, eos_token_id=eos))
            assert reserved is not None
            dst, num_cached = reserved
            reservations[rid] = dst
            src = pe.get_held_block_ids(rid)
            indices = spec.handoff_indices(len(p), num_cached)
            G = spec.num_groups
            sliding_sent.append(sum(1 for k in indices if spec.groups[k % G].is_sliding))
            await sender.send_blocks(
                rid,
                [src[i] for i in indices],
                KVDestination("d", address, tuple(dst[i] for i in indices)),
            )
            pe.release_held(rid)
            assert de.add_prefilled_request(rid, first[rid][0]) is None
    finally:
        if server is not None:
            await sender.close()  # type: ignore[attr-defined]
            await server.stop(0)
    return first, _drain(de), sliding_sent


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_gemma3_disaggregated_engines_match_unified(gemma3_engines, transport: str) -> None:
    prefill_llm, decode_llm = gemma3_engines
    pe, de = prefill_llm.engine, decode_llm.engine
    spec = de.kv_cache_spec
    assert [g.sliding_window for g in spec.groups] == [None, WINDOW]
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (2, 30)]
    prompts += [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 9, 61)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    eos = pe.eos_token_id

    # Unified reference on the decode engine; then its prefix cache holds only a request
    # sharing the first 21 tokens (5 blocks), so two reservations start with hits.
    for i, p in enumerate(prompts):
        de.add_request(EngineCoreRequest(f"u{i}", p, params, eos_token_id=eos))
    unified = _drain(de)
    assert de.scheduler.kv_cache_manager.reset_prefix_cache()
    de.add_request(EngineCoreRequest("warm", [*shared, 1], params.clone(max_tokens=1)))
    _drain(de)

    first, rest, sliding_sent = asyncio.run(_hand_off(pe, de, prompts, params, transport))
    for i in range(len(prompts)):
        assert first[f"d{i}"] + rest[f"d{i}"] == unified[f"u{i}"], f"prompt {i} differs"
    # A sliding group sends the window's blocks at the prompt's end, never more.
    assert max(sliding_sent) <= -(-WINDOW // BS) + 1
    assert de.stats().prefix_cache_hits > 0
    for engine in (pe, de):
        kv = engine.scheduler.kv_cache_manager
        kv.check_invariants()
        assert kv.block_pool.is_whole
        assert kv.reset_prefix_cache()  # the next case starts from empty caches
