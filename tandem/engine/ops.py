"""The engine's operations, each declared once: the process protocol and every client follow.

An operation is an `EngineCore` method and one entry in `EngineOps`::

    EngineCore.reserve(req)                     the operation (tandem/engine/core.py)
    EngineOps.reserve = EngineOp(EngineCore.reserve)     its entry, here
        ├─ EngineCoreProc   a COMMAND frame naming "reserve" runs engine.reserve(*args)
        ├─ InprocClient     client.reserve(req)          runs it here
        ├─ SyncMPClient     client.reserve(req)          sends it, waits for the REPLY
        └─ AsyncMPClient    await client.reserve(req)    sends it, the REPLY resolves it

Every client class derives from `EngineOps`, so each entry is a method of every client
(an `EngineOp` is a descriptor: on a client it is `partial(client.call, op)`), typed from the
EngineCore method's own signature (a `ParamSpec`): blocking on `EngineCoreClient`, a
coroutine on `AsyncEngineCoreClient`. A client implements only `call(op, *args, **kwargs)`
and `tell(op, *args, **kwargs)`; nothing else defines an operation
(tests/unit/test_engine_ops.py checks it).

`tell=True` marks an operation that may also be told: sent with no reply awaited (fire and
forget; a failure is logged by the engine, never raised). Only operations that return None
are told: a dropped result (a reservation's blocks) would leak. Adding an operation is then
(a) the EngineCore method and (b) its entry; beyond that only the service that calls it.

What only the process needs is not an operation: `ping` (the loop is turning) and
`shutdown` (end the loop) are the protocol's control commands (`tandem.engine.serial`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from tandem.engine.core import EngineCore

if TYPE_CHECKING:
    from tandem.engine.core_client import AsyncEngineCoreClient, EngineCoreClient

P = ParamSpec("P")
R = TypeVar("R")


class EngineOp(Generic[P, R]):
    """One engine operation: the EngineCore method it runs, and whether it may be told."""

    __slots__ = ("method", "name", "tell")

    def __init__(self, method: Callable[Concatenate[EngineCore, P], R], tell: bool = False):
        self.method = method
        self.name: str = method.__name__
        self.tell = tell

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.name:
            raise TypeError(f"operation {self.name!r} must be declared under its own name")

    def __repr__(self) -> str:
        return f"EngineOp({self.name}{', tell' if self.tell else ''})"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> EngineOp[P, R]: ...

    @overload
    def __get__(
        self, obj: AsyncEngineCoreClient, owner: type | None = None
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __get__(self, obj: EngineCoreClient, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return functools.partial(obj.call, self)


class EngineOps:
    """The table: every operation a client offers, one entry each (see the module docstring).

    Clients derive from it; `EngineOps.<name>` is the entry itself (for `call` and `tell`).
    """

    add_request = EngineOp(EngineCore.add_request)
    abort_requests = EngineOp(EngineCore.abort_requests, tell=True)
    reserve = EngineOp(EngineCore.reserve)
    add_prefilled_request = EngineOp(EngineCore.add_prefilled_request)
    release_held = EngineOp(EngineCore.release_held, tell=True)
    get_held_block_ids = EngineOp(EngineCore.get_held_block_ids)
    stats = EngineOp(EngineCore.stats)
    cached_block_hashes = EngineOp(EngineCore.cached_block_hashes)
    pool_state = EngineOp(EngineCore.pool_state)


# The entries by name (what a COMMAND frame names).
ENGINE_OPS: dict[str, EngineOp[..., Any]] = {
    op.name: op for op in vars(EngineOps).values() if isinstance(op, EngineOp)
}
