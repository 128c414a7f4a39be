"""The prefix-cache directory: which worker holds which cached KV block.

Workers publish the hashes of the full blocks their prefix cache holds (`publish`, batched);
the scheduler asks, for a prompt's chain of block hashes, how many leading blocks each
worker holds (`longest_prefix`). A block hash chains its parent's hash, so holding block
`i` of a chain is only useful when blocks `0..i-1` are held too: a worker's count stops at
its first miss.

    chain:     h0  h1  h2  h3  h4
    worker A:  x   x   x   .   x     -> 3 (h4 is useless without h3)
    worker B:  .   x   x   x   x     -> 0 (absent from the answer)

Liveness: every worker has a time to live. `publish`, `replace_worker` and `heartbeat`
push its deadline forward; a worker whose deadline passes loses all its entries (a worker
that crashed or stalled stops attracting requests). `remove_worker` drops them at once.

Errors: an implementation that talks to a server raises `DirectoryUnavailable` when the
server cannot be reached, quickly, so callers fall back to routing on load alone. The
directory is a hint: losing it never makes a request fail.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

DEFAULT_WORKER_TTL_S = 30.0
MAX_BLOCK_HASH_BYTES = 64


class DirectoryUnavailable(ConnectionError):
    """The directory's backing server could not be reached (or answered an error).

    Callers treat this as "no prefix information": route on load, keep serving.
    """


class PrefixDirectory(abc.ABC):
    """Block hash -> workers that hold it. All methods are coroutines; one event loop.

    Invariants every implementation keeps (the shared test suite pins them):
    - `publish(w, added, evicted)` applies `evicted` first, then `added`: a hash in both
      ends up held.
    - `longest_prefix` lists only workers that hold at least the chain's first block, with
      the number of leading blocks they hold; an empty chain gives `{}`.
    - A worker whose time to live ran out is absent everywhere, as if removed.
    - Block hashes are opaque bytes (1 to `MAX_BLOCK_HASH_BYTES`); worker ids are
      non-empty strings.
    """

    def __init__(self, worker_ttl_s: float | None = DEFAULT_WORKER_TTL_S) -> None:
        if worker_ttl_s is not None and worker_ttl_s <= 0:
            raise ValueError(f"worker_ttl_s must be > 0 or None, got {worker_ttl_s}")
        self.worker_ttl_s = worker_ttl_s
        # Per-worker time to live set by `heartbeat`; `worker_ttl_s` otherwise.
        self._ttl_s: dict[str, float | None] = {}
        # Times an operation raised DirectoryUnavailable (exported as a metric later).
        self.num_unavailable_errors = 0

    def ttl_for(self, worker_id: str) -> float | None:
        """The time to live applied when `worker_id` publishes (None: never expires)."""
        return self._ttl_s.get(worker_id, self.worker_ttl_s)

    @abc.abstractmethod
    async def publish(
        self, worker_id: str, added: Sequence[bytes], evicted: Sequence[bytes] = ()
    ) -> bool:
        """Apply one batch of a worker's cache changes and refresh its deadline.

        Returns whether the directory held entries for the worker before this batch. False
        after they expired or were removed (or for a worker that held nothing): the caller's
        earlier publishes are gone, so it should republish its full set (`replace_worker`).
        """

    @abc.abstractmethod
    async def replace_worker(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        """Make `block_hashes` exactly the set `worker_id` holds (a full republish)."""

    @abc.abstractmethod
    async def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, how many leading hashes of the chain it holds (first miss stops)."""

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, ttl_s: float | None = None) -> bool:
        """Push the worker's deadline to now + `ttl_s` (default: its current time to live).

        `ttl_s` becomes the worker's time to live for later publishes too. Returns whether
        the directory still holds entries for the worker: False after they expired or were
        removed, which tells a publisher to republish what it holds.
        """

    @abc.abstractmethod
    async def remove_worker(self, worker_id: str) -> None:
        """Drop every entry of `worker_id` (it left the pool)."""

    @abc.abstractmethod
    async def num_blocks(self, worker_id: str) -> int:
        """How many block hashes the directory holds for the worker (0 if unknown/expired)."""

    @abc.abstractmethod
    async def workers(self) -> set[str]:
        """Ids of the live workers that hold at least one block."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The directory must not be used afterwards."""

    def set_worker_ttl(self, worker_id: str, ttl_s: float | None) -> float | None:
        """Set the time to live applied to `worker_id` from now on (no I/O); returns it.

        None keeps the current one.
        """
        if ttl_s is not None:
            if ttl_s <= 0:
                raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
            self._ttl_s[worker_id] = ttl_s
        return self.ttl_for(worker_id)


def check_worker_id(worker_id: str) -> None:
    """Reject ids that cannot name a worker (empty, or not a str)."""
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")


def check_block_hashes(block_hashes: Iterable[bytes]) -> None:
    """Reject hashes that are not bytes of 1 to `MAX_BLOCK_HASH_BYTES` bytes."""
    for h in block_hashes:
        if not isinstance(h, bytes) or not 0 < len(h) <= MAX_BLOCK_HASH_BYTES:
            raise ValueError(f"a block hash must be 1 to {MAX_BLOCK_HASH_BYTES} bytes, got {h!r}")
