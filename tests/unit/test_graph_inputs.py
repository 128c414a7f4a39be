"""The static inputs captured steps read (`tandem.worker.cuda_graph.StaticStepInputs`): a
replay's copy-in fills the leading rows from the step and empties the rest, whatever an
earlier, larger step left there (on the CPU: the copies are the same ops)."""

from __future__ import annotations

import numpy as np
import torch

from tandem.worker.cuda_graph import StaticStepInputs
from tandem.worker.input_batch import StepInputs
from tandem.worker.staging import PinnedStaging


def _step(query_lens: list[int], seq_lens: list[int], width: int) -> StepInputs:
    total = sum(query_lens)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return StepInputs(
        num_reqs=len(query_lens),
        total=total,
        input_ids=np.arange(100, 100 + total, dtype=np.int64),
        positions=np.arange(total, dtype=np.int64),
        slot_mapping=np.arange(10, 10 + total, dtype=np.int64),
        query_start_loc=starts,
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        block_table=np.arange(len(query_lens) * width, dtype=np.int32).reshape(-1, width),
        max_query_len=max(query_lens),
        sampled_rows=[],
        states=[],
    )


def test_mixed_copy_in_empties_padding_rows_and_request_slots() -> None:
    inputs = StaticStepInputs(16, 8, 4, torch.device("cpu"), seq_len_pad=0)
    staging = PinnedStaging(torch.device("cpu"))
    filled: list[int] = []

    def fill(ids: torch.Tensor, inp: StepInputs) -> None:
        filled.append(ids.shape[0])

    # A larger step first, then a smaller one into the same bucket (16 tokens, 8 slots).
    inputs.copy_in(_step([1, 1, 10], [30, 20, 10], 3), 16, 8, staging, fill, True)
    inputs.copy_in(_step([1, 4], [9, 4], 2), 16, 8, staging, fill, True)
    assert filled == [12, 5]
    assert inputs.input_ids[:5].tolist() == [100, 101, 102, 103, 104]
    assert inputs.slot_mapping.tolist() == [10, 11, 12, 13, 14] + [-1] * 11
    assert inputs.query_start_loc.tolist() == [0, 1, 5, 5, 5, 5, 5, 5, 5]
    assert inputs.seq_lens.tolist() == [9, 4, 0, 0, 0, 0, 0, 0]
    assert inputs.block_table[:2, :2].tolist() == [[0, 1], [2, 3]]
    meta = inputs.metadata(16, 8, 16, 1024)
    assert not meta.is_decode_only and meta.num_reqs == 8 and meta.slot_mapping.shape == (16,)


def test_decode_copy_in_keeps_one_token_per_request() -> None:
    inputs = StaticStepInputs(8, 8, 4, torch.device("cpu"), seq_len_pad=1)
    staging = PinnedStaging(torch.device("cpu"))
    inputs.copy_in(_step([1] * 6, [5, 6, 7, 8, 9, 10], 1), 8, 8, staging, lambda i, s: None, False)
    inputs.copy_in(_step([1] * 3, [3, 4, 5], 1), 4, 4, staging, lambda i, s: None, False)
    assert inputs.query_start_loc.tolist() == list(range(9))
    assert inputs.seq_lens[:4].tolist() == [3, 4, 5, 1]
    assert inputs.slot_mapping[:4].tolist() == [10, 11, 12, -1]
    meta = inputs.metadata(4, 4, 1, 1024)
    assert meta.is_decode_only and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_kv_groups_de_interleaved_and_copied_into_the_static_inputs() -> None:
    """Two KV cache groups: a request's flat table `[f0, s0, f1, s1, ...]` gives each group its
    own table and slot mapping, eagerly (StepInputs) and in the static inputs' kv_groups."""
    from tandem.core.outputs import NewRequestData, SchedulerOutput
    from tandem.sampling_params import SamplingParams
    from tandem.worker.input_batch import InputBatch

    batch = InputBatch(block_size=4, max_num_seqs=4, num_kv_groups=2)
    params = SamplingParams()
    # r0: 6 tokens computed, decoding its 7th; r1: a prompt of 9, the first 5 computed. Group 1
    # has freed r0's block 0 (the null block 0).
    batch.add_request(NewRequestData("r0", list(range(7)), [], params, [10, 0, 12, 13], 6), 2, None)
    batch.add_request(
        NewRequestData("r1", list(range(9)), [], params, [20, 21, 22, 23, 24, 25], 5), 2, None
    )
    so = SchedulerOutput(num_scheduled_tokens={"r0": 1, "r1": 4}, total_num_scheduled_tokens=5)
    inp = batch.prepare(so, ["r0", "r1"], {})
    assert inp.group_block_tables is not None and inp.group_slot_mappings is not None
    assert inp.group_block_tables.tolist() == [
        [[10, 12, 0], [20, 22, 24]],
        [[0, 13, 0], [21, 23, 25]],
    ]
    # Positions: r0 6; r1 5..8.
    full = [12 * 4 + 2, 22 * 4 + 1, 22 * 4 + 2, 22 * 4 + 3, 24 * 4 + 0]
    sliding = [13 * 4 + 2, 23 * 4 + 1, 23 * 4 + 2, 23 * 4 + 3, 25 * 4 + 0]
    assert inp.group_slot_mappings.tolist() == [full, sliding]
    assert inp.slot_mapping.tolist() == full and inp.block_table.tolist() == [
        [10, 12, 0],
        [20, 22, 24],
    ]

    inputs = StaticStepInputs(8, 4, 8, torch.device("cpu"), seq_len_pad=0, num_kv_groups=2)
    staging = PinnedStaging(torch.device("cpu"))
    inputs.copy_in(inp, 8, 4, staging, lambda i, s: None, True)
    meta = inputs.metadata(8, 4, 4, 64)
    assert meta.kv_groups is not None and len(meta.kv_groups) == 2
    for g, group in enumerate(meta.kv_groups):
        assert group.kv_groups is None
        assert group.block_table[:2, :3].tolist() == inp.group_block_tables[g].tolist()
        assert group.slot_mapping.tolist() == inp.group_slot_mappings[g].tolist() + [-1] * 3


def test_kv_group_tables_have_unit_column_strides_for_one_block() -> None:
    """One request of one block: each group's table `[1, 1]` must still have a column stride
    of 1 (numpy deems a transposed view with odd strides on size-1 axes contiguous; the CPU
    attention kernel checks the stride)."""
    from tandem.core.outputs import NewRequestData, SchedulerOutput
    from tandem.sampling_params import SamplingParams
    from tandem.worker.input_batch import InputBatch

    batch = InputBatch(block_size=16, max_num_seqs=4, num_kv_groups=2)
    batch.add_request(
        NewRequestData("r0", list(range(5)), [], SamplingParams(), [3, 4], 0), 2, None
    )
    so = SchedulerOutput(num_scheduled_tokens={"r0": 5}, total_num_scheduled_tokens=5)
    inp = batch.prepare(so, ["r0"], {})
    assert inp.group_block_tables is not None
    assert inp.group_block_tables.tolist() == [[[3]], [[4]]]
    tables = torch.from_numpy(inp.group_block_tables)
    for g in range(2):
        assert tables[g].stride() == (1, 1), tables[g].stride()
