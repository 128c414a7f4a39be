"""The engine-core frames: what goes in comes out, for every field an output can carry."""

from __future__ import annotations

from tandem.core.outputs import EngineCoreOutput, FinishReason, Logprobs
from tandem.engine import serial
from tandem.engine.core import EngineStats


def _stats() -> EngineStats:
    return EngineStats(3, 1, 10, 16, 0.375, 40, 12, 2, 1, 0)


def test_step_frame_round_trip() -> None:
    lp = Logprobs([5, 9, 2], [-0.1, -1.5, -2.25], sampled_rank=1)
    outputs = [
        EngineCoreOutput("plain", [17]),
        EngineCoreOutput("several-tokens", [1, 2, 3], num_cached_tokens=32),
        EngineCoreOutput("unicodé-ид-😀", [], finish_reason=FinishReason.ABORT),
        EngineCoreOutput("stopped", [7], finish_reason=FinishReason.STOP, stop_reason=42),
        EngineCoreOutput("stop-string", [8], finish_reason=FinishReason.STOP, stop_reason="END"),
        EngineCoreOutput("length", [99], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput("logprobs", [5], new_logprobs=[lp]),
        EngineCoreOutput("prompt-logprobs", [6], prompt_logprobs=[lp, lp]),
    ]
    pig = serial.Piggyback(
        stats=_stats(),
        held_block_ids={"stopped": [4, 5, 6]},
        cache_events=[([b"a" * 16], []), ([], [b"a" * 16, b"b" * 16])],
    )
    frame = serial.encode_step(outputs, pig)
    assert frame[0] == serial.STEP
    got, got_pig = serial.decode_step(frame)
    assert got == outputs
    assert got_pig == pig


def test_empty_step_frame() -> None:
    got, pig = serial.decode_step(serial.encode_step([], serial.Piggyback(stats=_stats())))
    assert got == []
    assert pig.stats == _stats()
    assert pig.held_block_ids == {} and pig.cache_events == []


def test_command_and_reply_frames() -> None:
    frame = serial.encode_command(7, "abort_requests", (["a", "b"],))
    assert serial.decode_command(frame) == (7, "abort_requests", (["a", "b"],), {})
    frame = serial.encode_command(8, "add_request", ("req",), {"hold_kv": True})
    assert serial.decode_command(frame) == (8, "add_request", ("req",), {"hold_kv": True})
    err = ValueError("prompt is empty")
    reply = serial.decode_pickled(serial.encode_reply(7, False, err, serial.Piggyback()))
    call_id, ok, result, _ = reply
    assert (call_id, ok, type(result), str(result)) == (7, False, ValueError, "prompt is empty")
