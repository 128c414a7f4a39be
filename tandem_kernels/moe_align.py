"""Sorting a fused MoE call's (token, expert) pairs by expert, padded to whole tiles.

    topk_ids [T, k] -> sorted_token_ids [EM], expert_ids [EM / BLOCK_M], num_tokens_post_padded

(see tandem_kernels/fused_moe.py for the layout). Pairs are cut into chunks of `CHUNK` ids, a
program taking `subs` chunks one after another; three launches, no host sync (a call can be
captured in a CUDA graph):

    count    grid (P,)  counts[c, e] = pairs of program c's chunks routed to expert e; a
                        share of sorted_token_ids filled with the no-pair id T * k
    offsets  grid (1,)  base[c, e]   = padded_start[e] + pairs of e in programs before c;
                        padded_end[e], num_tokens_post_padded
    place    grid (P,)  each pair p of program c, chunk by chunk, to the slot base[c, e_p]
                        + its rank among program c's pairs of e_p; a share of expert_ids

A chunk counts and ranks its pairs with a one-hot `[CHUNK, E_PAD]` tile (its column sums, its
running sums down the rows), so within an expert the pairs keep their order, as a stable sort
would: the same result as `moe_align_block_size_ref`, the torch ops (an argsort and about 15
small kernels) these three launches replace. Ids >= E (experts of another rank) are not
placed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _one_hot(ids_ptr, chunk, num_pairs, num_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """`[CHUNK, E_PAD]` int32: 1 where pair `chunk * CHUNK + i` is routed to local expert j."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts)
    experts = tl.arange(0, E_PAD)
    hot = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)
    return hot.to(tl.int32), ids, offs


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, num_pairs, num_experts, num_slots, slots_per,
                  subs, CHUNK: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """Program c's counts per expert over its `subs` chunks; and its share of the sorted ids
    filled with "no pair" (the place kernel, two launches later, writes the real ones)."""
    prog = tl.program_id(0)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for sub in range(0, subs):
        hot, _, _ = _one_hot(ids_ptr, prog * subs + sub, num_pairs, num_experts, CHUNK, E_PAD)
        counts += tl.sum(hot, axis=0)
    tl.store(counts_ptr + prog * E_PAD + tl.arange(0, E_PAD), counts)
    end = tl.minimum((prog + 1) * slots_per, num_slots)
    for s0 in range(prog * slots_per, end, FILL):
        slots = s0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + slots, tl.full((FILL,), 0, dtype=tl.int32) + num_pairs,
                 mask=slots < end)  # fmt: skip


@triton.jit
def _offsets_kernel(counts_ptr, base_ptr, padded_end_ptr, num_post_ptr, num_chunks, block_m,
                    E_PAD: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """One program: each expert's padded run (its end into `padded_end`, the sum into
    num_post) and `base[c, e]`, where chunk c's first pair of expert e goes."""
    experts = tl.arange(0, E_PAD)
    # Each expert's pairs: the column sums of counts, ROWS chunks a step.
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        tile = tl.load(
            counts_ptr + rows[:, None] * E_PAD + experts[None, :],
            mask=(rows < num_chunks)[:, None],
            other=0,
        )
        totals += tl.sum(tile, axis=0)
    padded = (totals + block_m - 1) // block_m * block_m
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(padded_end_ptr + experts, padded_end)
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    carry = padded_end - padded
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        mask = (rows < num_chunks)[:, None]
        tile = tl.load(counts_ptr + rows[:, None] * E_PAD + experts[None, :], mask=mask, other=0)
        running = tl.cumsum(tile, axis=0)
        tl.store(base_ptr + rows[:, None] * E_PAD + experts[None, :],
                 carry[None, :] + running - tile, mask=mask)  # fmt: skip
        carry += tl.sum(tile, axis=0)


@triton.jit
def _place_kernel(ids_ptr, base_ptr, padded_end_ptr, sorted_ptr, expert_ids_ptr, num_pairs,
                  num_experts, num_blocks, blocks_per, block_m, subs,
                  CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    """Program c's pairs into their slots, chunk by chunk (a pair's slot: its expert's next
    free one, `next[e]`, plus its rank among the chunk's pairs of that expert; both read off
    the one-hot tile); and its share of `expert_ids`: block j belongs to the expert whose
    padded run holds row j * block_m, the number of runs ending at or before it (E past the
    last run)."""
    prog = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    next_slot = tl.load(base_ptr + prog * E_PAD + experts)
    for sub in range(0, subs):
        hot, ids, offs = _one_hot(ids_ptr, prog * subs + sub, num_pairs, num_experts, CHUNK,
                                  E_PAD)  # fmt: skip
        slot = tl.sum((tl.cumsum(hot, axis=0) - 1 + next_slot[None, :]) * hot, axis=1)
        valid = (offs < num_pairs) & (ids < num_experts)
        tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=valid)
        next_slot += tl.sum(hot, axis=0)
    padded_end = tl.load(padded_end_ptr + experts)
    end = tl.minimum((prog + 1) * blocks_per, num_blocks)
    for j0 in range(prog * blocks_per, end, BLOCKS):
        blocks = j0 + tl.arange(0, BLOCKS)
        ended = padded_end[None, :] <= (blocks * block_m)[:, None]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < end)


