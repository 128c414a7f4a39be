"""What the runner, the graph managers and the loader need of a model.

A model runs one flattened sequence of all scheduled tokens (no padding between requests)
over this rank's share: its TP rank's heads and columns, its PP stage's layers. Under pipeline
parallel a stage that is not the last returns `IntermediateTensors` (the hidden states and the
residual stream) instead of hidden states, and a stage that is not the first takes them in
place of `input_ids`.

    runner --ModelContext--> model_cls(hf_config, ctx)
           --load_weights(iter of (HF name, tensor))--> each parameter's weight_loader
           --forward(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)-->
           --compute_logits(hidden [N, hidden])--> [N, vocab] float32 (gathered over TP)

Models never name an attention backend class: they build `tandem.layers.attention.Attention`
layers from the context, and the runner owns graph splitting (it splits at those layers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from tandem.distributed import ParallelState, single_rank_state
from tandem.layers.attention.backend import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class ModelContext:
    """Everything a model's layers are built from, besides the HF config."""

    dtype: torch.dtype
    device: torch.device
    attn_backend: AttentionBackend
    parallel: ParallelState
    # The engine's QuantizationConfig (None: unquantized); layers ask it for their method.
    quant_config: Any = None
    # MoE layers: experts spread whole over the EP group (else split like the MLPs over TP).
    enable_expert_parallel: bool = False
    # The CPU step path's GEMM (`--cpu-gemm`, tandem.layers.cpu_gemm): "auto" is a fixed rule.
    cpu_gemm: str = "auto"
    # The context the engine serves (None: the model's configured maximum); LongRoPE chooses
    # its factors by it (tandem.layers.rotary.uses_long_factors).
    max_model_len: int | None = None

    @staticmethod
    def single(
        dtype: torch.dtype, device: torch.device, attn_backend: AttentionBackend
    ) -> ModelContext:
        """One rank, unquantized."""
        device = torch.device(device)
        return ModelContext(dtype, device, attn_backend, single_rank_state(device))

    @property
    def cpu_kernels(self) -> bool:
        """Whether layers take the CPU step path's C++ kernels."""
        return self.device.type == "cpu" and self.attn_backend.name == "cpu"


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: named `[T, hidden]` tensors."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value


@runtime_checkable
class CausalLM(Protocol):
    """The model interface (see the module docstring). Sizes are this rank's."""

    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    # Layers of the whole model, and the `[start, end)` this stage holds (`kv_caches` has
    # `end - start` views, one per held layer).
    num_layers: int
    layer_range: tuple[int, int]
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads (replicated when ranks outnumber them)
    head_size: int
    hidden_size: int
    vocab_size: int  # the logits' width (unpadded)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def make_empty_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors: ...
