"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.cpu_gemm import pack_cpu_weight, packed_or_plain_linear


class VocabEmbedding(nn.Module):
    """`[T] int64 -> [T, hidden]`."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states -> float32 logits. With `tied_to`, it reads the embedding's weight."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )
        # The prepacked copy of `weight` on the CPU step path (see tandem.layers.linear).
        self.cpu_packed_weight: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden] -> [N, vocab]` float32."""
        if self.cpu_packed_weight is None:
            return F.linear(hidden_states, self.weight).float()
        logits = packed_or_plain_linear(hidden_states, self.weight, None, self.cpu_packed_weight)
        return logits.float()

    def pack_for_cpu(self) -> bool:
        """As `Linear.pack_for_cpu` (the tied embedding's weight when tied)."""
        self.cpu_packed_weight = pack_cpu_weight(self.weight)
        return self.cpu_packed_weight is not None
