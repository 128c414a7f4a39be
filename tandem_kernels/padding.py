"""Zero a CUDA graph's padding rows, whose count only the device knows.

A whole mixed step replays a graph captured at a bucket of `T` token rows; the step fills the
first `n` (`query_start_loc[num_reqs]`, on the device) and the rest are padding that no request
owns. An attention kernel never writes those rows of its output, so they hold whatever the
graph's memory held: NaN, inf or huge finite values. Rows are independent through the linear
layers, but a per-tensor dynamic activation scale (FP8 `quantization="fp8"`) takes the max
over every row: one inf or 1e38 in a padding row makes the real rows' scale inf or huge, and
their output NaN or zero. The host cannot zero `out[n:]` inside the graph (`n` changes per
replay), so this kernel reads `n` where the graph's inputs keep it.

    zero_rows_from(out, start)       rows `start[0]..` of `out` `[T, ...]` set to 0, in place
    zero_rows_from_ref(out, start)   the same in torch (reads `start` on the host)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _zero_rows_from_kernel(
    out_ptr, start_ptr, stride_row, WIDTH: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    if row >= tl.load(start_ptr):
        base = out_ptr + row.to(tl.int64) * stride_row
        for col in range(0, WIDTH, BLOCK):
            offs = col + tl.arange(0, BLOCK)
            tl.store(base + offs, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), offs < WIDTH)


def zero_rows_from(out: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Rows `start[0]` and after of `out` (`[T, ...]`, each row contiguous) set to zero, in
    place; `start` an integer tensor of one element on `out`'s device. No host sync:
    capturable in a CUDA graph, whose replays may move `start`. Returns `out`."""
    assert start.numel() == 1 and start.device == out.device, (start.shape, start.device)
    rows = out.shape[0]
    if rows == 0:
        return out
    flat = out.view(rows, -1)
    assert flat.stride(-1) == 1, flat.stride()
    width = flat.shape[1]
    block = min(triton.next_power_of_2(width), 4096)
    _zero_rows_from_kernel[(rows,)](flat, start, flat.stride(0), WIDTH=width, BLOCK=block)
    return out


def zero_rows_from_ref(out: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    out[int(start.reshape(-1)[0]) :] = 0
    return out
