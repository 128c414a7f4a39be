"""The container entry point: `python -m tandem_services.common.entrypoint <command> [flags]`.

One image runs every service; its first argument picks what runs:

    frontend | scheduler | prefill-worker | decode-worker [flags]
        exec `python -m services.<name> [flags]`. A worker first claims one GPU of those
        visible (TP x PP of them for a parallel worker) when TANDEM_GPU_SLOT_DIR is set (see
        `claim_gpus`).
    serve | generate | bench [flags]
        exec `tandem <command>` (the whole system in one container, offline use).
    health ADDRESS [--service NAME]
        gRPC health check (exit 0 when SERVING): Docker and compose health checks, and
        Kubernetes exec probes under TLS (its own gRPC probes speak plaintext only).
    drain [--scheduler ADDRESS] [--worker ADDRESS] [--worker-id ID] [--timeout-s S]
        A worker pod's preStop hook: the scheduler stops routing to this worker, then wait
        until the worker has nothing in flight (or the timeout), so SIGTERM finds it idle.

The probes dial with the service's TLS settings (TANDEM_TLS_CERT, TANDEM_TLS_KEY, TANDEM_TLS_CA,
TANDEM_TLS_SERVER_NAME; `--tls-*` flags). Flags and environment are read here, once; nothing
here imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.config import world_size_from_argv
from tandem_services.common.channels import PLAINTEXT, TlsConfig, sync_channel
from tandem_services.common.tls import add_tls_args, tls_config_from

SERVICES = {
    "frontend": "tandem_services.frontend",
    "scheduler": "tandem_services.scheduler",
    "prefill-worker": "tandem_services.prefill_worker",
    "decode-worker": "tandem_services.decode_worker",
}
TANDEM_COMMANDS = ("serve", "generate", "bench", "rank-host")
_WORKERS = ("prefill-worker", "decode-worker")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def reachable_address(host: str, port: int) -> str:
    """host:port that other machines can dial: a wildcard bind host becomes this host's
    address (in a container, its address on the container network)."""
    if host not in _WILDCARD_HOSTS:
        return f"{host}:{port}"
    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        ip = ""
    if not ip or ip.startswith("127."):
        # No resolvable name: the source address of a route outwards (nothing is sent).
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
    return f"{ip or name}:{port}"


# ----------------------------------------------------------------------------- GPU slots


class GpuSlotError(RuntimeError):
    pass


@dataclass(frozen=True)
class GpuClaim:
    """A GPU this process holds: `fd` keeps its lock (inherited across exec)."""

    device_id: str
    lock_path: Path
    fd: int


def visible_gpus() -> list[str]:
    """UUIDs of the GPUs this container sees (nvidia-smi; empty when there is none)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def claim_gpus(
    device_ids: Sequence[str], count: int, slot_dir: Path, wait_s: float
) -> list[GpuClaim]:
    """Lock `count` of `device_ids` that no other process holds (flock on
    `slot_dir/<id>.lock`), waiting up to `wait_s` for enough to free up.

    Replicas of a compose pool see the same GPUs (a reservation cannot differ per replica);
    with a shared `slot_dir` volume each replica takes different ones: a worker of TP x PP
    ranks takes that many. A lock dies with its process, so a crashed worker's GPUs are free
    again at once. A replica that cannot get all of its GPUs holds none while it waits.
    """
    if not device_ids:
        raise GpuSlotError("no GPU is visible to claim")
    if count > len(device_ids):
        raise GpuSlotError(
            f"a worker of {count} ranks needs {count} GPUs; the pool has {len(device_ids)}"
        )
    slot_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        held: list[GpuClaim] = []
        for device_id in device_ids:
            path = slot_dir / f"{device_id.replace('/', '_')}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
            held.append(GpuClaim(device_id, path, fd))
            if len(held) == count:
                return held
        for claim in held:
            os.close(claim.fd)  # not enough: let the others have them meanwhile
        if time.monotonic() >= deadline:
            raise GpuSlotError(
                f"fewer than {count} GPUs of {list(device_ids)} are free of other workers "
                f"(locks in {slot_dir}); give the pool more GPUs or fewer replicas"
            )
        time.sleep(1.0)


def claim_gpu(device_ids: Sequence[str], slot_dir: Path, wait_s: float) -> GpuClaim:
    """One GPU (`claim_gpus` with a count of 1)."""
    return claim_gpus(device_ids, 1, slot_dir, wait_s)[0]


