"""Make reads of memory nobody wrote visible: `torch.empty` hands out NaN instead of whatever
the allocator held (often zeros on a fresh CPU page, which would hide the bug)."""

from __future__ import annotations

import contextlib
import math
import unittest.mock
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def nan_filled_empty() -> Iterator[None]:
    """Inside, `torch.empty` returns floating tensors full of NaN: a kernel that reads a
    buffer's unwritten part, or counts on it being zero, gives NaN."""
    empty = torch.empty

    def nan_filled(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = empty(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(math.nan)
        return tensor

    with unittest.mock.patch.object(torch, "empty", nan_filled):
        yield
