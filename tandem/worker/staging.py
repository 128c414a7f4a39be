"""Host -> device copies of a step's inputs through reused pinned buffers.

On CUDA a host array is staged in a pinned buffer and copied with `non_blocking=True`, so the
host does not wait for the device and no pinned memory is allocated per step. The buffers
rotate (a step makes at most 8 copies, there are 16 slots); each slot's event says when the
copy that last read it has finished, and a slot is reused only after that. On other devices
the copy is a plain synchronous one.
"""

from __future__ import annotations

import numpy as np
import torch

# Pinned staging buffers in rotation (a step makes at most 8 host->device copies).
NUM_STAGING = 16


class PinnedStaging:
    """Copies host arrays to one device through a rotation of pinned buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * NUM_STAGING
        self._events: list[torch.cuda.Event | None] = [None] * NUM_STAGING
        self._slot = 0

    def to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """Host array -> a new device tensor (see `copy_to`)."""
        if self.device.type != "cuda":
            return torch.from_numpy(array).to(dtype)
        out = torch.empty(array.shape, dtype=dtype, device=self.device)
        self.copy_to(out, array)
        return out

    def copy_to(self, dst: torch.Tensor, array: np.ndarray) -> None:
        """Copy a host array into `dst` (same shape); asynchronous on CUDA."""
        t = torch.from_numpy(array).to(dst.dtype)
        if self.device.type != "cuda":
            dst.copy_(t)
            return
        nbytes = t.numel() * t.element_size()
        slot = self._slot % NUM_STAGING
        self._slot += 1
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(2 * nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buf
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has finished
        staged = buf[:nbytes].view(dst.dtype).view(t.shape)
        staged.copy_(t)
        dst.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event

    def clear(self) -> None:
        """Drop the pinned buffers (after the device finished every copy)."""
        self._buffers = [None] * NUM_STAGING
        self._events = [None] * NUM_STAGING
