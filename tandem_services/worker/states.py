"""A worker's roles and its requests' phases, with every allowed phase change in one table.

    unified:  RUNNING ──────────────────────────────────────────────▶ (finished)
    prefill:  RUNNING ─ first token ─▶ HANDING_OFF ─ sent + AddPrefilled ─▶ (done)
    decode:   RESERVING ─▶ RESERVED ⇄ RECEIVING        RESERVED ─ AddPrefilled ─▶ DECODING

A request leaves the table (finished, aborted) from any phase; `move` refuses every other
change, so a phase can only follow the protocol.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol


class Role(StrEnum):
    """What a worker (and each of its requests) does."""

    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"


class Phase(StrEnum):
    RUNNING = "running"
    HANDING_OFF = "handing_off"
    RESERVING = "reserving"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    DECODING = "decoding"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.RUNNING: frozenset({Phase.HANDING_OFF}),
    Phase.HANDING_OFF: frozenset(),
    Phase.RESERVING: frozenset({Phase.RESERVED}),
    Phase.RESERVED: frozenset({Phase.RECEIVING, Phase.DECODING}),
    Phase.RECEIVING: frozenset({Phase.RESERVED}),
    Phase.DECODING: frozenset(),
}

# Phases whose blocks are being read or written by a KV transfer: an abort waits for its end.
TRANSFERRING = frozenset({Phase.HANDING_OFF, Phase.RECEIVING})


class HasPhase(Protocol):
    request_id: str
    phase: Phase


class PhaseError(RuntimeError):
    """A phase change the protocol does not allow (a bug, never a client's error)."""


def move(r: HasPhase, to: Phase) -> None:
    """Change `r`'s phase, or raise PhaseError when the table does not allow it."""
    if to not in TRANSITIONS[Phase(r.phase)]:
        raise PhaseError(f"request {r.request_id}: {r.phase} -> {to} is not allowed")
    r.phase = to
