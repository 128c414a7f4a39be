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
