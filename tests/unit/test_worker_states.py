"""A worker request's phases follow the hand-off protocol's table and nothing else."""

from __future__ import annotations

import pytest

from tandem_services.worker.engine_host import WorkerRequest
from tandem_services.worker.states import TRANSITIONS, Phase, PhaseError, Role, move


def _request(phase: Phase, kind: Role = Role.DECODE) -> WorkerRequest:
    return WorkerRequest("r", "frontend", kind, phase, num_prompt_tokens=8)


def test_the_decode_path_is_allowed() -> None:
    r = _request(Phase.RESERVING)
    for to in (Phase.RESERVED, Phase.RECEIVING, Phase.RESERVED, Phase.DECODING):
        move(r, to)
        assert r.phase is to


def test_every_change_outside_the_table_is_refused() -> None:
    for start in Phase:
        for to in Phase:
            r = _request(start)
            if to in TRANSITIONS[start]:
                move(r, to)
                assert r.phase is to
            else:
                with pytest.raises(PhaseError, match=f"{start} -> {to}"):
                    move(r, to)
                assert r.phase is start


def test_roles_and_phases_read_as_their_wire_strings() -> None:
    assert Role("prefill") is Role.PREFILL and f"{Role.UNIFIED}" == "unified"
    assert _request(Phase.RUNNING, Role.PREFILL).kind == "prefill"
