"""What a `weight_loader` receives: a checkpoint tensor, loaded or still on disk.

The loader hands out lazy tensors (tandem.loader.hf_folder.SafetensorsSlice) so that a rank
reads only the rows or columns it keeps: `narrow` on a lazy tensor reads just that part.
A plain `torch.Tensor` fits the same protocol (random weights, tests).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CheckpointTensor(Protocol):
    """A tensor of the checkpoint not read yet."""

    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read only `[start, start + length)` along `dim`."""
        ...

    def load(self) -> torch.Tensor:
        """Read the whole tensor."""
        ...


LoadedWeight = torch.Tensor | CheckpointTensor


def full_weight(loaded: LoadedWeight) -> torch.Tensor:
    """The whole tensor, read now if it is lazy."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.load()


def narrow_weight(loaded: LoadedWeight, dim: int, start: int, length: int) -> torch.Tensor:
    """`[start, start + length)` along `dim`: a view of a tensor, a partial read of a lazy one."""
    size = loaded.shape[dim]
    if start < 0 or start + length > size:
        raise ValueError(
            f"shard [{start}, {start + length}) of dim {dim} is outside the checkpoint "
            f"tensor's {size}"
        )
    if start == 0 and length == size:
        return full_weight(loaded)
    return loaded.narrow(dim, start, length)


def copy_weight(target: torch.Tensor, loaded: LoadedWeight, what: str) -> None:
    """`target.copy_(loaded)` after checking the shapes agree (a clear error naming `what`)."""
    tensor = full_weight(loaded)
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(tensor.shape)} != parameter shape "
            f"{tuple(target.shape)}"
        )
    target.copy_(tensor)
