"""The experts of a mixture-of-experts layer, over the tensor- or expert-parallel ranks.

Weights: `w13_weight [E_local, 2 * I_part, H]` (each expert's gate rows, then its up rows) and
`w2_weight [E_local, H, I_part]`. How the ranks share them:

    tensor parallel (default)   every rank holds every expert, its `I / tp` rows of gate and
                                up and columns of down; the partial outputs are summed by an
                                all-reduce over the TP group (as RowParallelLinear's)
    expert parallel             (`enable_expert_parallel`) rank r of the EP group holds experts
                                [r * E / n, (r + 1) * E / n) whole, and tokens travel to them:

        every rank has all T tokens (attention is tensor parallel); rank r takes rows
        [r * c, (r + 1) * c) with c = ceil(T / n), routes them, and
        dispatch   all-to-all: each (token, expert) pair's row to the rank holding the expert
        compute    the pairs it received, each through its one expert (weight 1)
        combine    all-to-all back; the pairs' outputs weighted and summed per token
        gather     all-gather of the ranks' rows: all T tokens' outputs on every rank

The experts run the fused Triton kernel on CUDA (tandem_kernels.fused_moe) and the torch
reference elsewhere (tandem_kernels.moe_ref). Each parameter's `weight_loader(param, tensor,
shard_id, expert_id)` takes one expert's full checkpoint matrix (`w1` gate, `w3` up, `w2`
down) and keeps this rank's part; other ranks' experts are skipped.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.layers.linear import ReplicatedLinear, check_full_size, divide
from tandem.layers.moe.router import select_experts
from tandem.layers.quantization import set_weight_attrs
from tandem.layers.weight_utils import LoadedWeight, copy_weight, full_weight, narrow_weight

if TYPE_CHECKING:
    from tandem.models.interface import ModelContext


def run_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    all_experts_local: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`: the fused kernel on CUDA,
    the torch reference elsewhere. `all_experts_local`: every id is < E (no pair names an
    expert this rank lacks), which spares the kernel a zero fill; leave it False otherwise.
    `w13_scale` / `w2_scale`: FP8 weights' scales per expert and row (`Fp8MoEMethod`), or
    per expert and `weight_block_size` tile (a block-scaled checkpoint's)."""
    if hidden_states.is_cuda:
        from tandem_kernels.fused_moe import fused_moe

        return fused_moe(
            hidden_states,
            w13,
            w2,
            topk_weights,
            topk_ids,
            all_experts_local=all_experts_local,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            weight_block_size=weight_block_size,
        )
    from tandem_kernels.moe_ref import fused_moe_ref

    return fused_moe_ref(
        hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, weight_block_size
    )


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU experts and the routing of tokens to `top_k` of them (see the
    module docstring). `forward(hidden [T, H], router_logits [T, E]) -> [T, H]`, summed over
    the ranks."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        ctx: ModelContext,
        prefix: str = "",
    ) -> None:
        super().__init__()
        what = prefix or "FusedMoE"
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.prefix = prefix
        self.use_ep = ctx.enable_expert_parallel and ctx.parallel.ep.world_size > 1
        self.ep_group = ctx.parallel.ep
        self.tp_group = ctx.parallel.tp
        if self.use_ep:
            self.tp_rank, self.tp_size = 0, 1
            ep_size = self.ep_group.world_size
            if num_experts % ep_size:
                raise ValueError(
                    f"{what}: num_experts {num_experts} is not divisible by the expert "
                    f"parallel size {ep_size}"
                )
            self.num_local_experts = num_experts // ep_size
            self.first_expert = self.ep_group.rank_in_group * self.num_local_experts
        else:
            self.tp_rank, self.tp_size = ctx.parallel.tp_rank, ctx.parallel.tp_size
            self.num_local_experts, self.first_expert = num_experts, 0
        self.intermediate_per_rank = divide(
            intermediate_size, self.tp_size, f"{what}: moe intermediate size"
        )
        local, inter = self.num_local_experts, self.intermediate_per_rank
        self.w13_weight = nn.Parameter(
            torch.empty(local, 2 * inter, hidden_size, dtype=ctx.dtype, device=ctx.device),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(local, hidden_size, inter, dtype=ctx.dtype, device=ctx.device),
            requires_grad=False,
        )
        # Expert parallel's dispatch: None picks the sync-free one only in CUDA graph capture.
        self.ep_sync_free: bool | None = None
        # Tokens routed to each expert since the last `take_expert_load` (every rank sees
        # every token's routing, so each holds the whole layer's load).
        self.register_buffer(
            "expert_load",
            torch.zeros(num_experts, dtype=torch.int64, device=ctx.device),
            persistent=False,
        )
        experts = range(self.first_expert, self.first_expert + local)
        set_weight_attrs(
            self.w13_weight,
            {
                "weight_loader": self.weight_loader,
                "required_shards": {(s, e) for e in experts for s in ("w1", "w3")},
            },
        )
        set_weight_attrs(
            self.w2_weight,
            {"weight_loader": self.weight_loader, "required_shards": {("w2", e) for e in experts}},
        )
        # FP8 experts' scales per expert and row, or per expert and tile of
        # `weight_block_size` (a block-scaled checkpoint's), set by the quantization config's
        # experts method (`quant_method`; None: experts in the model's dtype).
        self.register_buffer("w13_scale", None, persistent=False)
        self.register_buffer("w2_scale", None, persistent=False)
        self.weight_block_size: tuple[int, int] | None = None
        self.quant_method = (
            None if ctx.quant_config is None else ctx.quant_config.get_experts_method(self, prefix)
        )
        if self.quant_method is not None:
            self.quant_method.create_weights(self)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: str, expert_id: int
    ) -> None:
        """One expert's full checkpoint matrix: gate `w1` / up `w3` `[I, H]`, down `w2`
        `[H, I]`; this rank keeps its rows (columns of `w2`), or nothing for an expert it
        does not hold."""
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        what = f"{self.prefix or 'FusedMoE'} expert {expert_id} {shard_id}"
        inter = self.intermediate_per_rank
        start = self.tp_rank * inter
        if shard_id in ("w1", "w3"):
            check_full_size(loaded_weight, 0, self.intermediate_size, what)
            target = param.data[local].narrow(0, 0 if shard_id == "w1" else inter, inter)
            copy_weight(target, narrow_weight(loaded_weight, 0, start, inter), what)
        elif shard_id == "w2":
            check_full_size(loaded_weight, 1, self.intermediate_size, what)
            copy_weight(param.data[local], narrow_weight(loaded_weight, 1, start, inter), what)
        else:
            raise ValueError(f"{what}: shard_id must be w1, w2 or w3")

    def scale_loader(
        self, param: nn.Parameter, loaded_scale: LoadedWeight, shard_id: str, expert_id: int
    ) -> None:
        """One expert's FP8 checkpoint scale of a projection (`weight_scale`: per channel
        `[rows, 1]`, or per tensor, one value) into `param` `[E_local, rows]` (a scale per
        row: `w13_weight_scale`, `w2_weight_scale`): this rank's rows of gate / up (all of
        down's, whose rows are H), a per-tensor value on every row. A block scale
        (`weight_scale_inv` `[ceil(rows / bn), ceil(cols / bk)]`) into a 3-D `param` `[E_local,
        tile rows, tile columns]` (`w13_weight_scale_inv`, `w2_weight_scale_inv`): this
        rank's tile rows of gate / up, then its tile columns of down (whole tiles: checked
        when the method made the parameter)."""
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        what = f"{self.prefix or 'FusedMoE'} expert {expert_id} {shard_id} scale"
        scale = full_weight(loaded_scale).to(torch.float32)
        if param.dim() == 3:
            self._load_block_scale(param.data[local], scale, shard_id, what)
            return
        inter = self.intermediate_per_rank
        if shard_id in ("w1", "w3"):
            target = param.data[local].narrow(0, 0 if shard_id == "w1" else inter, inter)
            full_rows, start = self.intermediate_size, self.tp_rank * inter
        elif shard_id == "w2":
            target, full_rows, start = param.data[local], self.hidden_size, 0
        else:
            raise ValueError(f"{what}: shard_id must be w1, w2 or w3")
        if scale.numel() == 1:
            target.fill_(scale.reshape(()))
        elif scale.numel() == full_rows:
            target.copy_(scale.reshape(full_rows)[start : start + target.shape[0]])
        else:
            raise ValueError(
                f"{what}: {tuple(scale.shape)} is neither one scale nor one per row ({full_rows})"
            )

    def _load_block_scale(
        self, target: torch.Tensor, scale: torch.Tensor, shard_id: str, what: str
    ) -> None:
        """A projection's block scale `[ceil(rows / bn), ceil(cols / bk)]` (all ranks') into
        one expert's `target` (`[2 * I_part / bn, ceil(H / bk)]`: gate's tile rows, then up's;
        or `[ceil(H / bn), I_part / bk]` for down, whole under TP > 1)."""
        assert self.weight_block_size is not None, "block scales need weight_block_size"
        bn, bk = self.weight_block_size
        if shard_id in ("w1", "w3"):
            full = (-(-self.intermediate_size // bn), -(-self.hidden_size // bk))
            rows = target.shape[0] // 2
            target = target.narrow(0, 0 if shard_id == "w1" else rows, rows)
            part = scale.narrow(0, self.tp_rank * rows, rows) if scale.shape == full else None
        elif shard_id == "w2":
            full = (-(-self.hidden_size // bn), -(-self.intermediate_size // bk))
            cols = target.shape[1]
            part = scale.narrow(1, self.tp_rank * cols, cols) if scale.shape == full else None
        else:
            raise ValueError(f"{what}: shard_id must be w1, w2 or w3")
        if part is None:
            raise ValueError(
                f"{what}: block scale {tuple(scale.shape)} is not {full}, the [{bn}, {bk}] "
                "tiles of the projection"
            )
        target.copy_(part)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        flat_ids = topk_ids.reshape(-1).long()
        self.expert_load.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        if self.use_ep:
            return self._forward_expert_parallel(hidden_states, topk_weights, topk_ids)
        # Without expert parallel this rank holds every expert the router can pick.
        out = self._experts(hidden_states, topk_weights, topk_ids, all_experts_local=True)
        if self.tp_size > 1:
            out = self.tp_group.all_reduce(out)
        return out

    def _forward_expert_parallel(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch, compute, combine, gather (see the module docstring).

        The exact dispatch sends each rank just its pairs: the counts are exchanged first and
        read on the host. The sync-free one (`ep_sync_free`; by default while a CUDA graph is
        captured) sends every rank a fixed `ceil(T / n) * top_k` rows instead, unused rows
        naming no expert: more bytes, no host read, so the step can be captured."""
        sync_free = self.ep_sync_free
        if sync_free is None:
            sync_free = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
        group = self.ep_group
        size, rank = group.world_size, group.rank_in_group
        num_tokens, hidden = hidden_states.shape
        chunk = -(-num_tokens // size)
        lo, hi = min(rank * chunk, num_tokens), min((rank + 1) * chunk, num_tokens)
        x, ids, weights = hidden_states[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi]
        flat_ids = ids.reshape(-1).long()
        dest = flat_ids // self.num_local_experts
        order = torch.argsort(dest, stable=True)
        rows_out = x[order // self.top_k]
        ids_out = flat_ids[order] % self.num_local_experts
        if sync_free:
            back = self._exchange_padded(rows_out, ids_out, dest[order], chunk * self.top_k)
        else:
            send_counts = torch.bincount(dest, minlength=size)
            recv_counts = group.all_to_all(send_counts)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            rows = group.all_to_all(rows_out, recv, send)
            local_ids = group.all_to_all(ids_out, recv, send)
            y = self._run_local(rows, local_ids, all_experts_local=True)
            back = group.all_to_all(y, send, recv)
        pairs = torch.empty_like(back)
        pairs[order] = back
        mine = (pairs.view(hi - lo, self.top_k, hidden).float() * weights.unsqueeze(-1)).sum(1)
        padded = torch.zeros(chunk, hidden, dtype=hidden_states.dtype, device=x.device)
        padded[: hi - lo] = mine.to(hidden_states.dtype)
        return group.all_gather(padded, dim=0)[:num_tokens]

    def _run_local(
        self, rows: torch.Tensor, local_ids: torch.Tensor, all_experts_local: bool
    ) -> torch.Tensor:
        """Each received row through its one local expert (weight 1; id E_local: none).
        `all_experts_local`: no row names E_local (the exact dispatch sends only pairs of
        this rank's experts; the sync-free one pads with E_local)."""
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return self._experts(rows, ones, local_ids.view(-1, 1), all_experts_local)

    def _experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        all_experts_local: bool,
    ) -> torch.Tensor:
        """`run_experts` over this rank's experts (and their FP8 scales, if any)."""
        return run_experts(
            x,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            all_experts_local=all_experts_local,
            w13_scale=self.w13_scale,
            w2_scale=self.w2_scale,
            weight_block_size=self.weight_block_size,
        )

    def _exchange_padded(
        self, rows: torch.Tensor, local_ids: torch.Tensor, dest: torch.Tensor, capacity: int
    ) -> torch.Tensor:
        """The sync-free round trip: rows sorted by destination rank go into that rank's
        `capacity` slots (the rest name expert E_local: none), equal splits both ways;
        returns the outputs of `rows`, in their order."""
        group, size = self.ep_group, self.ep_group.world_size
        num_rows, hidden = rows.shape
        starts = torch.searchsorted(dest, torch.arange(size, device=dest.device))
        slot = dest * capacity + torch.arange(num_rows, device=dest.device) - starts[dest]
        send = torch.zeros(size * capacity, hidden, dtype=rows.dtype, device=rows.device)
        send_ids = torch.full(
            (size * capacity,), self.num_local_experts, dtype=torch.long, device=rows.device
        )
        send[slot] = rows
        send_ids[slot] = local_ids
        y = self._run_local(
            group.all_to_all(send), group.all_to_all(send_ids), all_experts_local=False
        )
        return group.all_to_all(y)[slot]

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_local_experts}/{self.num_experts}, top_k={self.top_k}, "
            f"hidden={self.hidden_size}, inter={self.intermediate_per_rank}, ep={self.use_ep}, "
            f"dtype={self.w13_weight.dtype}"
            + ("" if self.weight_block_size is None else f", block={list(self.weight_block_size)}")
        )


def take_expert_load(model: nn.Module) -> torch.Tensor | None:
    """`[MoE layers, E]` tokens routed to each expert of each of the model's MoE layers since
    the last call (in module order; on the model's device), the counters reset; None for a
    model without experts. Device ops only: the caller decides when to read it."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return None
    load = torch.stack([m.expert_load for m in layers])
    for m in layers:
        m.expert_load.zero_()
    return load


class SparseMoeBlock(nn.Module):
    """A router (`gate`, `[E, H]`, no bias, replicated) and its experts (`experts`): the MoE
    MLP of Mixtral (`block_sparse_moe`) and Qwen3-MoE (`mlp`), by the checkpoints' names."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        ctx: ModelContext,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # The router stays in the model's dtype under any quantization (as vLLM keeps it):
        # its [E, H] product is tiny, its choices decide every expert's input, and E is often
        # no multiple of 16 (an FP8 GEMM's need).
        router_ctx = dataclasses.replace(ctx, quant_config=None)
        self.gate = ReplicatedLinear(
            hidden_size, num_experts, False, router_ctx, prefix=f"{prefix}.gate"
        )
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            renormalize,
            ctx,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))
