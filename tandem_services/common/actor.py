"""One owner per piece of state: an actor with an inbox, handled one message at a time.

gRPC handlers never touch an owner's state; they `tell` it a message (fire and forget) or
`ask` it (the message carries a future the owner resolves, now or later). `handle` is plain
synchronous code, so an owner's state never changes across an `await`; work that has to wait
(an RPC to another service) runs in a task that reports back with another message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

M = TypeVar("M")
T = TypeVar("T")


def _new_future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


@dataclass
class Ask(Generic[T]):
    """Base of messages that want an answer: the owner resolves `reply`."""

    reply: asyncio.Future[T] = field(default_factory=_new_future, kw_only=True, repr=False)

    def answer(self, value: T) -> None:
        if not self.reply.done():
            self.reply.set_result(value)

    def fail(self, exc: BaseException) -> None:
        if not self.reply.done():
            self.reply.set_exception(exc)


class Actor(Generic[M]):
    """Owns state; `handle` runs each message to completion before the next one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._inbox: asyncio.Queue[M] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    def tell(self, msg: M) -> None:
        self._inbox.put_nowait(msg)

    async def ask(self, msg: Ask[T]) -> T:
        self.tell(msg)  # type: ignore[arg-type]
        return await msg.reply

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def handle(self, msg: M) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            msg = await self._inbox.get()
            try:
                self.handle(msg)
            except Exception as exc:  # an owner must outlive a bad message
                logger.exception("%s: error handling %s", self.name, type(msg).__name__)
                if isinstance(msg, Ask):
                    msg.fail(exc)
