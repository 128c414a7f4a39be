"""Shared bits of the directory tests: hash chains and a directory factory per backend."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tandem_services.directory.base import PrefixDirectory

T = TypeVar("T")
DirectoryFactory = Callable[..., PrefixDirectory]


def chain(seed: str, n: int) -> list[bytes]:
    """`n` chained 32-byte block hashes (each covers its parent), distinct per seed."""
    out: list[bytes] = []
    parent = seed.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def run_with(
    make: DirectoryFactory, body: Callable[[PrefixDirectory], Awaitable[T]], **kwargs: object
) -> T:
    """Run `body(directory)` on a fresh event loop; the directory is closed afterwards."""

    async def main() -> T:
        directory = make(**kwargs)
        try:
            return await body(directory)
        finally:
            await directory.close()

    return asyncio.run(main())
