"""`tandem_kernels.block_copy.copy_blocks` against its torch reference, on the CPU through Triton's
interpreter (in a child process started with TRITON_INTERPRET=1: the interpreter is chosen when
triton is imported). Small shapes; fp32 and fp16, whole-word and odd-sized blocks, any order;
several programs per block (small `chunk_bytes`), whole and masked last chunks; the rows entry.
Run by hand: `TRITON_INTERPRET=1 PYTHONPATH=. python tests/unit/test_block_copy_interp.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
_MARK = "@@block-copy-results@@"

# name: (dtype, shape [num_blocks, layers, 2, block_size, kv_heads, head_size], chunk_bytes)
CASES = {
    "fp32": (torch.float32, (12, 2, 2, 4, 2, 8), 32 * 1024),
    "fp16": (torch.float16, (12, 3, 2, 4, 1, 8), 32 * 1024),
    # 1 * 2 * 1 * 1 * 3 halves = 12 bytes per block: 4-byte words, a masked chunk.
    "fp16_odd": (torch.float16, (12, 1, 2, 1, 1, 3), 32 * 1024),
    # 384 bytes = 48 words per block: 3 whole chunks of 16 words.
    "fp16_chunks": (torch.float16, (12, 3, 2, 4, 1, 8), 128),
    # 48 words in chunks of 32: the second chunk is half masked.
    "fp16_chunks_tail": (torch.float16, (12, 3, 2, 4, 1, 8), 256),
}


def _run_case(name: str) -> None:
    from tandem_kernels.block_copy import block_words, copy_block_rows, copy_blocks, copy_blocks_ref

    dtype, shape, chunk_bytes = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    src = torch.randn(shape, generator=gen).to(dtype)
    dst = torch.randn((shape[0] + 3, *shape[1:]), generator=gen).to(dtype)
    expected = dst.clone()
    # Any order: reversed, interleaved, a pair of neighbours, destination beyond the source's
    # block count.
    pairs = [(5, 0), (0, 14), (11, 3), (2, 7), (3, 8), (7, 1)]
    mapping = torch.tensor(pairs, dtype=torch.int32 if name == "fp16" else torch.int64)
    copy_blocks(src, dst, mapping, chunk_bytes=chunk_bytes)
    copy_blocks_ref(src, expected, mapping)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8)), name
    for s, d in pairs:
        assert torch.equal(dst[d], src[s]), (s, d)
    untouched = [b for b in range(dst.shape[0]) if b not in {d for _, d in pairs}]
    assert torch.equal(dst[untouched], expected[untouched])
    word = torch.int32 if name == "fp16_odd" else torch.int64
    assert block_words(src).dtype == word
    # The rows entry on the same views: a second mapping over the result.
    again = torch.tensor([(1, 2), (9, 13)])
    copy_block_rows(block_words(src), block_words(dst), again, chunk_bytes=chunk_bytes)
    copy_blocks_ref(src, expected, again)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8)), name
    # Nothing to copy: no launch, no change.
    copy_blocks(src, dst, torch.empty((0, 2), dtype=torch.int64))
    assert torch.equal(dst, expected)


def _run(names: list[str]) -> dict[str, str]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    out = {}
    for name in names or list(CASES):
        try:
            _run_case(name)
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__], env=env, cwd=_ROOT, capture_output=True, text=True, timeout=300
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line.removeprefix(_MARK))
    pytest.fail(f"interpreter child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


@pytest.mark.parametrize("name", list(CASES))
def test_copy_blocks_interp(name: str, results: dict[str, str]) -> None:
    if results.get(name, "not run") != "ok":
        pytest.fail(f"{name}:\n{results.get(name, 'not run')}", pytrace=False)


def test_asserts_shapes_and_dtypes() -> None:
    from tandem_kernels.block_copy import copy_blocks_ref

    a = torch.zeros(4, 1, 2, 2, 1, 4)
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(AssertionError):
        copy_blocks_ref(a, torch.zeros(4, 1, 2, 2, 1, 4, dtype=torch.float16), mapping)
    with pytest.raises(AssertionError):
        copy_blocks_ref(a, torch.zeros(4, 2, 2, 2, 1, 4), mapping)
    with pytest.raises(AssertionError):
        copy_blocks_ref(a, torch.zeros(4, 1, 2, 2, 1, 4), mapping.float())
    with pytest.raises(AssertionError):
        copy_blocks_ref(a[:, :, :, :1], torch.zeros(4, 1, 2, 1, 1, 4), mapping)  # strided


if __name__ == "__main__":
    sys.path.insert(0, str(_ROOT))
    print(_MARK + json.dumps(_run(sys.argv[1:])))
