"""The launcher: the whole system as child processes on one machine (`tandem serve`).

It lives with the services it starts; `tandem serve` execs `python -m tandem_services.launcher`.
`deployment` starts and stops the services (also used by tests and benchmarks); `supervisor`
restarts workers that die; `cli` is the command line.
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
    read_ready,
    respawn_service,
    spawn_service,
    start_deployment,
    stop_process,
    wait_ready,
    worker_commands,
)
from tandem_services.launcher.supervisor import RestartPolicy, Supervisor, describe_exit

__all__ = [
    "Deployment",
    "LaunchError",
    "RestartPolicy",
    "ServeConfig",
    "Service",
    "Supervisor",
    "WorkerCommand",
    "add_worker_placement_args",
    "build_parser",
    "default_cpu_threads",
    "describe_exit",
    "directory_flags",
    "gpu_list",
    "main",
    "read_ready",
    "respawn_service",
    "spawn_service",
    "start_deployment",
    "stop_process",
    "wait_ready",
    "worker_commands",
]
