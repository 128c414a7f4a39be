"""Deterministic chained block hashing for prefix caching.

A full block's hash covers its parent's hash, its token ids and any extra keys (cache salt on
the first block, later LoRA ids), so equal hashes mean equal prefixes::

    ROOT_PARENT_HASH -> h0 = H(root, tokens[0:bs], (salt,)) -> h1 = H(h0, tokens[bs:2bs]) -> ...

The hash is xxh3-128 over a fixed byte layout, with a fixed root: every process on every
machine (prefill and decode workers, the global scheduler, the directory) computes the same
bytes for the same tokens. Python's `hash()` is never used: it is salted per process.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from tandem.request import Request

BlockHash = bytes

# The parent of every request's first block: a fixed, versioned seed.
ROOT_PARENT_HASH: BlockHash = xxhash.xxh3_128_digest(b"tandem.kv_block_hash.v1")
HASH_NUM_BYTES = len(ROOT_PARENT_HASH)


def _encode_extra_key(key: object) -> bytes:
    """Tagged, length-prefixed bytes of one extra key (so distinct keys never collide)."""
    if key is None:
        return b"n"
    if isinstance(key, bool):
        return b"t" if key else b"f"
    if isinstance(key, int):
        raw = str(key).encode()
        return b"i" + struct.pack("<I", len(raw)) + raw
    if isinstance(key, str):
        raw = key.encode("utf-8")
        return b"s" + struct.pack("<I", len(raw)) + raw
    if isinstance(key, bytes):
        return b"b" + struct.pack("<I", len(key)) + key
    if isinstance(key, tuple):
        return b"(" + struct.pack("<I", len(key)) + b"".join(_encode_extra_key(k) for k in key)
    raise TypeError(f"unsupported block hash extra key type {type(key).__name__}")


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """The 16-byte hash of one block, chained on `parent_hash` (None: the request's first block).

    Layout hashed: parent (16 bytes) | u32 num tokens | tokens as little-endian int64 |
    u32 num extra keys | tagged extra keys. Extra keys may be None, bool, int, str, bytes or
    tuples of those.
    """
    parent = ROOT_PARENT_HASH if parent_hash is None else parent_hash
    if len(parent) != HASH_NUM_BYTES:
        raise ValueError(f"parent hash must be {HASH_NUM_BYTES} bytes, got {len(parent)}")
    n = len(token_ids)
    extras = extra_keys or ()
    data = b"".join(
        (
            parent,
            struct.pack("<I", n),
            struct.pack(f"<{n}q", *token_ids),
            struct.pack("<I", len(extras)),
            *(_encode_extra_key(k) for k in extras),
        )
    )
    return xxhash.xxh3_128_digest(data)


def first_block_extra_keys(cache_salt: str | None) -> tuple[object, ...] | None:
    """Extra keys of a request's first block: its cache salt, if any."""
    return None if cache_salt is None else (cache_salt,)


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    prev_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` after the `len(prev_hashes)` already known.

    Returns only the new hashes (an empty list when no further block is full). Used for
    requests (through `update_block_hashes`) and by services that hash a bare prompt.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    start = len(prev_hashes)
    parent = prev_hashes[-1] if prev_hashes else None
    new_hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        extra = first_block_extra_keys(cache_salt) if i == 0 else None
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        new_hashes.append(parent)
    return new_hashes


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens; return it.

    Hashes are append-only: a request's tokens never change once appended, so the list only
    grows as output tokens fill blocks.
    """
    request.block_hashes.extend(
        compute_block_hashes(
            request.all_token_ids, block_size, request.cache_salt, request.block_hashes
        )
    )
    return request.block_hashes
