"""Block allocation for a cache of several groups (one per attention kind) over one pool.

`build_kv_cache_manager` picks the manager: the plain `KVCacheManager` for one full-attention
group (every model without sliding-window layers, unchanged and as fast as before), this one
otherwise (`tandem.core.kv_cache_spec` says how layers form groups).

A request's block tables, G groups of them, are kept as one interleaved list, so the
scheduler and the runner move them as they move a plain table (append-only, only the new tail
sent each step); the runner splits it by group (`flat[j * G + g]` is group g's block for
tokens `j * block_size ...`)::

    logical block     0            1            2            3
    flat              f0 s0 s0'    f1 s1 s1'    f2 s2 s2'    f3 s3 s3'      (G = 3)
    after the window  f0 -- --     f1 -- --     f2 s2 s2'    f3 s3 s3'      (-- NULL_BLOCK)

As a request advances, each sliding group drops the leading blocks that no query of the
request reads any more (`KVCacheGroupSpec.num_skipped_blocks` of its computed tokens): their
references go back to the pool and their entries become the null block. The runner's copy of
the table keeps the old ids there; nothing reads them. Preemption and finishing free every
block a request still holds.

Prefix caching: block j of group g is registered under its own key (the token hash for group
0, the token hash followed by g for the others), so equal prefixes match group by group; only
group 0's keys reach a prefix directory (`publish_cache_events`). A
hit of n blocks needs all n in every full group, and in a sliding group only those its window
reads at the hit point (`get_computed_blocks`); the entries left of the window are null. A
block freed by the window keeps its hash in the pool (free and evictable, its KV still valid)
until it is handed out again.

Disaggregation: a prefill worker holds a finished request's tables (`get_block_ids`); a decode
worker reserves its own with `delay_caching` (hits and the window's blocks at the prompt's
end; null entries left of it) and registers them with `cache_blocks` once the KV landed.
`KVCacheSpec.handoff_indices` names the entries that move.
"""

from __future__ import annotations

from tandem.core.block_pool import BlockPool, CacheEventListener, KVCacheBlock
from tandem.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from tandem.core.kv_cache_spec import NULL_BLOCK_ID, KVCacheSpec, cdiv
from tandem.core.kv_cache_utils import HASH_NUM_BYTES, BlockHash, update_block_hashes
from tandem.request import Request

# Stands in a table for a block a sliding group has freed; never in the pool's lists.
NULL_BLOCK = KVCacheBlock(NULL_BLOCK_ID)


def build_kv_cache_manager(
    spec: KVCacheSpec,
    num_blocks: int,
    enable_caching: bool = True,
    max_model_len: int = 0,
) -> KVCacheManager | HybridKVCacheManager:
    """The manager for `spec`: the plain one for a single full-attention group."""
    if spec.is_plain:
        return KVCacheManager(num_blocks, spec.block_size, enable_caching, max_model_len)
    return HybridKVCacheManager(spec, num_blocks, enable_caching, max_model_len)


