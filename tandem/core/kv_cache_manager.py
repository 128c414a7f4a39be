"""Per-request block allocation over a `BlockPool`, with prefix caching.

A request's block table is append-only: blocks are added as its tokens grow and all are
released together by `free`, so a block id that has been handed to a runner (or another
process) never changes meaning while the request lives.

Regions of one `allocate_slots` call::

    |<--- request.num_computed_tokens --->|<- num_new_computed_tokens ->|<- num_new_tokens ->|
    [ blocks the request already holds   ][ new_computed_blocks (hits) ][ fresh blocks ...... ]

Blocks that will be full once this step's tokens are computed are registered in the prefix
cache at allocation time. A later request in the same step may hit them: the attention
backend writes a step's KV before reading it. If the owner is preempted before the step
runs, `free` takes back the registrations whose KV was never written.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.block_pool import BlockPool, CacheEventListener, KVCacheBlock
from tandem.core.kv_cache_utils import BlockHash, update_block_hashes
from tandem.request import Request


@dataclass
class PrefixCacheStats:
    """Running prefix-cache counters: tokens looked up and tokens found, over admissions."""

    num_requests: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees KV blocks per request; finds cached prefixes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are registered in (or came from) the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Where the request's latest allocation started registering blocks (see `free`).
        self._last_registered_from: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def max_num_blocks_per_req(self) -> int:
        """Width of a block table (0 when max_model_len is unknown)."""
        return cdiv(self.max_model_len, self.block_size) if self.max_model_len else 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`'s full blocks, and its length in tokens.

        Never the whole request: at least one token must remain to compute (the step that
        computes it samples the next token), so the hit is capped at `num_tokens - 1`
        rounded down to whole blocks. Takes no references; `allocate_slots` does.
        """
        if not self.enable_caching:
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`; return the fresh blocks.

        `delay_caching` leaves the new full blocks out of the prefix index: a reservation for
        KV that arrives from another worker registers them with `cache_blocks` once it landed.

        `new_computed_blocks` (cache hits from `get_computed_blocks`) and
        `num_new_computed_tokens` (their tokens, plus any whose KV arrives from elsewhere and
        needs fresh blocks) are only passed when a request is admitted. Returns None, changing
        nothing, when the pool is short.
        """
        if not new_computed_blocks and not num_new_computed_tokens:
            # Fast path (most decode steps): the tokens fit the blocks held and no block
            # becomes full of known tokens, so nothing is allocated or registered.
            req_id = request.request_id
            held = self.req_to_blocks.get(req_id)
            if held:
                needed = request.num_computed_tokens + num_new_tokens
                block_size = self.block_size
                if needed <= len(held) * block_size and (
                    not self.max_model_len or needed <= self.max_model_len
                ):
                    if not self.enable_caching:
                        return []
                    known = len(request.all_token_ids)
                    if (needed if needed < known else known) // block_size <= (
                        self.num_cached_blocks[req_id]
                    ):
                        return []
        new_computed_blocks = new_computed_blocks or []
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if num_new_computed_tokens < len(new_computed_blocks) * self.block_size:
            raise ValueError("num_new_computed_tokens does not cover new_computed_blocks")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        if new_computed_blocks and req_blocks:
            raise ValueError(f"request {req_id} already holds blocks; hits only on admission")

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_needed = num_computed + num_new_tokens
        if self.max_model_len and num_tokens_needed > self.max_model_len:
            raise ValueError(
                f"request {req_id} needs {num_tokens_needed} slots > max_model_len "
                f"{self.max_model_len}"
            )
        num_new_blocks = max(
            0,
            cdiv(num_tokens_needed, self.block_size) - len(req_blocks) - len(new_computed_blocks),
        )
        # Reviving a free hit block takes it out of the free queue too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None

        first_allocation = req_id not in self.req_to_blocks
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(req_id, [])
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        if first_allocation:
            self.num_cached_blocks[req_id] = len(new_computed_blocks)
            if self.enable_caching:
                stats = self.prefix_cache_stats
                stats.num_requests += 1
                stats.num_query_tokens += request.num_tokens
                stats.num_hit_tokens += len(new_computed_blocks) * self.block_size

        if self.enable_caching and not delay_caching:
            self._cache_full_blocks(request, min(num_tokens_needed, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first `num_tokens` tokens (their KV
        must be written)."""
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens."""
        req_id = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_blocks[req_id]
        self._last_registered_from[req_id] = num_cached
        if num_full <= num_cached:
            return
        block_hashes = update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[req_id][num_cached:num_full], block_hashes[num_cached:num_full]
        )
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release all of `request`'s blocks, tail first (its last blocks are evicted first).

        Blocks that the latest allocation registered past `request.num_computed_tokens` were
        meant for a step that will not run (preemption right after allocation): their KV was
        never written, so they leave the cache first. Freeing a request that holds no blocks
        is a no-op.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, [])
        num_cached = self.num_cached_blocks.pop(req_id, 0)
        start = max(
            request.num_computed_tokens // self.block_size,
            self._last_registered_from.pop(req_id, num_cached),
        )
        for block in blocks[start:num_cached]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a fresh list; the table itself only ever grows)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def publish_cache_events(self, listener: CacheEventListener | None) -> None:
        """Tell `listener` of every prefix hash registered or evicted (a prefix directory)."""
        self.block_pool.on_cache_event = listener

    def published_block_hashes(self) -> list[BlockHash]:
        """The prefix hashes cached now, as `publish_cache_events` names them."""
        return self.block_pool.cached_block_hashes()

    def check_invariants(self) -> None:
        """The pool's invariants, plus: ref counts equal the number of holders of each block."""
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        for blocks in self.req_to_blocks.values():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"a request holds a block twice: {ids}"
            for b in blocks:
                holders[b.block_id] += 1
        for b in self.block_pool.blocks:
            assert b.ref_cnt == holders[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {holders[b.block_id]} holders"
            )
