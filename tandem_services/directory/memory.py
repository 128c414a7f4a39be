"""In-process prefix-cache directory: the default when no Redis URL is given.

Two indexes kept in step: worker -> hashes it holds (for removal and counts) and
hash -> workers holding it (so a chain walk touches only the blocks it needs). Expired
workers are purged lazily, at the next call that reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from tandem_services.directory.base import (
    DEFAULT_WORKER_TTL_S,
    PrefixDirectory,
    check_block_hashes,
    check_worker_id,
)

_NO_HOLDERS: frozenset[str] = frozenset()


class InMemoryDirectory(PrefixDirectory):
    """A `PrefixDirectory` in this process's memory; never unavailable."""

    def __init__(
        self,
        worker_ttl_s: float | None = DEFAULT_WORKER_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(worker_ttl_s)
        self._clock = clock
        self._blocks: dict[str, set[bytes]] = {}
        self._holders: dict[bytes, set[str]] = {}
        self._deadline: dict[str, float | None] = {}

    async def publish(
        self, worker_id: str, added: Sequence[bytes], evicted: Sequence[bytes] = ()
    ) -> bool:
        check_worker_id(worker_id)
        check_block_hashes(added)
        check_block_hashes(evicted)
        self._purge_expired()
        blocks = self._blocks.setdefault(worker_id, set())
        held_before = bool(blocks)
        for h in evicted:
            if h in blocks:
                blocks.discard(h)
                self._drop_holder(h, worker_id)
        for h in added:
            if h not in blocks:
                blocks.add(h)
                self._holders.setdefault(h, set()).add(worker_id)
        self._touch(worker_id, self.ttl_for(worker_id))
        return held_before

    async def replace_worker(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        check_worker_id(worker_id)
        new_blocks = set(block_hashes)
        check_block_hashes(new_blocks)
        self._drop_worker(worker_id)
        self._purge_expired()
        self._blocks[worker_id] = new_blocks
        for h in new_blocks:
            self._holders.setdefault(h, set()).add(worker_id)
        self._touch(worker_id, self.ttl_for(worker_id))

    async def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        self._purge_expired()
        result: dict[str, int] = {}
        if not block_hashes:
            return result
        alive = set(self._holders.get(block_hashes[0], ()))
        i, n = 1, len(block_hashes)
        while alive and i < n:
            missing = alive - self._holders.get(block_hashes[i], _NO_HOLDERS)
            for w in missing:
                result[w] = i
            alive -= missing
            i += 1
        for w in alive:
            result[w] = n
        return result

    async def heartbeat(self, worker_id: str, ttl_s: float | None = None) -> bool:
        check_worker_id(worker_id)
        ttl = self.set_worker_ttl(worker_id, ttl_s)
        self._purge_expired()
        if not self._blocks.get(worker_id):
            return False
        self._touch(worker_id, ttl)
        return True

    async def remove_worker(self, worker_id: str) -> None:
        self._drop_worker(worker_id)
        self._ttl_s.pop(worker_id, None)

    async def num_blocks(self, worker_id: str) -> int:
        self._purge_expired()
        return len(self._blocks.get(worker_id, ()))

    async def workers(self) -> set[str]:
        self._purge_expired()
        return {w for w, blocks in self._blocks.items() if blocks}

    def _touch(self, worker_id: str, ttl_s: float | None) -> None:
        self._deadline[worker_id] = None if ttl_s is None else self._clock() + ttl_s

    def _purge_expired(self) -> None:
        now = self._clock()
        expired = [w for w, d in self._deadline.items() if d is not None and d <= now]
        for w in expired:
            self._drop_worker(w)

    def _drop_worker(self, worker_id: str) -> None:
        for h in self._blocks.pop(worker_id, ()):
            self._drop_holder(h, worker_id)
        self._deadline.pop(worker_id, None)

    def _drop_holder(self, h: bytes, worker_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]
