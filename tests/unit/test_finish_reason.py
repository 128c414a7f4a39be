"""A finish reason is one enum from the engine to the wire: the OpenAI strings stay, the STEP
frame carries every member back as itself, and the proto mapping at the services' edge is
total both ways."""

from __future__ import annotations

import json

from tandem.core.outputs import EngineCoreOutput, FinishReason
from tandem.engine import serial
from tandem.request import FINISH_REASONS, RequestStatus
from tandem_protos.v1 import common_pb2
from tandem_services.common.convert import FINISH_FROM_PROTO, FINISH_TO_PROTO, output_to_proto


def test_wire_strings_are_the_openai_ones() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error", "tool_calls"]
    assert (
        json.dumps({"finish_reason": FinishReason.TOOL_CALLS}) == '{"finish_reason": "tool_calls"}'
    )
    assert f"{FinishReason.LENGTH}" == "length" and FinishReason("stop") is FinishReason.STOP


def test_every_finished_status_has_its_reason() -> None:
    finished = [s for s in RequestStatus if RequestStatus.is_finished(s)]
    assert {s: s.finish_reason() for s in finished} == FINISH_REASONS
    assert RequestStatus.RUNNING.finish_reason() is None


def test_step_frame_carries_each_member_as_itself() -> None:
    outputs = [EngineCoreOutput(f"r{i}", [i], finish_reason=r) for i, r in enumerate(FinishReason)]
    outputs.append(EngineCoreOutput("running", [9]))
    got, _ = serial.decode_step(serial.encode_step(outputs, serial.Piggyback()))
    assert [o.finish_reason for o in got] == [*FinishReason, None]
    assert all(type(o.finish_reason) is FinishReason for o in got[:-1])


def test_proto_mapping_is_total() -> None:
    assert set(FINISH_TO_PROTO) == {None, *FinishReason}
    assert set(FINISH_FROM_PROTO) == set(common_pb2.FinishReason.values())
    for proto, reason in FINISH_FROM_PROTO.items():
        assert FINISH_TO_PROTO[reason] == proto
    # ERROR leaves as ABORT with invalid_request and the engine's message.
    msg = output_to_proto(
        EngineCoreOutput("x", [], finish_reason=FinishReason.ERROR, stop_reason="bad"), 0
    )
    assert (msg.finish_reason, msg.invalid_request, msg.error) == (
        common_pb2.FINISH_REASON_ABORT,
        True,
        "bad",
    )
