"""Which KV transport a prefill-decode pair uses (plain Python: the scheduler imports no torch).

A worker tells the scheduler where it runs (`WorkerPlacement`: host, process, KV device, the
transports it speaks); the scheduler picks one transport per pair with `choose_transport` and
puts it in the hand-off; the prefill worker's `KVTransports` sends through that connector.

    auto:  same process, both speak inproc          -> inproc
           same host, both KV caches on CUDA         -> cuda_ipc
           both KV caches on CUDA (and NCCL)         -> nccl
           otherwise                                 -> tcp
    forced (--kv-connector tcp | cuda-ipc | nccl): that transport when both workers speak it
           (cuda_ipc: and share a host); otherwise no transport (the request fails).

CPU workers speak nccl too (over gloo) but auto never picks it for them: TCP needs no group
set-up. Force it to run the NCCL code path on CPUs.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

TCP = "tcp"
CUDA_IPC = "cuda_ipc"
NCCL = "nccl"
INPROC = "inproc"
TRANSPORTS = (TCP, CUDA_IPC, NCCL, INPROC)
# Values of the scheduler's --kv-connector flag.
CONNECTOR_CHOICES = ("auto", "tcp", "cuda-ipc", "nccl")


class NoKVTransportError(ValueError):
    """No transport both workers of a pair speak (or the forced one does not fit)."""


def host_id() -> str:
    """Identifies this host: the kernel's boot id (shared by the containers of one host), else
    the host name."""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        if boot_id:
            return boot_id
    return socket.gethostname()


def normalize_transport(name: str) -> str:
    """'cuda-ipc' -> 'cuda_ipc'; 'auto' stays. Raises ValueError on an unknown name."""
    value = name.strip().lower().replace("-", "_")
    if value != "auto" and value not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; one of auto, {', '.join(TRANSPORTS)}")
    return value


@dataclass(frozen=True)
class WorkerPlacement:
    """Where a worker runs, as far as moving KV is concerned."""

    host_id: str
    process_id: int
    # "cuda" or "cpu"
    kv_device: str
    transports: tuple[str, ...]

    @classmethod
    def here(cls, kv_device: str, transports: Sequence[str]) -> WorkerPlacement:
        return cls(host_id(), os.getpid(), kv_device, tuple(transports))


def choose_transport(
    prefill: WorkerPlacement, decode: WorkerPlacement, preferred: str = "auto"
) -> str:
    """The transport for a pair (see the module docstring). Raises NoKVTransportError."""
    preferred = normalize_transport(preferred)
    common = set(prefill.transports) & set(decode.transports)
    same_host = bool(prefill.host_id) and prefill.host_id == decode.host_id
    both_cuda = prefill.kv_device == decode.kv_device == "cuda"
    if preferred != "auto":
        if preferred not in common:
            raise NoKVTransportError(
                f"KV transport {preferred} was asked for, but the workers speak "
                f"{sorted(prefill.transports)} and {sorted(decode.transports)}"
            )
        if preferred == CUDA_IPC and not (same_host and both_cuda):
            raise NoKVTransportError("CUDA IPC needs both workers on one host, caches on CUDA")
        if preferred == INPROC and not (same_host and prefill.process_id == decode.process_id):
            raise NoKVTransportError("the in-process transport needs both workers in one process")
        return preferred
    if same_host and prefill.process_id == decode.process_id and INPROC in common:
        return INPROC
    if same_host and both_cuda and CUDA_IPC in common:
        return CUDA_IPC
    if both_cuda and NCCL in common:
        return NCCL
    if TCP in common:
        return TCP
    raise NoKVTransportError(
        f"the workers share no KV transport: {sorted(prefill.transports)} and "
        f"{sorted(decode.transports)}"
    )