def _claim_for_worker(env: dict[str, str], argv: Sequence[str]) -> None:
    slot_dir = env.get("TANDEM_GPU_SLOT_DIR", "")
    if not slot_dir:
        return
    devices = visible_gpus()
    if not devices:
        print("entrypoint: no GPU visible; not claiming one", file=sys.stderr, flush=True)
        return
    count = world_size_from_argv(argv)
    wait_s = float(env.get("TANDEM_GPU_SLOT_WAIT_S", "600"))
    claims = claim_gpus(devices, count, Path(slot_dir), wait_s)
    for claim in claims:
        os.set_inheritable(claim.fd, True)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(c.device_id for c in claims)
    print(f"entrypoint: claimed GPUs {env['CUDA_VISIBLE_DEVICES']}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- several hosts


def multihost_argv(env: dict[str, str], argv: Sequence[str]) -> list[str]:
    """`entrypoint multihost-worker [unified worker flags]`: one pod of a unified worker whose
    ranks span pods (a StatefulSet; `TANDEM_NODE_RANK` from the pod's index). Pod 0 runs the
    worker with `--node-rank 0`; the others run `tandem rank-host` with the same flags and
    their own node rank (it ignores what is not an engine flag)."""
    node_rank = int(env.get("TANDEM_NODE_RANK", "0") or 0)
    flags = [*argv, "--node-rank", str(node_rank)]
    if node_rank == 0:
        return [sys.executable, "-m", SERVICES["decode-worker"], "--unified", *flags]
    return [sys.executable, "-m", "tandem.cli", "rank-host", *flags]


# ----------------------------------------------------------------------------- probes


def health(address: str, service: str, timeout_s: float, tls: TlsConfig = PLAINTEXT) -> bool:
    """Whether the gRPC health service at `address` reports `service` SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with sync_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def drain(
    scheduler: str, worker: str, worker_id: str, timeout_s: float, tls: TlsConfig = PLAINTEXT
) -> int:
    """Stop routing to `worker_id`, then wait until the worker at `worker` is idle."""
    import grpc

    from tandem_protos.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

    deadline = time.monotonic() + timeout_s
    if scheduler and worker_id:
        try:
            with sync_channel(scheduler, tls) as channel:
                scheduler_pb2_grpc.SchedulerStub(channel).DeregisterWorker(
                    scheduler_pb2.DeregisterWorkerRequest(worker_id=worker_id), timeout=5.0
                )
        except grpc.RpcError as exc:
            print(f"drain: scheduler unreachable ({exc.code().name})", file=sys.stderr)
    with sync_channel(worker, tls) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        while time.monotonic() < deadline:
            try:
                stats = stub.Stats(worker_pb2.StatsRequest(), timeout=5.0)
            except grpc.RpcError:
                return 0  # gone already
            if stats.num_inflight == 0:
                return 0
            time.sleep(0.5)
    print(f"drain: still busy after {timeout_s:g}s", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- main


def _usage() -> str:
    names = [*SERVICES, *TANDEM_COMMANDS, "multihost-worker", "health", "drain"]
    return f"usage: entrypoint {{{'|'.join(names)}}} [flags]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    env = dict(os.environ)
    if command in SERVICES:
        if command in _WORKERS:
            _claim_for_worker(env, rest)
        os.execve(sys.executable, [sys.executable, "-m", SERVICES[command], *rest], env)
    if command == "multihost-worker":
        if int(env.get("TANDEM_NODE_RANK", "0") or 0) == 0:
            _claim_for_worker(env, rest)
        argv = multihost_argv(env, rest)
        os.execve(argv[0], argv, env)
    if command in TANDEM_COMMANDS:
        os.execve(sys.executable, [sys.executable, "-m", "tandem.cli", command, *rest], env)
    if command == "health":
        p = argparse.ArgumentParser(prog="entrypoint health")
        p.add_argument("address", help="host:port of a tandem gRPC server")
        p.add_argument("--service", default="", help="service name ('' : the whole server)")
        p.add_argument("--timeout-s", type=float, default=3.0)
        add_tls_args(p)
        ns = p.parse_args(rest)
        return 0 if health(ns.address, ns.service, ns.timeout_s, tls_config_from(ns)) else 1
    if command == "drain":
        p = argparse.ArgumentParser(prog="entrypoint drain")
        p.add_argument("--scheduler", default=env.get("TANDEM_SCHEDULER_ADDRESS", ""))
        p.add_argument("--worker", default="127.0.0.1:" + env.get("TANDEM_WORKER_PORT", "50060"))
        p.add_argument("--worker-id", default=env.get("HOSTNAME", socket.gethostname()))
        p.add_argument("--timeout-s", type=float, default=120.0)
        add_tls_args(p)
        ns = p.parse_args(rest)
        return drain(ns.scheduler, ns.worker, ns.worker_id, ns.timeout_s, tls_config_from(ns))
    print(_usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
