"""The pool of fixed-size KV cache blocks: ref counts, the free queue and the prefix-cache index.

Every block 0..num_blocks-1 is usable. A block is in exactly one of two states:

- in use: `ref_cnt > 0`, held by one or more requests (several share it on a prefix hit);
- free: `ref_cnt == 0`, linked into the free queue. A free block may still carry a
  `block_hash` (its KV is valid and can be revived by a cache hit) until it is handed out
  again, at which point its hash is evicted.

The free queue is in eviction order (head evicted first)::

    head -> [least recently freed ............ most recently freed] <- tail

A request's blocks are freed tail first, so its last (least shareable) blocks are evicted
before its first ones.

Cache events: when `on_cache_event` is set, every operation that changes the hash index
calls it once, after the change and on the thread that made it, with the hashes it
registered and the hashes it evicted (a worker feeds them to the prefix-cache directory).
Events come in the order the changes happened; within one call there is no hash in both
lists. No call is made for an operation that changed nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tandem.core.kv_cache_utils import BlockHash

# on_cache_event(added, evicted): hashes registered / evicted by one pool operation.
CacheEventListener = Callable[[list[BlockHash], list[BlockHash]], None]


class KVCacheBlock:
    """One block of the paged KV cache, doubling as a node of the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache (it is then full).
        self.block_hash: BlockHash | None = None
        # Free-queue links; both None while the block is not in the queue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks, threaded through the blocks themselves.

    O(1) `popleft` (allocation / eviction), `append` (free) and `remove` (a cache hit revives
    a free block from the middle). Two sentinel nodes keep the link logic branch-free.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block at the head (the next to evict)."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (the last to evict)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order (for tests and invariant checks)."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free_block
        return out


class BlockPool:
    """Owns all blocks, their ref counts, the free queue and hash -> block (prefix cache).

    Invariants (see `check_invariants`): the free queue holds exactly the blocks with
    `ref_cnt == 0`, each once; every hash in the index maps to a block carrying that hash,
    and every block carrying a hash is the one the index maps it to.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Told of every change to the hash index (see the module docstring); None: nobody.
        self.on_cache_event: CacheEventListener | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 .. 1.0). Free cached blocks count as unused."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def is_whole(self) -> bool:
        """True when every block is free (no request holds any)."""
        return self.num_free_blocks == self.num_blocks and all(b.ref_cnt == 0 for b in self.blocks)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, evicting their hashes; ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        listener = self.on_cache_event
        evicted: list[BlockHash] = []
        for block in blocks:
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                evicted_hash = self._evict_hash(block)
                if evicted_hash is not None and listener is not None:
                    evicted.append(evicted_hash)
            block.ref_cnt = 1
        if evicted and listener is not None:
            listener([], evicted)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving those that were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue in order.

        Pass a request's blocks tail first so its last blocks are evicted first.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Register `blocks[i]` (now full) under `block_hashes[i]`.

        A block that already carries a hash is left alone (it came from a cache hit). When
        another block already holds the same hash (two requests computed the same prefix
        independently), the newcomer stays unregistered: the index keeps one block per hash.
        """
        if not self.enable_caching:
            return
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        added: list[BlockHash] = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise ValueError(f"block {block.block_id} already cached under another hash")
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            added.append(block_hash)
        listener = self.on_cache_event
        if added and listener is not None:
            listener(added, [])

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop `block` from the prefix cache (its KV will not be written after all)."""
        evicted_hash = self._evict_hash(block)
        listener = self.on_cache_event
        if evicted_hash is not None and listener is not None:
            listener([], [evicted_hash])

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now (a snapshot, e.g. for a full republish)."""
        return list(self.cached_block_hash_to_block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update). Refused (False) while any
        block is in use, since running requests still read KV from the old weights."""
        if self.num_free_blocks != self.num_blocks:
            return False
        evicted = list(self.cached_block_hash_to_block)
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        listener = self.on_cache_event
        if evicted and listener is not None:
            listener([], evicted)
        return True

    def _evict_hash(self, block: KVCacheBlock) -> BlockHash | None:
        """Clear `block`'s hash; returns it when it left the index (else None)."""
        block_hash = block.block_hash
        if block_hash is None:
            return None
        block.block_hash = None
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
            return block_hash
        return None

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = [b.block_id for b in free]
        assert len(free_ids) == len(set(free_ids)), f"duplicate blocks in free queue: {free_ids}"
        assert len(free) == self.free_block_queue.num_free_blocks, (
            f"free queue holds {len(free)} blocks, counter says "
            f"{self.free_block_queue.num_free_blocks}"
        )
        expected = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(free_ids) == expected, (
            f"free queue {sorted(free_ids)} != blocks with ref_cnt 0 {sorted(expected)}"
        )
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            if b.ref_cnt > 0:
                assert b.prev_free_block is None and b.next_free_block is None, (
                    f"block {b.block_id} in use but linked into the free queue"
                )
            if b.block_hash is not None:
                assert self.cached_block_hash_to_block.get(b.block_hash) is b, (
                    f"block {b.block_id} carries a hash the index does not map to it"
                )
        for h, b in self.cached_block_hash_to_block.items():
            assert b.block_hash == h, f"index maps a hash to block {b.block_id} with another"
        if not self.enable_caching:
            assert not self.cached_block_hash_to_block, "caching disabled but hashes registered"
