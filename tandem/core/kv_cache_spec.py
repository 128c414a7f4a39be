"""The KV cache's shape by attention kind: groups of layers that share one block table.

A model whose layers all attend to the whole context has one group, and the cache is what it
always was: a block holds the KV of every layer. A model that mixes kinds (Gemma 3: five
sliding-window layers, then one global) keeps one group per kind, split so that every group
has the same number of layers, `layers_per_group`. A block then holds the KV of
`layers_per_group` layers, and layer i of every group reads and writes slot i of a block::

    layers   0  1  2  3  4  5  6  7  8  9 10 11     (S: window 512, F: full)
    kind     S  S  S  S  S  F  S  S  S  S  S  F
    groups   g0 = F{5, 11}   g1 = S{0, 1}   g2 = S{2, 3}   g3 = S{4, 6}   g4 = S{7, 8} ...
    block    [slot 0 | slot 1]: in g0's table layers 5 and 11, in g1's layers 0 and 1, ...

All groups draw from one block pool. A request has one block table per group, all of the
same length (one entry per `block_size` tokens); a sliding group's entries that have left
the window hold the null block (`NULL_BLOCK_ID`), which the kernels never read.

What a request costs is `KVCacheSpec.num_blocks_needed`, the one place that counts it (the
scheduler's checks, the capacity the engine reports, a decode worker's reservation and the
service scheduler's routing all call it): with its first c tokens computed and slots for n
more, a full group holds `cdiv(c + n, block_size)` blocks, a sliding group those from the
first block a query at c reads on (`num_skipped_blocks`)::

    block 4, window 8, c = 13, n = 4: keys > 13 - 8 = 5 are read, block 1 (4..7) on
    logical block   0 1 2 3 4                  full:    cdiv(17, 4)           = 5
    sliding         . x x x x                  sliding: 5 - (13 - 8 + 1) // 4 = 4

so a decoding request holds at most `cdiv(window - 1, block_size) + 1` blocks of a sliding
group, and a prefill chunk of n tokens `cdiv(window + n - 2, block_size) + 1`.

Full groups come first (group 0 is full whenever any layer is), then sliding groups by window.

KV hand-off (prefill worker -> decode worker, both with this spec) moves the entries
`handoff_indices` names: positions in the interleaved tables (`flat[j * G + g]`, see
`tandem.core.hybrid_kv_cache_manager`), so the group of each block travels as its position.
A table's null entries hold block id 0, which a real block may have too: the entries to move
are told by position, never by id. Of a prompt of P tokens with its first c tokens cached on
the decode side, they are the logical blocks j in [c // block_size, cdiv(P, block_size)),
in a sliding group only from its window at P on (the first decode query, at position P,
reads nothing before; the decode side's reservation holds null entries there, and the prefill
side, having freed only what a query at its last chunk's start no longer read, still holds
every block named)::

    P = 40, block 4, window 8, G = 2 (g0 full, g1 sliding), nothing cached:
    logical block   0 1 2 3 4 5 6 7 8 9
    g0              x x x x x x x x x x      sliding: skip(40) = (40 - 8 + 1) // 4 = 8
    g1              . . . . . . . . x x      -> flat indices 0, 2, ..., 18 and 17, 19
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The block id a table holds where a sliding group has freed a block: never read (the
# kernels skip blocks wholly left of the window) and never written (no slot maps there).
NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers of one attention kind that share a block table.

    `layer_indices[i]` (a layer of the runner's stage, in model order) uses slot i of each of
    the group's blocks; `sliding_window` None is full attention.
    """

    sliding_window: int | None
    layer_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if not self.layer_indices:
            raise ValueError("a KV cache group needs at least one layer")

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks no query from `num_computed_tokens` on reads: a query at position
        p >= c reads keys k > p - window >= c - window, so block j is done once
        `(j + 1) * block_size <= c - window + 1`. Always 0 for full attention."""
        w = self.sliding_window
        if w is None or num_computed_tokens < w:
            return 0
        return (num_computed_tokens - w + 1) // block_size

    def num_blocks_needed(
        self, num_computed_tokens: int, num_new_tokens: int, block_size: int
    ) -> int:
        """This group's share of `KVCacheSpec.num_blocks_needed`: the blocks from the first
        one a query at `num_computed_tokens` reads up to the last new token's."""
        c = num_computed_tokens
        return cdiv(c + num_new_tokens, block_size) - self.num_skipped_blocks(c, block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """Every group of the cache (see the module docstring); one group with `sliding_window`
    None is the plain cache."""

    block_size: int
    groups: tuple[KVCacheGroupSpec, ...]
    layers_per_group: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.groups:
            raise ValueError("a KV cache spec needs at least one group")
        if any(len(g.layer_indices) > self.layers_per_group for g in self.groups):
            raise ValueError(f"a group has more than layers_per_group={self.layers_per_group}")
        seen = [i for g in self.groups for i in g.layer_indices]
        if sorted(seen) != list(range(len(seen))):
            raise ValueError(f"groups must cover layers 0..n-1 once each, got {seen}")

    @classmethod
    def full(cls, block_size: int, num_layers: int) -> KVCacheSpec:
        """The plain cache: one full-attention group of every layer."""
        return cls(block_size, (KVCacheGroupSpec(None, tuple(range(num_layers))),), num_layers)

    @classmethod
    def from_layer_windows(
        cls, block_size: int, windows: Sequence[int | None], hybrid: bool = True
    ) -> KVCacheSpec:
        """The spec of layers whose sliding windows are `windows` (None: full attention).

        `hybrid` False (or one kind only) gives one group of every layer that keeps every
        block: correct for any mix, since a sliding layer's kernel masks by position alone.
        One kind of sliding layers only is one sliding group. Otherwise each kind is split into
        groups of `layers_per_group` layers, the fewest layers of any kind (a kind's last group
        may be short; its missing slots stay unused).
        """
        if not windows:
            raise ValueError("a model without attention layers has no KV cache")
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        if not hybrid or (len(kinds) == 1 and kinds[0] is None):
            return cls.full(block_size, len(windows))
        by_kind = {k: tuple(i for i, w in enumerate(windows) if w == k) for k in kinds}
        size = min(len(layers) for layers in by_kind.values())
        groups = tuple(
            KVCacheGroupSpec(kind, layers[i : i + size])
            for kind, layers in by_kind.items()
            for i in range(0, len(layers), size)
        )
        return cls(block_size, groups, size)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_plain(self) -> bool:
        """One full-attention group: the cache without any per-kind bookkeeping."""
        return len(self.groups) == 1 and self.groups[0].sliding_window is None

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_indices) for g in self.groups)

    def layer_slots(self) -> list[tuple[int, int]]:
        """(group, slot in a block) of each layer, by layer index."""
        out = [(0, 0)] * self.num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layer_indices):
                out[layer] = (g, slot)
        return out

    @classmethod
    def from_group_windows(cls, block_size: int, windows: Sequence[int | None]) -> KVCacheSpec:
        """A spec with one layer per group of windows `windows` (None: full attention): the
        block arithmetic of a worker's cache, away from its model (the service scheduler
        learns `group_windows` at registration)."""
        groups = tuple(KVCacheGroupSpec(w, (i,)) for i, w in enumerate(windows))
        return cls(block_size, groups, 1)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window, None for full attention (`from_group_windows`)."""
        return tuple(g.sliding_window for g in self.groups)

    def num_blocks_needed(self, num_computed_tokens: int, num_new_tokens: int = 0) -> int:
        """The blocks one request holds over all groups once slots for `num_new_tokens`
        tokens after its first `num_computed_tokens` are allocated (the hybrid manager's
        `allocate_slots`, nothing shared with another request through a prefix hit). The one
        count of blocks every estimate uses (see the module docstring):

            a step computing tokens c .. c+n-1         num_blocks_needed(c, n)
            a KV hand-off's reservation of P tokens    num_blocks_needed(P, 0)
            ... and its first decoded token            num_blocks_needed(P, 1)
        """
        c, n, bs = num_computed_tokens, num_new_tokens, self.block_size
        return sum(g.num_blocks_needed(c, n, bs) for g in self.groups)

    def max_blocks_per_request(self, num_tokens: int, num_new_tokens: int = 1) -> int:
        """The most blocks a request holds at any step of its life while it grows to
        `num_tokens` tokens, computing at most `num_new_tokens` a step (1: decoding; the
        token budget with chunked prefill): the largest `num_blocks_needed(c, n)`.

        A step of n' < n tokens never holds more than one of n tokens ending where it
        ends, so n = `num_new_tokens` steps alone count, at c in [0, num_tokens - n]. Each
        group's count at c + block_size is at least that at c (a full group's grows by one,
        a sliding group's repeats once c is past its window and only grows before), so the
        largest is at one of the last `block_size` values of c."""
        if num_tokens <= 0:
            return 0
        n = max(1, min(num_new_tokens, num_tokens))
        last = num_tokens - n
        if all(g.sliding_window is None for g in self.groups):
            return self.num_blocks_needed(last, n)
        first = max(0, last - self.block_size + 1)
        return max(self.num_blocks_needed(c, n) for c in range(first, last + 1))

    def handoff_indices(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> list[int]:
        """Positions in the interleaved block tables (`j * num_groups + g`) whose blocks a KV
        hand-off of a `num_prompt_tokens`-token prompt moves, the decode side holding its
        first `num_cached_tokens` already (see the module docstring). In table order."""
        bs = self.block_size
        G = self.num_groups
        first = num_cached_tokens // bs
        n = cdiv(num_prompt_tokens, bs)
        skip = [max(first, g.num_skipped_blocks(num_prompt_tokens, bs)) for g in self.groups]
        return [j * G + g for j in range(first, n) for g in range(G) if j >= skip[g]]

    def max_concurrency(self, num_blocks: int, num_tokens: int, num_new_tokens: int = 1) -> float:
        """How many requests of `num_tokens` tokens, computing at most `num_new_tokens` a
        step, `num_blocks` blocks hold at once at their peak (vLLM's "maximum concurrency",
        which counts a prefill chunk of the token budget)."""
        return num_blocks / self.max_blocks_per_request(num_tokens, num_new_tokens)

    def kv_cache_size_tokens(
        self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int
    ) -> int:
        """The tokens of context `num_blocks` blocks hold at their peak: `max_concurrency`
        times `max_model_len`, as vLLM reports "GPU KV cache size: N tokens" (so a sliding
        group counts only its window's blocks; one full-attention group gives
        `num_blocks * block_size` when `max_model_len` is a whole number of blocks)."""
        per_request = self.max_blocks_per_request(max_model_len, max_num_batched_tokens)
        return num_blocks * max_model_len // per_request

    def describe(self) -> str:
        """One line for the logs: the groups by kind."""
        parts = []
        for g in self.groups:
            kind = "full" if g.sliding_window is None else f"window {g.sliding_window}"
            parts.append(f"{kind}: layers {list(g.layer_indices)}")
        return f"{len(self.groups)} KV cache group(s) of {self.layers_per_group} layer(s) (" + (
            "; ".join(parts) + ")"
        )
