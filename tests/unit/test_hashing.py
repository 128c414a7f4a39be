"""Block hashes: deterministic across processes, chained, keyed by cache salt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.core.kv_cache_utils import (
    ROOT_PARENT_HASH,
    compute_block_hashes,
    hash_block_tokens,
    update_block_hashes,
)
from tandem.request import Request
from tandem.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
from tandem.core.kv_cache_utils import compute_block_hashes, hash_block_tokens
print(hash_block_tokens(None, [1, 2, 3, 4]).hex())
print(hash_block_tokens(None, [1, 2, 3, 4], ("salt",)).hex())
print(",".join(h.hex() for h in compute_block_hashes(list(range(50)), 16, "s")))
"""


def _local_values() -> list[str]:
    return [
        hash_block_tokens(None, [1, 2, 3, 4]).hex(),
        hash_block_tokens(None, [1, 2, 3, 4], ("salt",)).hex(),
        ",".join(h.hex() for h in compute_block_hashes(list(range(50)), 16, "s")),
    ]


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_same_hash_in_another_process(hash_seed: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
    )
    assert out.stdout.split() == _local_values()


def test_golden_values_pin_the_format() -> None:
    # Changing the byte layout breaks cross-version prefix routing: bump the root seed then.
    assert ROOT_PARENT_HASH.hex() == "c46b977ff9a095ee04becc6ca9b25331"
    assert hash_block_tokens(None, [1, 2, 3, 4]).hex() == "c04a844e1ae11b44032461e97f999a07"
    assert (
        hash_block_tokens(None, [1, 2, 3, 4], ("salt",)).hex() == "fe23042e148dff1abcaf847f02d5f701"
    )


def test_hash_is_16_bytes_and_root_is_the_default_parent() -> None:
    h = hash_block_tokens(None, [7, 8])
    assert isinstance(h, bytes) and len(h) == 16
    assert hash_block_tokens(ROOT_PARENT_HASH, [7, 8]) == h


def test_salt_parent_tokens_and_extra_keys_change_the_hash() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("b",)
    )
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 4, 3]) != base
    # Typed, length-prefixed extra keys: "1" vs 1, ("ab",) vs ("a", "b").
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    # Token count is part of the layout: [1] + extra [2] is not [1, 2].
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1], (2,))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))
    with pytest.raises(ValueError):
        hash_block_tokens(b"short", [1])


def test_compute_block_hashes_chains_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, 4)
    assert len(hashes) == 2  # 10 tokens -> 2 full blocks of 4
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    # Incremental extension gives the same list.
    assert compute_block_hashes(tokens, 4, prev_hashes=hashes[:1]) == hashes[1:]
    # The salt is in the first block, so it changes every hash of the chain.
    salted = compute_block_hashes(tokens, 4, cache_salt="tenant-a")
    assert salted[0] == hash_block_tokens(None, [0, 1, 2, 3], ("tenant-a",))
    assert all(a != b for a, b in zip(hashes, salted, strict=True))
    # Same second block after a different first block: different hash.
    other = compute_block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert other[1] != hashes[1]


def test_update_block_hashes_grows_with_output_tokens() -> None:
    req = Request("r", list(range(6)), SamplingParams(), cache_salt="s")
    assert update_block_hashes(req, 4) == compute_block_hashes(range(6), 4, "s")
    assert len(req.block_hashes) == 1
    first = req.block_hashes[0]
    req.append_output_token_ids([6])
    update_block_hashes(req, 4)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7, 8])
    update_block_hashes(req, 4)
    assert req.block_hashes[0] == first
    assert req.block_hashes == compute_block_hashes(list(range(9)), 4, "s")
