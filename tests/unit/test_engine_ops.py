"""One declaration per engine operation: each entry of the table is an EngineCore method,
every client offers it through the table alone, and nothing else defines it (no client
method, no EngineCoreProc wrapper). The behaviour over real processes is in
tests/service/test_core_client.py."""

from __future__ import annotations

import inspect

import pytest

from tandem.engine import core_client, serial
from tandem.engine.core import EngineCore
from tandem.engine.core_client import (
    AsyncEngineCoreClient,
    AsyncMPClient,
    EngineCoreClient,
    InprocClient,
    SyncMPClient,
)
from tandem.engine.core_proc import EngineCoreProc
from tandem.engine.ops import ENGINE_OPS, EngineOp, EngineOps

CLIENTS = [EngineCoreClient, InprocClient, SyncMPClient, AsyncEngineCoreClient, AsyncMPClient]


def test_every_entry_is_an_engine_core_method() -> None:
    assert ENGINE_OPS, "the table is empty"
    for name, op in ENGINE_OPS.items():
        assert op.name == name and vars(EngineOps)[name] is op
        assert vars(EngineCore)[name] is op.method, f"{name} is not EngineCore's own method"
    # Control commands of the process protocol are never operations.
    assert not {serial.PING, serial.SHUTDOWN} & ENGINE_OPS.keys()


def test_told_operations_return_nothing() -> None:
    """A told operation's result is dropped: only those that return None may be told."""
    told = {name for name, op in ENGINE_OPS.items() if op.tell}
    assert told == {"abort_requests", "release_held"}
    for name in told:
        assert inspect.signature(getattr(EngineCore, name)).return_annotation in (None, "None")


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_clients_get_their_operations_from_the_table_alone(cls: type) -> None:
    assert issubclass(cls, EngineOps)
    for name, op in ENGINE_OPS.items():
        assert getattr(cls, name) is op, f"{cls.__name__}.{name} is not the table's entry"
        for base in cls.__mro__:
            if base is not EngineOps:
                assert name not in vars(base), f"{base.__name__} defines {name} again"
    assert not getattr(cls, "__abstractmethods__", None) or inspect.isabstract(cls)


def test_concrete_clients_implement_the_interface() -> None:
    for cls in (InprocClient, SyncMPClient, AsyncMPClient):
        assert not inspect.isabstract(cls), cls.__abstractmethods__
    assert issubclass(AsyncMPClient, AsyncEngineCoreClient)
    assert inspect.iscoroutinefunction(AsyncMPClient.call)
    assert not inspect.iscoroutinefunction(SyncMPClient.call)


def test_the_process_has_no_per_operation_code() -> None:
    for name in ENGINE_OPS:
        assert not hasattr(EngineCoreProc, name) and not hasattr(EngineCoreProc, "_" + name)
    assert not hasattr(core_client, "METHODS")


def test_an_entry_must_sit_under_its_own_name() -> None:
    # Python 3.11 wraps a __set_name__ error in a RuntimeError; 3.12 raises it as it is.
    with pytest.raises((TypeError, RuntimeError)) as info:

        class Misnamed:
            abort = EngineOp(EngineCore.abort_requests, tell=True)

    assert "under its own name" in f"{info.value} {info.value.__cause__}"


def test_an_answering_operation_cannot_be_told() -> None:
    client = InprocClient.__new__(InprocClient)  # no engine needed: refused before it runs
    with pytest.raises(TypeError, match="'reserve' answers"):
        client.tell(EngineOps.reserve, None)  # type: ignore[arg-type]