# Programs of the count and place kernels: about one an SM (each takes `subs` chunks), so
# the one-program offsets kernel has few rows of counts to sum (at Qwen3-30B-A3B's 4,096
# tokens on an H100, a row a chunk of 128 pairs left it 35 us of 883).
_PROGRAMS = 128


def _tiles(num_experts: int) -> tuple[int, int]:
    """(E_PAD, CHUNK): experts padded to a power of two (16 at least), and chunks of pairs
    small enough that the one-hot tile stays at 16K elements."""
    e_pad = max(16, triton.next_power_of_2(num_experts))
    return e_pad, max(16, min(128, 16384 // e_pad))


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(sorted_token_ids [EM] int32, expert_ids [EM / block_m] int32, num_tokens_post_padded
    [1] int32)` for `topk_ids [T, k]`, EM = cdiv(T * k + E * (block_m - 1), block_m) *
    block_m: three Triton launches on CUDA (and under the interpreter), the torch reference
    elsewhere. Pairs of one expert keep their order; ids >= E are left out."""
    if not (topk_ids.is_cuda or _interpreting()):
        return moe_align_block_size_ref(topk_ids, block_m, num_experts)
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    num_pairs = ids.numel()
    dev = ids.device
    e_pad, chunk = _tiles(num_experts)
    subs = triton.cdiv(max(1, triton.cdiv(num_pairs, chunk)), _PROGRAMS)
    programs = max(1, triton.cdiv(num_pairs, chunk * subs))
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    num_blocks = max_padded // block_m
    counts = torch.empty(programs, e_pad, dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    padded_end = torch.empty(e_pad, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    warps = 8 if chunk * e_pad >= 8192 else 4
    _count_kernel[(programs,)](
        ids, counts, sorted_ids, num_pairs, num_experts, max_padded,
        triton.cdiv(max_padded, programs), subs, CHUNK=chunk, E_PAD=e_pad, FILL=1024,
        num_warps=warps,
    )  # fmt: skip
    _offsets_kernel[(1,)](
        counts, base, padded_end, num_post, programs, block_m, E_PAD=e_pad,
        ROWS=max(1, 8192 // e_pad), num_warps=8,
    )  # fmt: skip
    _place_kernel[(programs,)](
        ids, base, padded_end, sorted_ids, expert_ids, num_pairs, num_experts, num_blocks,
        triton.cdiv(num_blocks, programs), block_m, subs, CHUNK=chunk, E_PAD=e_pad,
        BLOCKS=max(16, 4096 // e_pad), num_warps=warps,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_post


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_block_size` in torch ops: a stable argsort by expert, each expert's run
    padded to a multiple of block_m. Device ops only, no sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    dev = flat.device
    capped = flat.clamp(max=num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, capped, torch.ones_like(capped))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    unpadded_start = counts.cumsum(0) - counts
    order = torch.argsort(capped, stable=True)
    sorted_experts = capped[order]
    valid = sorted_experts < num_experts
    expert_of = sorted_experts.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=dev) - unpadded_start[expert_of]
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    # Pairs of other ranks' experts land in one scratch slot past the end.
    pos = torch.where(valid, padded_start[expert_of] + rank, max_padded)
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_ids[:max_padded], expert_ids, padded_end[-1:].to(torch.int32)
