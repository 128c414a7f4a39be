"""`tandem rank-host`: this host's ranks of an engine that spans several hosts.

The engine (a worker service, `tandem generate`, `LLM`) runs on the host of node 0 with
`--nnodes N --node-rank 0 --master-addr A --master-port P`; every other host runs this command
with the same engine flags and its own `--node-rank`. Its ranks meet the engine's executor at
the c10d rendezvous `A:P` (`tandem.executor.multiproc`); it exits when they do, with the first
failing rank's exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tandem.config import ConfigError, add_engine_args
from tandem.engine_args import EngineArgs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem rank-host",
        description="Start this host's ranks of a multi-host engine (node rank >= 1).",
    )
    add_engine_args(p)
    return p


def main(argv: list[str]) -> int:
    from tandem.executor.multiproc import serve_rank_host

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # The worker's command line as it is (a StatefulSet pod's): what is not an engine flag is
    # the worker service's, and ignored here.
    ns, _ = build_parser().parse_known_args(argv)
    try:
        config = EngineArgs.from_cli_args(ns).create_engine_config(resolve=False)
        if config.parallel.nnodes < 2 or config.parallel.node_rank < 1:
            raise ConfigError("tandem rank-host needs --nnodes >= 2 and --node-rank >= 1")
        return serve_rank_host(config)
    except ConfigError as exc:
        print(f"tandem rank-host: {exc}", file=sys.stderr)
        return 2
