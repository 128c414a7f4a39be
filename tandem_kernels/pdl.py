"""Programmatic dependent launch (PDL) for the kernels of a decode step (Hopper and later).

A small-batch decode step is a chain of short kernels (RMSNorm, the W8A16 GEMVs, rotary, the
KV write, decode attention and its merge): at batch 1 on the H200 each costs a few
microseconds of launch, ramp and tail beside its work, about a quarter of the step. With PDL a
kernel is launched while the one before it still runs; it waits (`griddepcontrol.wait`) for
that kernel to finish and its writes to be visible before it touches anything the earlier
kernels wrote, and it lets the next kernel launch (`griddepcontrol.launch_dependents`) as
soon as all its programs run.

The rule every kernel here keeps (`pdl_wait` first, then only what it allows):
    before the wait   read only what no kernel writes (weights, rotary tables); write nothing
    after the wait    everything else (activations, positions, slots, the cache, workspaces)
The wait covers every earlier kernel, not only the one before: that one finished only after
its own wait. A kernel launched without PDL after a PDL kernel waits as any stream order
waits; a PDL kernel after one that never signals launches when that one ends.

The W8A16 GEMV is the kernel that gains most: it reads its first weight tile before the wait,
so its weight stream starts while the norm or attention merge before it finishes.

Off by default (`enable_pdl`): the engine turns it on from `DeviceConfig.enable_pdl` on
compute capability 9.0+. The interpreter and other devices never take it. Inside CUDA graphs
the launch attribute becomes a programmatic edge of the graph (CUDA 12.3+).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

_enabled = False


def enable_pdl(enabled: bool) -> None:
    """Launch this module's users with PDL from now on (where `pdl_launch` allows)."""
    global _enabled
    _enabled = enabled


def pdl_requested() -> bool:
    """Whether PDL was turned on for this process (`enable_pdl`)."""
    return _enabled


@functools.lru_cache(maxsize=16)
def device_supports_pdl(device: torch.device) -> bool:
    """CUDA compute capability 9.0 or later, compiled (not interpreted) Triton."""
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def pdl_launch(device: torch.device) -> bool:
    """Whether a kernel on `device` launches with PDL now: requested and supported."""
    return _enabled and device_supports_pdl(device)


def launch_options(use_pdl: bool) -> dict[str, Any]:
    """The launch keyword for Triton: passed only when set, since Triton keys its compiled
    kernels on the options given (and the interpreter takes no such option)."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """With USE_PDL: wait until the kernels before this one have finished and their writes
    are visible, then let the next kernel launch. A no-op without it."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
