"""Token embedding and LM head split over the TP ranks by vocabulary rows.

The vocabulary is padded to a multiple of `DEFAULT_VOCAB_PADDING_SIZE * tp_size`, so every rank
holds the same number of rows `per_partition`; rank r holds padded rows
`[r * per_partition, (r+1) * per_partition)`, of which those below `vocab_size` are real (the
rest stay zero and never reach the sampler):

    vocab 49152, tp 3:  padded 49152  -> 16384 rows per rank
    vocab 500,   tp 2:  padded 512    -> rank 0: ids 0..255, rank 1: ids 256..499 + 12 padding

Embedding: each rank looks up the ids in its range (others read as zero rows), then an
all-reduce sums the ranks' rows. LM head: each rank computes its columns of the logits through
its linear method; they are all-gathered and the padding cut, so every rank holds float32
`[N, vocab_size]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.quantization import LinearMethodBase, get_quant_method
from tandem.layers.quantization.unquantized import UnquantizedLinearMethod
from tandem.layers.weight_utils import LoadedWeight, full_weight, narrow_weight

if TYPE_CHECKING:
    from tandem.models.interface import ModelContext

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int) -> int:
    return -(-vocab_size // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """`[T] int64 -> [T, hidden]` over this rank's vocabulary rows (see the module doc)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        ctx: ModelContext,
        prefix: str = "",
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = ctx.parallel.tp
        self.tp_rank = ctx.parallel.tp_rank
        self.tp_size = ctx.parallel.tp_size
        self.prefix = prefix
        self.num_embeddings = num_embeddings  # the real vocabulary
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(
            num_embeddings, DEFAULT_VOCAB_PADDING_SIZE * self.tp_size
        )
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_start_index = min(start, num_embeddings)
        self.vocab_end_index = min(start + self.num_embeddings_per_partition, num_embeddings)
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self,
            embedding_dim,
            [self.num_embeddings_per_partition],
            embedding_dim,
            self.num_embeddings_padded,
            ctx.dtype,
            device=ctx.device,
            weight_loader=self.weight_loader,
        )
        if self.vocab_end_index - self.vocab_start_index < self.num_embeddings_per_partition:
            self.weight.data.zero_()  # the padding rows

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        """Rows `[vocab_start_index, vocab_end_index)` of the `[vocab_size, hidden]` tensor."""
        what = self.prefix or type(self).__name__
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{what}: checkpoint has {loaded_weight.shape[0]} vocabulary rows, the config "
                f"{self.num_embeddings}"
            )
        rows = self.vocab_end_index - self.vocab_start_index
        part = narrow_weight(loaded_weight, 0, self.vocab_start_index, rows)
        target = param.data.narrow(0, 0, rows)
        if tuple(part.shape) != tuple(target.shape):
            raise ValueError(
                f"{what}: checkpoint shape {tuple(loaded_weight.shape)} does not fit "
                f"parameter rows {tuple(target.shape)}"
            )
        target.copy_(full_weight(part))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_range
        out = F.embedding(local_ids, self.weight)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return self.tp_group.all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (padded {self.num_embeddings_padded}), "
            f"rows=[{self.vocab_start_index}, {self.vocab_end_index}), dim={self.embedding_dim}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> float32 logits `[N, vocab_size]` on every TP rank, through the linear
    method the context picks (the same hook as every linear layer). `tie_weights(embedding)`
    makes it read the embedding's weight."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        ctx: ModelContext,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        # Picked before nn.Module.__init__: a config may look at the layer's type and prefix.
        method = get_quant_method(ctx, self, prefix)
        super().__init__(num_embeddings, embedding_dim, ctx, prefix, quant_method=method)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.num_embeddings_per_partition, dtype=ctx.dtype, device=ctx.device),
                requires_grad=False,
            )
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (`tie_word_embeddings`)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("a tied LM head needs the embedding's shape")
        self.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head is applied through compute_logits, not called")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden] -> [N, vocab_size]` float32, gathered over the TP ranks."""
        logits = self.quant_method.apply(self, hidden_states, self.bias)
        if self.tp_size > 1:
            logits = self.tp_group.all_gather(logits, dim=-1)
        if self.num_embeddings_padded != self.num_embeddings:
            return logits[..., : self.num_embeddings].float().contiguous()
        return logits.float()
