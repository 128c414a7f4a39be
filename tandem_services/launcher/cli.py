"""`tandem serve` (`python -m tandem_services.launcher`): its flags, and the foreground loop.

The engine flags are the one definition in `tandem.config` (`add_engine_args`); the values
that differ from their defaults go to every worker as flags (`engine_argv`). The prefix-cache
directory flags are the services' own (`tandem_services.common.directory`), defaults from
`TANDEM_SERVE_<FLAG>`, then `TANDEM_<FLAG>`.

While it runs, a worker that dies is started again (supervisor.py: `--max-worker-restarts`
crashes within `--restart-window-s` allowed, back-off from `--restart-backoff-s`); the requests
it was running move to another worker (`--migration-limit`, the frontend's). When supervision
gives up, or the scheduler or frontend exits, everything is stopped, one line says why, and the
exit code is 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from tandem.config import SERVING_ENGINE_DEFAULTS, add_engine_args, engine_argv
from tandem.engine_args import EngineArgs
from tandem_services.common.directory import add_directory_args, directory_config_from
from tandem_services.common.tls import add_tls_args, tls_config_from
from tandem_services.directory.factory import require_redis
from tandem_services.frontend.config import add_api_args, api_argv
from tandem_services.launcher.deployment import LaunchError, ServeConfig, start_deployment
from tandem_services.launcher.supervisor import RestartPolicy, Supervisor


def build_parser() -> argparse.ArgumentParser:
    """The parser of `tandem serve`, engine flags included."""
    p = argparse.ArgumentParser(
        prog="tandem serve",
        description="Run the scheduler, a prefill and a decode worker (or one unified worker) "
        "and the frontend on this machine.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--scheduler-port", type=int, default=0)
    p.add_argument("--unified", action="store_true", help="unified workers (no hand-off)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY", ""))
    p.add_argument("--grace-period-s", type=float, default=10.0)
    add_supervision_args(p)
    p.add_argument("--log-dir", default="", help="write each service's log to DIR/<name>.log")
    add_worker_placement_args(p)
    p.add_argument(
        "--routing",
        choices=["prefix", "round-robin", "load"],
        default="",
        help="how the scheduler picks a prefill worker (default: prefix)",
    )
    add_directory_args(p, "TANDEM_SERVE_")
    add_tls_args(p)
    add_api_args(p)  # the frontend's: served names, tool calling, request limits
    add_engine_args(p, defaults=SERVING_ENGINE_DEFAULTS)
    return p


def add_supervision_args(p: argparse.ArgumentParser) -> None:
    """Restart and migration flags of `tandem serve`."""
    d = RestartPolicy()
    p.add_argument(
        "--max-worker-restarts",
        type=int,
        default=d.max_worker_restarts,
        help="crashes of one worker tolerated within --restart-window-s (each restarts it); "
        "one more stops the deployment",
    )
    p.add_argument("--restart-window-s", type=float, default=d.restart_window_s)
    p.add_argument(
        "--restart-backoff-s",
        type=float,
        default=d.restart_backoff_s,
        help="delay before restarting a dead worker, doubled per recent crash",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times one request may move to another worker when its worker is lost (0: fail)",
    )


def restart_policy_from(ns: argparse.Namespace) -> RestartPolicy:
    """The `RestartPolicy` of parsed `tandem serve` flags (ValueError when out of range)."""
    return RestartPolicy(
        max_worker_restarts=ns.max_worker_restarts,
        restart_window_s=ns.restart_window_s,
        restart_backoff_s=ns.restart_backoff_s,
        restart_backoff_max_s=max(RestartPolicy().restart_backoff_max_s, ns.restart_backoff_s),
    )


def gpu_list(value: str) -> tuple[int, ...]:
    """argparse type of --gpus: "0,1" -> (0, 1)."""
    try:
        gpus = tuple(int(v) for v in value.split(","))
    except ValueError:
        gpus = ()
    if not gpus or any(g < 0 for g in gpus):
        raise argparse.ArgumentTypeError(f"--gpus takes GPU indices like 0,1; got {value!r}")
    return gpus


def add_worker_placement_args(p: argparse.ArgumentParser) -> None:
    """--num-prefill-workers, --num-unified-workers, --gpus (`tandem serve`, `bench serve`)."""
    p.add_argument(
        "--num-prefill-workers", type=int, default=1, help="prefill workers (disaggregated)"
    )
    p.add_argument(
        "--num-decode-workers", type=int, default=1, help="decode workers (disaggregated)"
    )
    p.add_argument(
        "--num-unified-workers", type=int, default=1, help="unified workers (with --unified)"
    )
    p.add_argument(
        "--gpus",
        type=gpu_list,
        default=(),
        help="GPU indices, e.g. 0,1: workers go to them round robin in role order (prefill "
        "workers, then decode; or each unified worker) as --device cuda:<index>",
    )


def main(argv: list[str]) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        directory = directory_config_from(ns)
        tls = tls_config_from(ns)
        if directory.uses_redis:
            require_redis()  # one line naming the extra, before any child starts
        # Checked here, before any process starts (nothing is loaded: no resolution).
        args = EngineArgs.from_cli_args(ns)
        args.create_engine_config(resolve=False)
        # The frontend's tokenizer: a random preset's stand-in made now, a folder without
        # one refused in one line.
        from tandem.loader import prepare_tokenizer

        prepare_tokenizer(args.model, args.cache_dir or None)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    try:
        policy = restart_policy_from(ns)
        if ns.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {ns.migration_limit}")
        config = ServeConfig(
            model=ns.model,
            host=ns.host,
            http_port=ns.http_port,
            grpc_port=ns.grpc_port,
            scheduler_port=ns.scheduler_port,
            unified=ns.unified,
            api_key=ns.api_key,
            worker_args=tuple(engine_argv(ns, defaults=SERVING_ENGINE_DEFAULTS)),
            grace_period_s=ns.grace_period_s,
            log_dir=ns.log_dir,
            num_prefill_workers=ns.num_prefill_workers,
            num_unified_workers=ns.num_unified_workers,
            num_decode_workers=ns.num_decode_workers,
            gpus=ns.gpus,
            directory=directory,
            routing=ns.routing,
            tls=tls,
            frontend_args=(
                *("--migration-limit", str(ns.migration_limit)),
                *("--generation-config", ns.generation_config),
                *api_argv(parser, ns),
            ),
        )
    except ValueError as exc:
        parser.error(str(exc))
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    mode = (
        f"{config.num_unified_workers} unified worker(s)"
        if config.unified
        else f"{config.num_prefill_workers} prefill + {config.num_decode_workers} decode workers"
    )
    if config.gpus:
        mode += f" on GPUs {','.join(map(str, config.gpus))}"
    print(f"tandem serve: starting scheduler, {mode}, frontend ({config.model}) ...", flush=True)
    try:
        deployment = start_deployment(config)
    except LaunchError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    http = deployment.http_address
    workers = ", ".join(f"{name} {deployment.address(name)}" for name, _ in config.worker_roles)
    print(
        f"tandem serve: ready\n"
        f"  HTTP (OpenAI API)  http://{http}/v1\n"
        f"  gRPC               {deployment.grpc_address}  (tandem.v1.Frontend)\n"
        f"  scheduler          {deployment.scheduler_address}\n"
        f"  workers            {workers}\n"
        f"Try:\n"
        f"  curl http://{http}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{config.model}", "prompt": "The capital of France is", '
        f'"max_tokens": 16}}\'\n'
        f"Ctrl-C stops everything.",
        flush=True,
    )
    code = 0

    def log(line: str) -> None:
        print(f"tandem serve: {line}", file=sys.stderr, flush=True)

    supervisor = Supervisor(deployment, policy, log)
    while not stop["signal"]:
        reason = supervisor.poll()
        if reason is not None:
            log(f"{reason}; stopping everything")
            code = 1
            break
        time.sleep(0.2)
    print("tandem serve: stopping ...", flush=True)
    already_dead = set(deployment.failed())
    codes = deployment.stop()
    bad = {n: c for n, c in codes.items() if c != 0 and n not in already_dead}
    if bad:
        print(f"tandem serve: unclean exits: {bad}", file=sys.stderr)
        code = 1
    else:
        print("tandem serve: stopped", flush=True)
    return code
