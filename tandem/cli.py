"""`tandem generate | serve | bench | rank-host | frontend | scheduler | prefill-worker |
decode-worker`.

This module only dispatches. `generate`, `rank-host` and `bench offline` run in this process
(`tandem.entrypoints.generate`, `tandem.entrypoints.rank_host`,
`benchmarks.offline_throughput`); `serve`, `bench serve` and the
services replace this process with `python -m tandem_services.<name>` (tandem never imports
the services), so `tandem scheduler --port 1234` and
`python -m tandem_services.scheduler --port 1234` are the same program, and `tandem serve` is
`python -m tandem_services.launcher`.
"""

from __future__ import annotations

import os
import sys

_SERVICES = {
    "serve": "tandem_services.launcher",
    "frontend": "tandem_services.frontend",
    "scheduler": "tandem_services.scheduler",
    "prefill-worker": "tandem_services.prefill_worker",
    "decode-worker": "tandem_services.decode_worker",
}
_COMMANDS = (
    "generate",
    "serve",
    "bench",
    "rank-host",
    *(name for name in _SERVICES if name != "serve"),
)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in ("serve", "offline"):
        print("usage: tandem bench {serve|offline} [options]", file=sys.stderr)
        return 2
    if argv[0] == "serve":
        os.execv(sys.executable, [sys.executable, "-m", "tandem_services.bench.serve", *argv[1:]])
    import runpy

    sys.argv = ["offline_throughput", *argv[1:]]
    runpy.run_module("benchmarks.offline_throughput", run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print(f"usage: tandem {{{'|'.join(_COMMANDS)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "generate":
        from tandem.entrypoints.generate import main as generate

        return generate(rest)
    if cmd == "rank-host":
        from tandem.entrypoints.rank_host import main as rank_host

        return rank_host(rest)
    if cmd == "bench":
        return _bench(rest)
    os.execv(sys.executable, [sys.executable, "-m", _SERVICES[cmd], *rest])
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
