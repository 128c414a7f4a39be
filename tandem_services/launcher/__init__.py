"""The launcher: the whole system as child processes on one machine (`tandem serve`).

It lives with the services it starts; `tandem serve` execs `python -m tandem_services.launcher`.
`deployment` starts and stops the services (also used by tests and benchmarks); `cli` is the
command line.
"""

from tandem_services.launcher.cli import add_worker_placement_args, build_parser, gpu_list, main
from tandem_services.launcher.deployment import (
    Deployment,
    LaunchError,
    ServeConfig,
    Service,
    WorkerCommand,
    default_cpu_threads,
    directory_flags,
    spawn_service,
    start_deployment,
    stop_process,
    wait_ready,
    worker_commands,
)

__all__ = [
    "Deployment",
    "LaunchError",
    "ServeConfig",
    "Service",
    "WorkerCommand",
    "add_worker_placement_args",
    "build_parser",
    "default_cpu_threads",
    "directory_flags",
    "gpu_list",
    "main",
    "spawn_service",
    "start_deployment",
    "stop_process",
    "wait_ready",
    "worker_commands",
]
