"""`pip install tandem` gives a `tandem serve` that starts: what the services import at start-up
is a core dependency, and a missing optional package is one line naming its extra."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Packages of the extras, hidden from the child (an import of them raises ImportError).
_HIDE_EXTRAS = "import sys\nfor m in ('redis', 'hiredis', 'fastapi'):\n    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _HIDE_EXTRAS + code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_grpc_and_what_the_services_import_are_core_dependencies() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    core = _names(project["dependencies"])
    for name in (
        "grpcio",
        "grpcio-health-checking",
        "grpcio-reflection",
        "protobuf",
        "starlette",
        "uvicorn",
        "prometheus-client",
    ):
        assert name in core, name
    assert _names(project["optional-dependencies"]["redis"]) == {"redis"}


def test_every_service_starts_up_without_the_extras() -> None:
    """Every module `tandem serve` runs imports with redis (and fastapi) absent."""
    out = _run(
        "import tandem.cli, tandem_services.launcher.cli, tandem_services.frontend.__main__, "
        "tandem_services.scheduler.__main__, tandem_services.prefill_worker.__main__, "
        "tandem_services.decode_worker.__main__, tandem_services.common.entrypoint\nprint('ok')"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_missing_extra_is_one_line_naming_it() -> None:
    code = (
        "from tandem_services.directory import DirectoryConfig\n"
        "from tandem_services.directory.factory import make_directory\n"
        "from tandem.extras import MissingExtraError\n"
        "try:\n"
        "    make_directory(DirectoryConfig(redis_url='redis://127.0.0.1:1'))\n"
        "except MissingExtraError as exc:\n"
        "    print(exc)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [
        "the Redis prefix-cache directory (--redis-url) needs the 'redis' package: "
        "pip install 'tandem[redis]'"
    ]


def test_tandem_serve_with_redis_missing_exits_with_one_line() -> None:
    out = _run(
        "from tandem_services.launcher.cli import main\n"
        "sys.exit(main(['--redis-url', 'redis://127.0.0.1:1']))\n"
    )
    assert out.returncode == 2
    assert "pip install 'tandem[redis]'" in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr and "starting" not in out.stdout
