"""Each worker role's strategy object: the RPCs it serves and refuses, its admission and its
engine options; and the refusals as a client sees them, through a real gRPC server on
127.0.0.1 with `WorkerServicer` (no engine needed: a refusal comes before any engine call).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.kv_transfer.base import KVDestination
from tandem.request import EngineCoreRequest
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tandem_services.worker import engine_host as m
from tandem_services.worker.roles import (
    ROLE_SPECIFIC_RPCS,
    DecodeRole,
    PrefillRole,
    UnifiedRole,
    WorkerRole,
    worker_role,
)
from tandem_services.worker.servicer import WorkerServicer
from tandem_services.worker.states import Phase, Role

DECODE_RPCS = {"Reserve", "ReceiveKV", "ConnectKV", "WriteKV"}
COMMON_RPCS = {"AddPrefilled", "Abort", "Stats", "StreamOutputs"}
SERVED = {
    Role.UNIFIED: {"Prefill"},
    Role.PREFILL: {"Prefill"},
    Role.DECODE: DECODE_RPCS,
}
REFUSAL = {
    Role.UNIFIED: "not a decode worker",
    Role.PREFILL: "not a decode worker",
    Role.DECODE: "this is a decode worker",
}


def test_every_rpc_of_the_service_is_accounted_for() -> None:
    names = set(worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name)
    assert names == ROLE_SPECIFIC_RPCS | COMMON_RPCS
    assert {"Prefill"} | DECODE_RPCS == ROLE_SPECIFIC_RPCS


@pytest.mark.parametrize("role", list(Role))
def test_role_answers_its_rpcs_and_refuses_the_others(role: Role) -> None:
    obj = worker_role(role)
    assert obj.role == role
    for rpc in ROLE_SPECIFIC_RPCS | COMMON_RPCS:
        served = rpc in SERVED[role] or rpc in COMMON_RPCS
        assert obj.serves(rpc) == served, rpc
        assert obj.refusal(rpc) == (None if served else REFUSAL[role]), rpc


def test_roles_are_chosen_by_name() -> None:
    assert type(worker_role("unified")) is UnifiedRole
    assert type(worker_role(Role.PREFILL)) is PrefillRole
    assert type(worker_role("decode")) is DecodeRole
    with pytest.raises(ValueError):
        worker_role("mixed")
    assert {worker_role(r).proto for r in Role} == {
        common_pb2.WORKER_ROLE_UNIFIED,
        common_pb2.WORKER_ROLE_PREFILL,
        common_pb2.WORKER_ROLE_DECODE,
    }


@pytest.mark.parametrize("publish", [False, True])
def test_engine_options_and_connector_by_role(publish: bool) -> None:
    unified = worker_role(Role.UNIFIED).engine_options(publish)
    prefill = worker_role(Role.PREFILL).engine_options(publish)
    decode = worker_role(Role.DECODE).engine_options(publish)
    assert (unified.report_held_blocks, unified.share_kv_cache) == (False, False)
    assert (prefill.report_held_blocks, prefill.share_kv_cache) == (True, True)
    assert (decode.report_held_blocks, decode.share_kv_cache) == (False, True)
    assert {unified.publish_cache_events, prefill.publish_cache_events} == {publish}
    assert decode.publish_cache_events == publish
    assert [worker_role(r).has_kv_connector for r in Role] == [r != Role.UNIFIED for r in Role]
    assert [worker_role(r).publishes_prefixes for r in Role] == [r != Role.DECODE for r in Role]


def _request(max_tokens: int, min_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens)
    return EngineCoreRequest("r", [1, 2, 3], params, eos_token_id=None)


def test_prefill_admission_samples_one_token_and_holds_the_kv() -> None:
    prefill = worker_role(Role.PREFILL)
    req = prefill.admit(_request(max_tokens=16, min_tokens=4))
    assert (req.sampling_params.max_tokens, req.sampling_params.min_tokens) == (1, 1)
    assert prefill.hold_kv and prefill.needs_handoff
    req = prefill.admit(_request(max_tokens=16, min_tokens=0))
    assert req.sampling_params.min_tokens == 0
    unified = worker_role(Role.UNIFIED)
    req = unified.admit(_request(max_tokens=16, min_tokens=4))
    assert (req.sampling_params.max_tokens, req.sampling_params.min_tokens) == (16, 4)
    assert not unified.hold_kv and not unified.needs_handoff


# ----------------------------------------------------------------------- through gRPC


async def _no_messages() -> AsyncIterator[worker_pb2.KVBlockRun]:
    return
    yield  # an async generator with no items


async def _code_and_details(stub: worker_pb2_grpc.WorkerStub, rpc: str) -> tuple[str, str]:
    """Call `rpc` with a request whose handling never reaches an engine; its error."""
    try:
        if rpc == "Prefill":
            await stub.Prefill(worker_pb2.PrefillRequest(), timeout=5.0)
        elif rpc == "PrefillWithHandoff":
            await stub.Prefill(
                worker_pb2.PrefillRequest(handoff=worker_pb2.KVHandoff(decode_worker_id="d")),
                timeout=5.0,
            )
        elif rpc == "Reserve":
            await stub.Reserve(worker_pb2.ReserveRequest(), timeout=5.0)
        elif rpc == "ReceiveKV":
            await stub.ReceiveKV(_no_messages(), timeout=5.0)
        elif rpc == "ConnectKV":
            await stub.ConnectKV(worker_pb2.ConnectKVRequest(), timeout=5.0)
        elif rpc == "WriteKV":
            async for _ in stub.WriteKV(_no_messages(), timeout=5.0):
                pass
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


async def _serve_and_call(role: WorkerRole, rpcs: list[str]) -> dict[str, tuple[str, str]]:
    # An unstarted engine host: these calls read only its `draining` flag.
    host = m.EngineHost("w", None, 16, 512, 30.0, 5.0, role)  # type: ignore[arg-type]
    servicer = WorkerServicer(role, "w", host, None, None, None)  # type: ignore[arg-type]
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            return {rpc: await _code_and_details(stub, rpc) for rpc in rpcs}
    finally:
        await server.stop(0)


@pytest.mark.parametrize("role", list(Role))
def test_a_wrong_role_rpc_is_refused_with_failed_precondition(role: Role) -> None:
    refused = sorted(ROLE_SPECIFIC_RPCS - SERVED[role])
    results = asyncio.run(_serve_and_call(worker_role(role), refused))
    assert results == {rpc: ("FAILED_PRECONDITION", REFUSAL[role]) for rpc in refused}


def test_served_rpcs_pass_the_role_gate() -> None:
    handoff_error = "a prefill worker needs a KV hand-off target; a unified worker takes none"
    # Unified: Prefill is served, but takes no hand-off target.
    results = asyncio.run(_serve_and_call(UnifiedRole(), ["PrefillWithHandoff"]))
    assert results == {"PrefillWithHandoff": ("INVALID_ARGUMENT", handoff_error)}
    # Prefill: served, and needs one.
    results = asyncio.run(_serve_and_call(PrefillRole(), ["Prefill"]))
    assert results == {"Prefill": ("INVALID_ARGUMENT", handoff_error)}
    # Decode: Reserve is served; the empty request is then refused for what it is.
    ((code, details),) = asyncio.run(_serve_and_call(DecodeRole(), ["Reserve"])).values()
    assert code == "INVALID_ARGUMENT" and "decode worker" not in details


def test_prefill_hand_off_pairs_each_groups_entries_by_position() -> None:
    """A cache of two groups (full; 8-token window) in 4-token blocks, interleaved tables: the
    prefill worker sends the entries `KVCacheSpec.handoff_indices` names, source and
    destination paired by position. An 18-token prompt whose first block the decode side has
    cached: logical blocks 1..4 of the full group, 2..4 of the sliding one (a query at 18
    reads keys from 11 on). The reservation's 0s are null entries but one, block 0 itself."""
    spec = KVCacheSpec.from_layer_windows(4, [8, None])
    reserved = [50, 0, 51, 0, 0, 52, 53, 54, 55, 56]
    held = list(range(100, 110))
    sent: list[tuple[list[int], KVDestination]] = []
    told: list[m.HandoffDone] = []

    async def run() -> None:
        engine = None  # never called: the hand-off stops before AddPrefilled
        host = m.EngineHost("w", engine, 4, 512, 30.0, 5.0, PrefillRole(), kv_cache_spec=spec)  # type: ignore[arg-type]
        handoff = worker_pb2.KVHandoff(
            decode_worker_id="decode-0",
            decode_address="127.0.0.1:1",
            block_ids=reserved,
            num_cached_tokens=4,
            transport="tcp",
        )
        r = m.WorkerRequest("r", "dest", Role.PREFILL, Phase.HANDING_OFF, 18, handoff=handoff)

        class _Connector:
            async def send_blocks(self, request_id: str, src: list[int], dst: KVDestination) -> int:
                sent.append((list(src), dst))
                r.aborted = True  # stop before AddPrefilled: no decode worker here
                return 0

        host.connector = _Connector()  # type: ignore[assignment]
        host.tell = told.append  # type: ignore[method-assign,assignment]
        await PrefillRole()._handoff(host, r, held)

    asyncio.run(run())
    ((src, dst),) = sent
    assert spec.handoff_indices(18, 4) == [2, 4, 5, 6, 7, 8, 9]
    assert src == [102, 104, 105, 106, 107, 108, 109]
    assert dst.block_ids == (51, 0, 52, 53, 54, 55, 56) and dst.transport == "tcp"
    assert [t.error for t in told] == ["aborted"]