def group_block_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a group's block: the token hash itself for group 0, else the
    hash followed by the group number (longer than a token hash: never published)."""
    if group == 0:
        return block_hash
    return block_hash + group.to_bytes(2, "little")


def _token_hashes(keys: list[BlockHash]) -> list[BlockHash]:
    return [k for k in keys if len(k) == HASH_NUM_BYTES]


class HybridKVCacheManager:
    """Allocates per-group blocks from one pool (see the module docstring). Same interface as
    `KVCacheManager`; `req_to_blocks` holds the interleaved tables."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        enable_caching: bool = True,
        max_model_len: int = 0,
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.num_groups = spec.num_groups
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # (group, window) of the sliding groups.
        self._sliding = [
            (g, group.sliding_window)
            for g, group in enumerate(spec.groups)
            if group.sliding_window is not None
        ]
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading logical blocks registered in (or hit in) the cache, per request.
        self.num_cached_blocks: dict[str, int] = {}
        self._last_registered_from: dict[str, int] = {}
        # Per request, per sliding group (in `_sliding` order): leading logical blocks freed.
        self._num_freed: dict[str, list[int]] = {}
        # Per request: the computed-token count at which a sliding group frees its next block.
        self._next_free_at: dict[str, int] = {}
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
        """Width of an interleaved table (0 when max_model_len is unknown)."""
        if not self.max_model_len:
            return 0
        return cdiv(self.max_model_len, self.block_size) * self.num_groups

    # ----------------------------------------------------------------- prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix (interleaved, G entries per logical block) and its length
        in tokens; at least one token is left to compute. Takes no references.

        A hit of n blocks needs blocks 0..n-1 in each full group, and in each sliding group
        only the blocks its window still reads at the hit point (entries left of it are
        `NULL_BLOCK`)::

            hit point h = n * block_size, window w:  sliding group needs blocks
                                                     skip(h) .. n-1, skip(h) = (h - w + 1) // bs
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        G = self.num_groups
        block_hashes = update_block_hashes(request, bs)
        n = min(len(block_hashes), (request.num_tokens - 1) // bs)
        get = self.block_pool.get_cached_block
        # Per group, the cached block of each logical block below n (None: not cached).
        found: list[list[KVCacheBlock | None]] = [[] for _ in range(G)]
        sliding = {g for g, _ in self._sliding}
        for j in range(n):
            for g in range(G):
                if g not in sliding:
                    block = get(group_block_key(block_hashes[j], g))
                    if block is None:
                        n = j  # a full group's hit is a prefix
                        break
                    found[g].append(block)
            if n == j:
                break
        for g in sliding:
            found[g] = [get(group_block_key(h, g)) for h in block_hashes[:n]]
        # Shrink n until every sliding group has the blocks its window reads (monotone).
        while n > 0:
            shrunk = n
            for g in sliding:
                group = self.spec.groups[g]
                while shrunk > 0:
                    lo = group.num_skipped_blocks(shrunk * bs, bs)
                    missing = [j for j in range(lo, shrunk) if found[g][j] is None]
                    if not missing:
                        break
                    shrunk = missing[-1]
            if shrunk == n:
                break
            n = shrunk
        hits: list[KVCacheBlock] = []
        skip = [0] * G
        for g in sliding:
            skip[g] = self.spec.groups[g].num_skipped_blocks(n * bs, bs)
        for j in range(n):
            for g in range(G):
                block = found[g][j] if j >= skip[g] else None
                hits.append(NULL_BLOCK if block is None else block)
        return hits, n * bs

    # ----------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens in every group; return the fresh blocks
        (None, nothing allocated, when the pool is short). Sliding groups first free the
        blocks that left their window (that is never undone: no later query reads them).
        `delay_caching` leaves the new full blocks out of the prefix index (KV that another
        worker writes registers with `cache_blocks` once it landed)."""
        req_id = request.request_id
        G = self.num_groups
        bs = self.block_size
        hits = new_computed_blocks or []
        if not hits and not num_new_computed_tokens:
            held = self.req_to_blocks.get(req_id)
            if held:
                # Fast path (most decode steps): the tokens fit, no window moved past a block
                # and no block becomes full of known tokens.
                c = request.num_computed_tokens
                needed = c + num_new_tokens
                if (
                    needed <= len(held) // G * bs
                    and c < self._next_free_at[req_id]
                    and (not self.max_model_len or needed <= self.max_model_len)
                ):
                    if not self.enable_caching:
                        return []
                    known = len(request.all_token_ids)
                    if min(needed, known) // bs <= self.num_cached_blocks[req_id]:
                        return []
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if len(hits) % G:
            raise ValueError(f"{len(hits)} hit blocks is not a whole number of {G} groups")
        num_hit_blocks = len(hits) // G
        if num_new_computed_tokens < num_hit_blocks * bs:
            raise ValueError("num_new_computed_tokens does not cover new_computed_blocks")
        req_blocks = self.req_to_blocks.get(req_id, [])
        if hits and req_blocks:
            raise ValueError(f"request {req_id} already holds blocks; hits only on admission")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        needed = num_computed + num_new_tokens
        if self.max_model_len and needed > self.max_model_len:
            raise ValueError(
                f"request {req_id} needs {needed} slots > max_model_len {self.max_model_len}"
            )

        first_allocation = req_id not in self.req_to_blocks
        if first_allocation:
            freed = self._num_freed[req_id] = [0] * len(self._sliding)
        else:
            freed = self._num_freed[req_id]
            self._free_left_of_window(req_id, req_blocks, num_computed)

        # Per group: logical blocks below `skip[g]` need no block.
        skip = [0] * G
        for i, (g, _) in enumerate(self._sliding):
            skip[g] = max(freed[i], self.spec.groups[g].num_skipped_blocks(num_computed, bs))
        held_logical = len(req_blocks) // G
        num_logical = max(cdiv(needed, bs), held_logical + num_hit_blocks)
        taken_hits: list[KVCacheBlock] = []
        for j in range(num_hit_blocks):
            for g in range(G):
                if j >= skip[g]:
                    taken_hits.append(hits[j * G + g])
        start = held_logical + num_hit_blocks
        num_fresh = sum(max(0, num_logical - max(start, skip[g])) for g in range(G))
        num_revived = sum(1 for b in taken_hits if b.ref_cnt == 0)
        if num_fresh + num_revived > self.block_pool.num_free_blocks:
            if first_allocation:
                del self._num_freed[req_id]
            return None

        pool = self.block_pool
        pool.touch(taken_hits)
        fresh = pool.get_new_blocks(num_fresh)
        req_blocks = self.req_to_blocks.setdefault(req_id, [])
        for j in range(num_hit_blocks):
            for g in range(G):
                req_blocks.append(hits[j * G + g] if j >= skip[g] else NULL_BLOCK)
        it = iter(fresh)
        for j in range(start, num_logical):
            for g in range(G):
                req_blocks.append(next(it) if j >= skip[g] else NULL_BLOCK)
        for i, (g, _) in enumerate(self._sliding):
            freed[i] = max(freed[i], min(skip[g], num_logical))
        self._next_free_at[req_id] = self._next_free_point(freed)
        if first_allocation:
            self.num_cached_blocks[req_id] = num_hit_blocks
            if self.enable_caching:
                stats = self.prefix_cache_stats
                stats.num_requests += 1
                stats.num_query_tokens += request.num_tokens
                stats.num_hit_tokens += num_hit_blocks * bs
        if self.enable_caching and not delay_caching:
            self._cache_full_blocks(request, min(needed, request.num_tokens))
        return fresh

    def _next_free_point(self, freed: list[int]) -> int:
        """The computed-token count at which some sliding group frees its next block."""
        bs = self.block_size
        points = [(freed[i] + 1) * bs + w - 1 for i, (_, w) in enumerate(self._sliding)]
        return min(points) if points else 1 << 62

    def _free_left_of_window(
        self, req_id: str, req_blocks: list[KVCacheBlock], num_computed: int
    ) -> None:
        """Give back the blocks of each sliding group that no query from `num_computed` on
        reads; their entries become the null block."""
        if num_computed < self._next_free_at[req_id]:
            return
        G = self.num_groups
        bs = self.block_size
        freed = self._num_freed[req_id]
        held_logical = len(req_blocks) // G
        to_free: list[KVCacheBlock] = []
        for i, (g, _) in enumerate(self._sliding):
            upto = min(self.spec.groups[g].num_skipped_blocks(num_computed, bs), held_logical)
            for j in range(freed[i], upto):
                block = req_blocks[j * G + g]
                if block is not NULL_BLOCK:
                    to_free.append(block)
                    req_blocks[j * G + g] = NULL_BLOCK
            freed[i] = max(freed[i], upto)
        # Later blocks first: a request's earlier blocks (most shareable) are evicted last.
        self.block_pool.free_blocks(reversed(to_free))
        self._next_free_at[req_id] = self._next_free_point(freed)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first `num_tokens` tokens."""
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        req_id = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_blocks[req_id]
        self._last_registered_from[req_id] = num_cached
        if num_full <= num_cached:
            return
        block_hashes = update_block_hashes(request, self.block_size)
        req_blocks = self.req_to_blocks[req_id]
        G = self.num_groups
        blocks: list[KVCacheBlock] = []
        keys: list[BlockHash] = []
        for j in range(num_cached, num_full):
            for g in range(G):
                block = req_blocks[j * G + g]
                if block is not NULL_BLOCK:
                    blocks.append(block)
                    keys.append(group_block_key(block_hashes[j], g))
        self.block_pool.cache_full_blocks(blocks, keys)
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block `request` still holds, tail first; registrations made for a
        step that will not run leave the cache first (as in `KVCacheManager.free`)."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, [])
        num_cached = self.num_cached_blocks.pop(req_id, 0)
        self._num_freed.pop(req_id, None)
        self._next_free_at.pop(req_id, None)
        start = max(
            request.num_computed_tokens // self.block_size,
            self._last_registered_from.pop(req_id, num_cached),
        )
        G = self.num_groups
        for block in blocks[start * G : num_cached * G]:
            if block is not NULL_BLOCK and block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)

    # ----------------------------------------------------------------- tables

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's interleaved block tables (a fresh list)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str, group: int) -> list[int]:
        """Group `group`'s block table of the request (NULL_BLOCK_ID where freed)."""
        flat = self.req_to_blocks.get(request_id, [])
        return [b.block_id for b in flat[group :: self.num_groups]]

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds now (null entries not counted)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, []) if b is not NULL_BLOCK)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def publish_cache_events(self, listener: CacheEventListener | None) -> None:
        """Tell `listener` of group 0's registered and evicted hashes (the token hashes a
        prefix directory knows); the other groups' keys stay inside this pool."""
        if listener is None:
            self.block_pool.on_cache_event = None
            return

        def filtered(added: list[BlockHash], evicted: list[BlockHash]) -> None:
            added, evicted = _token_hashes(added), _token_hashes(evicted)
            if added or evicted:
                listener(added, evicted)

        self.block_pool.on_cache_event = filtered

    def published_block_hashes(self) -> list[BlockHash]:
        """Group 0's cached token hashes (what `publish_cache_events` names)."""
        return _token_hashes(self.block_pool.cached_block_hashes())

    def check_invariants(self) -> None:
        """The pool's invariants, plus: ref counts equal the holders of each block, tables
        are whole groups, and no sliding group holds a block left of its window."""
        self.block_pool.check_invariants()
        G = self.num_groups
        holders = [0] * self.block_pool.num_blocks
        for req_id, blocks in self.req_to_blocks.items():
            assert len(blocks) % G == 0, f"{req_id}: {len(blocks)} entries for {G} groups"
            real = [b.block_id for b in blocks if b is not NULL_BLOCK]
            assert len(real) == len(set(real)), f"a request holds a block twice: {real}"
            for b in blocks:
                if b is not NULL_BLOCK:
                    holders[b.block_id] += 1
            for i, (g, _) in enumerate(self._sliding):
                n = self._num_freed[req_id][i]
                assert all(blocks[j * G + g] is NULL_BLOCK for j in range(n)), (
                    f"{req_id}: group {g} holds a block it freed"
                )
        for b in self.block_pool.blocks:
            assert b.ref_cnt == holders[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {holders[b.block_id]} holders"
            )
