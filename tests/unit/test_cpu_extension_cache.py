"""The CPU extension's build cache survives a process killed while loading it.

torch's `load()` leaves a lock file behind when its process is killed inside it (a rank the
executor kills at start-up, a timed-out test), and every later `load()` of that build used to
wait on it forever. Each case runs `available()` in a fresh process over a copy of this
process's build, with such a lock file in place, under a timeout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem_kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the extension")

_PROBE = "from tandem_kernels import cpu; import sys; sys.exit(0 if cpu.available() else 3)"


def _cache_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, finished: bool) -> Path:
    """A copy of this process's build under a new TORCH_EXTENSIONS_DIR (set here, so the
    probe's process inherits it), with a stale lock."""
    name = cpu.extension_name()
    built = cpu.build_directory(name)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    where = cpu.build_directory(name)
    shutil.copytree(built, where, ignore=shutil.ignore_patterns("tandem.flock", "lock"))
    if not finished:
        (where / "tandem_build_done").unlink()
    (where / "lock").touch()  # what a process killed inside torch's load() leaves
    return where


@pytest.mark.parametrize("finished", [True, False], ids=["finished-build", "unfinished-build"])
def test_a_stale_build_lock_does_not_block_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finished: bool
) -> None:
    where = _cache_copy(tmp_path, monkeypatch, finished=finished)
    done = subprocess.run([sys.executable, "-c", _PROBE], timeout=300)
    assert done.returncode == 0
    assert (where / "tandem_build_done").exists()
    if not finished:  # built (brought up to date) under the flock: the stale lock is gone
        assert not (where / "lock").exists()


def test_a_library_that_does_not_load_is_linked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished build whose library no longer loads (here: not a shared object at all)."""
    where = _cache_copy(tmp_path, monkeypatch, finished=True)
    library = where / f"{cpu.extension_name()}.so"
    library.write_bytes(b"not an ELF file\n" * 256)
    done = subprocess.run([sys.executable, "-c", _PROBE], timeout=300)
    assert done.returncode == 0
    assert library.stat().st_size > 4096
    assert not (where / "lock").exists()
