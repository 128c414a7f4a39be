"""A worker's side of the directory: batch its cache changes, survive outages.

The engine reports each step's cache changes with `record(added, evicted)` (any thread,
never blocks, no I/O). A task on the event loop publishes them in batches:

    record ──> pending (last state per hash wins) ──> publish() when
                                                       max_batch hashes are pending, or
                                                       max_delay_s after the first one

Outages: when the directory raises `DirectoryUnavailable`, the pending batch is dropped and
the publisher is *dirty*: it keeps no backlog (memory stays bounded) and retries every
`retry_interval_s` with a full republish, `replace_worker(worker_id, held_block_hashes())`,
which also clears whatever stale entries the directory kept. The same happens when the
directory reports that it lost this worker's entries (heartbeat or publish answered "held
nothing": they expired during a stall, or the server restarted empty).

Ordering: batches go out one at a time, in order. A republish clears `pending` *before*
calling `held_block_hashes()`, so a change recorded meanwhile is published after the
snapshot and the directory ends in the pool's latest state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable

from tandem_services.directory.base import DirectoryUnavailable, PrefixDirectory

logger = logging.getLogger(__name__)


class DirectoryPublisher:
    """Publishes one worker's block-hash additions and evictions to a `PrefixDirectory`.

    `held_block_hashes` returns every hash the worker's prefix cache holds now; it is called
    on the event loop thread and must be safe there (e.g. return a snapshot taken under the
    engine's lock). `ttl_s` is this worker's time to live in the directory (None: the
    directory's default); heartbeats go out every `heartbeat_interval_s` (default ttl / 3).
    """

    def __init__(
        self,
        directory: PrefixDirectory,
        worker_id: str,
        held_block_hashes: Callable[[], Iterable[bytes]],
        *,
        max_delay_s: float = 0.05,
        max_batch: int = 512,
        ttl_s: float | None = None,
        heartbeat_interval_s: float | None = None,
        retry_interval_s: float = 0.5,
    ) -> None:
        if max_delay_s < 0 or max_batch <= 0 or retry_interval_s <= 0:
            raise ValueError("max_delay_s >= 0, max_batch > 0 and retry_interval_s > 0 needed")
        self.directory = directory
        self.worker_id = worker_id
        self._held_block_hashes = held_block_hashes
        self.max_delay_s = max_delay_s
        self.max_batch = max_batch
        self.retry_interval_s = retry_interval_s
        ttl = directory.set_worker_ttl(worker_id, ttl_s)
        if heartbeat_interval_s is None and ttl is not None:
            heartbeat_interval_s = ttl / 3
        if heartbeat_interval_s is not None and heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        self.heartbeat_interval_s = heartbeat_interval_s

        # Shared with recording threads, under `_lock`.
        self._lock = threading.Lock()
        self._pending: dict[bytes, bool] = {}  # hash -> held (True) or evicted (False)
        self._dirty = True  # nothing published yet: start with a full publish
        self._republishing = False

        # Event loop side.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._has_pending: asyncio.Event | None = None
        self._batch_full: asyncio.Event | None = None
        self._io_lock: asyncio.Lock | None = None
        self._stop_event: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._was_unavailable = False

        # Counters (exported as metrics by the service).
        self.num_flushes = 0
        self.num_published_hashes = 0
        self.num_dropped_hashes = 0
        self.num_republishes = 0
        self.num_unavailable_errors = 0

    @property
    def dirty(self) -> bool:
        """True until the directory is known to hold this worker's current set."""
        return self._dirty

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def record(self, added: Iterable[bytes] = (), evicted: Iterable[bytes] = ()) -> None:
        """Note cache changes, in the order they happened (evictions of a step first).

        Thread-safe and non-blocking. While the directory is unreachable, changes are
        counted as dropped: the next full republish covers them.
        """
        with self._lock:
            if self._dirty and not self._republishing:
                self.num_dropped_hashes += _count(added) + _count(evicted)
                return
            was_empty = not self._pending
            for h in evicted:
                self._pending[h] = False
            for h in added:
                self._pending[h] = True
            num_pending = len(self._pending)
        if was_empty and num_pending:
            self._signal(self._has_pending)
        if num_pending >= self.max_batch:
            self._signal(self._batch_full)

    async def start(self) -> None:
        """Start the background task on the running loop (first action: a full publish)."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._has_pending = asyncio.Event()
        self._batch_full = asyncio.Event()
        self._io_lock = asyncio.Lock()
        self._stop_event = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"directory-publisher-{self.worker_id}")

    async def stop(self, remove: bool = True) -> None:
        """Stop the task; then remove this worker's entries (`remove`) or flush what's left."""
        self._stopping = True
        for ev in (self._has_pending, self._batch_full, self._stop_event):
            if ev is not None:
                ev.set()
        if self._task is not None:
            await self._task
            self._task = None
        with contextlib.suppress(DirectoryUnavailable):
            if remove:
                await self.directory.remove_worker(self.worker_id)
            else:
                await self.flush()

    async def flush(self) -> bool:
        """Publish pending changes now (a full republish while dirty). True on success."""
        if self._io_lock is None:
            self._io_lock = asyncio.Lock()
        async with self._io_lock:
            if self._dirty:
                return await self._republish()
            with self._lock:
                batch, self._pending = self._pending, {}
            self._clear_events()
            if not batch:
                return True
            added = [h for h, held in batch.items() if held]
            evicted = [h for h, held in batch.items() if not held]
            try:
                held_before = await self.directory.publish(self.worker_id, added, evicted)
            except DirectoryUnavailable as exc:
                self._mark_dirty(dropped=len(batch), reason=exc)
                return False
            self.num_flushes += 1
            self.num_published_hashes += len(batch)
            if not held_before:
                # Our earlier publishes are gone (expired, or a fresh server): resend all.
                self._mark_dirty(dropped=0, reason=None)
                return await self._republish()
            return True

    async def heartbeat(self) -> bool:
        """Refresh this worker's deadline; marks dirty if the directory lost its entries."""
        if self._io_lock is None:
            self._io_lock = asyncio.Lock()
        async with self._io_lock:
            try:
                held = await self.directory.heartbeat(self.worker_id)
            except DirectoryUnavailable as exc:
                self._mark_dirty(dropped=0, reason=exc)
                return False
            if not held:
                self._mark_dirty(dropped=0, reason=None)
            return held

    async def _republish(self) -> bool:
        with self._lock:
            self._pending = {}
            self._republishing = True
        self._clear_events()
        ok = False
        try:
            hashes = list(self._held_block_hashes())
            await self.directory.replace_worker(self.worker_id, hashes)
            ok = True
        except DirectoryUnavailable as exc:
            self._note_unavailable(exc)
        finally:
            with self._lock:
                self._republishing = False
                if ok:
                    self._dirty = False
                else:  # the next attempt takes a new snapshot: no backlog
                    self.num_dropped_hashes += len(self._pending)
                    self._pending = {}
        if not ok:
            return False
        self.num_republishes += 1
        if self._was_unavailable:
            self._was_unavailable = False
            logger.info(
                "prefix directory back: worker %s republished %d block hashes",
                self.worker_id,
                len(hashes),
            )
        return True

    async def _run(self) -> None:
        assert self._has_pending is not None and self._batch_full is not None
        loop = asyncio.get_running_loop()
        interval = self.heartbeat_interval_s
        next_heartbeat = None if interval is None else loop.time() + interval
        while not self._stopping:
            try:
                if self._dirty:
                    if not await self.flush():
                        await self._sleep(self.retry_interval_s)
                    if interval is not None:
                        next_heartbeat = loop.time() + interval
                    continue
                timeout = None if next_heartbeat is None else next_heartbeat - loop.time()
                await _wait(self._has_pending, timeout)
                if self._stopping:
                    break
                if self._pending:
                    await _wait(self._batch_full, self.max_delay_s)
                    await self.flush()
                if next_heartbeat is not None and loop.time() >= next_heartbeat:
                    await self.heartbeat()
                    next_heartbeat = loop.time() + (interval or 0.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("directory publisher for worker %s failed", self.worker_id)
                self._mark_dirty(dropped=0, reason=None)
                await self._sleep(self.retry_interval_s)

    def _mark_dirty(self, dropped: int, reason: DirectoryUnavailable | None) -> None:
        with self._lock:
            self._dirty = True
            self._pending = {}
        self._clear_events()
        self.num_dropped_hashes += dropped
        if reason is not None:
            self._note_unavailable(reason)

    def _note_unavailable(self, exc: DirectoryUnavailable) -> None:
        self.num_unavailable_errors += 1
        if not self._was_unavailable:
            self._was_unavailable = True
            logger.warning(
                "prefix directory unavailable for worker %s (will republish when back): %s",
                self.worker_id,
                exc,
            )

    def _clear_events(self) -> None:
        for ev in (self._has_pending, self._batch_full):
            if ev is not None:
                ev.clear()

    def _signal(self, ev: asyncio.Event | None) -> None:
        loop = self._loop
        if ev is None or loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            ev.set()
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: nothing to wake
                loop.call_soon_threadsafe(ev.set)

    async def _sleep(self, seconds: float) -> None:
        assert self._stop_event is not None
        await _wait(self._stop_event, seconds)  # stop() wakes it early


async def _wait(ev: asyncio.Event, timeout: float | None) -> None:
    if timeout is not None and timeout <= 0:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ev.wait(), timeout)


def _count(hashes: Iterable[bytes]) -> int:
    try:
        return len(hashes)  # type: ignore[arg-type]
    except TypeError:
        return sum(1 for _ in hashes)
