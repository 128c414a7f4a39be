"""The W8A16 kernels compiled for Hopper (sm_90) here, with no GPU: Triton's compiler and the
ptxas bundled with it, on the CPU. What a run on the GPU only shows as time, read off the code:
the GEMV form reads its weight 16 bytes a load, split-K's last-program handshake is a
release/acquire atomic followed by L2 reads, the `W x^T` form is a warpgroup MMA taking the
widened weight from registers, and nothing spills to local memory.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")

from tandem_kernels import fp8_w8a16 as w8a16  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = [
    pytest.mark.skipif(not (_BIN / "ptxas").exists(), reason="triton without its bundled ptxas"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
_POINTERS = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "ws_ptr", "locks_ptr")
_INTS = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_s")


def _compile(config: w8a16.Config, gated: bool = False, use_pdl: bool = False) -> tuple[str, int]:
    """(PTX, bytes of local-memory stack per thread) of `config` for bf16 activations;
    `use_pdl`: as launched with programmatic dependent launch (tandem_kernels.pdl)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gemv = config.block_m < 16
    kernel = w8a16._w8a16_gemv_kernel if gemv else w8a16._w8a16_kernel
    consts: dict[str, Any] = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "SPLIT_K": config.split_k,
        "EVEN_K": True,
        "GATED": gated,
        "USE_PDL": use_pdl,
    }
    if gemv:
        consts |= {"EARLY_WEIGHT": use_pdl, "PREFETCH": config.prefetch}
        consts["IN_PLACE"] = config.in_place
    else:
        consts |= {"SWAP_AB": config.swap_ab, "INPUT_PRECISION": "tf32"}
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16"}
    types |= {"ws_ptr": "*fp32", "locks_ptr": "*i32"}
    signature = {n: types.get(n, "i32" if n in _INTS else "constexpr") for n in kernel.arg_names}
    index = kernel.arg_names.index
    # As the launcher specialises them: 16-byte aligned pointers, sizes multiples of 16.
    aligned = [*_POINTERS, "N", "K", "stride_xm", "stride_wn", "stride_om"]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(index(n),): v for n, v in consts.items()},
        attrs={(index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options: dict[str, Any] = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if use_pdl:
        options["launch_pdl"] = True
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [str(_BIN / "cuobjdump"), "-res-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    stack = max(int(s) for s in re.findall(r"STACK:(\d+)", usage))
    return compiled.asm["ptx"], stack


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


_FORMS = {  # the GEMV loop's forms: (prefetch, reduce_each)
    "plain": (False, False),
    "prefetch": (True, False),
    "reduce_each": (False, True),
    "prefetch_reduce_each": (True, True),
}


@pytest.mark.parametrize(
    ("rows", "form"),
    [
        (1, "plain"),
        (8, "plain"),
        (1, "prefetch"),
        (2, "prefetch"),
        (1, "reduce_each"),
        (1, "prefetch_reduce_each"),
    ],
    ids=str,
)
def test_gemv_reads_its_weight_16_bytes_a_load_and_hands_off_split_k(rows: int, form: str) -> None:
    prefetch, reduce_each = _FORMS[form]
    config = w8a16.Config(rows, 16, 512, 4, 4, 1, prefetch=prefetch, reduce_each=reduce_each)
    ptx, stack = _compile(config, gated=rows == 1)
    threads = 32 * config.num_warps
    # The [16, 512] e4m3 tile: 8 KB over 128 threads, four 16-byte loads each; none narrower.
    assert _count(ptx, r"ld\.global\.v4\.b32") >= config.block_n * config.block_k // threads // 16
    assert _count(ptx, r"ld\.global(\.\w+)*\.(u8|b8|b16) ") == 0
    assert _count(ptx, r"atom\.global\.gpu\.acq_rel\.add") == 1  # the tile's arrival
    assert _count(ptx, r"bar\.sync") >= 1  # every thread's partial stored before it
    assert _count(ptx, r"ld\.global\.cg") >= 1  # the last program sums the partials from L2
    assert _count(ptx, r"atom\.global\.gpu\.relaxed\.exch") == 1  # and leaves the lock at 0
    assert stack == 0


def test_swapped_form_is_a_warpgroup_mma_with_the_weight_in_registers() -> None:
    ptx, stack = _compile(w8a16.Config(16, 64, 256, 4, 4, 3, True))
    # m64n16k16: 64 weight rows by 16 (padded) activation rows; A as registers ({...}).
    assert _count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.bf16\.bf16 \{[^}]+\}, \{")
    assert stack == 0


@pytest.mark.parametrize("form", list(_FORMS))
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_with_pdl_reads_only_its_first_weight_chunk_before_the_wait(
    rows: int, form: str
) -> None:
    """Launched with PDL the GEMV may run beside the kernel before it: until
    `griddepcontrol.wait` it touches nothing but its weight (the one input no kernel writes),
    one 16-byte load per piece of its first chunk, and it still spills nothing; the same for
    the loop that loads a chunk ahead (`Config.prefetch`) and the one that reduces each chunk
    (`Config.reduce_each`)."""
    prefetch, reduce_each = _FORMS[form]
    config = w8a16.Config(rows, 16, 512, 4, 4, 1, prefetch=prefetch, reduce_each=reduce_each)
    ptx, stack = _compile(config, gated=rows == 1, use_pdl=True)
    before, wait, after = ptx.partition("griddepcontrol.wait")
    assert wait, "no griddepcontrol.wait in a PDL launch"
    threads = 32 * config.num_warps
    assert _count(before, r"ld\.global") == config.block_n * config.block_k // threads // 16
    assert _count(before, r"ld\.global\.v4\.b32") == _count(before, r"ld\.global")
    assert _count(before, r"st\.global|atom\.|red\.") == 0
    assert _count(after, r"griddepcontrol\.launch_dependents") == 1
    assert _count(after, r"ld\.global") > 0  # x and the rest of the weight
    assert stack == 0
    # The same kernel without PDL has no grid dependency control at all.
    plain, _ = _compile(config, gated=rows == 1)
    assert "griddepcontrol" not in plain


def test_tensor_core_form_with_pdl_waits_before_any_memory_access() -> None:
    ptx, _ = _compile(w8a16.Config(16, 64, 256, 4, 4, 3, True), use_pdl=True)
    before, wait, _ = ptx.partition("griddepcontrol.wait")
    assert wait and _count(before, r"ld\.global|st\.global|cp\.async|atom\.|red\.") == 0
