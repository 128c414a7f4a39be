"""Programmatic dependent launch (tandem_kernels.pdl) read off the Hopper (sm_90) code, with
no GPU: Triton's compiler on the CPU. A kernel launched with PDL may start while the kernel
before it still runs, so every kernel of the decode chain must wait (`griddepcontrol.wait`)
before its first global memory access (the GEMV alone reads its weight first: see
test_fp8_w8a16_sm90.py), then let the next kernel launch; launched without PDL it carries no
grid dependency control at all. The switch itself: on only where asked and supported.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")

from tandem_kernels import (  # noqa: E402
    paged_attention,
    pdl,
    reshape_and_cache,
    rms_norm,
    rotary,
    rotary_and_cache,
)

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = [
    pytest.mark.skipif(not (_BIN / "ptxas").exists(), reason="triton without its bundled ptxas"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
_MEMORY = r"ld\.global|st\.global|cp\.async|atom\.|red\."


def _ptx(
    kernel: Any, types: dict[str, str], consts: dict[str, Any], use_pdl: bool, warps: int = 4
) -> str:
    """PTX of `kernel` for sm_90a: pointers and floats as `types` says, other runtime
    arguments i32, constexprs from `consts` plus USE_PDL."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    signature = {
        n: "constexpr" if n in constexpr else types.get(n, "i32") for n in kernel.arg_names
    }
    index = kernel.arg_names.index
    values = {**consts, "USE_PDL": use_pdl}
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr")]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(index(n),): v for n, v in values.items()},
        attrs={(index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options: dict[str, Any] = {"num_warps": warps}
    if use_pdl:
        options["launch_pdl"] = True
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(source, target=target, options=options).asm["ptx"]


_BF16 = "*bf16"
_CASES: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {
    "rms_norm": (
        rms_norm._rms_norm_kernel,
        {n: _BF16 for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr")}
        | {"eps": "fp32"},
        {"HIDDEN_SIZE": 4096, "HAS_RESIDUAL": True, "BLOCK": 4096},
    ),
    "rotary": (
        rotary._rotary_kernel,
        {n: _BF16 for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")}
        | {"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
        {"HALF": 64, "BLOCK_H": 32, "BLOCK_HKV": 8, "BLOCK_HALF": 64},
    ),
    "reshape_and_cache": (
        reshape_and_cache._reshape_and_cache_kernel,
        {"key_ptr": _BF16, "value_ptr": _BF16, "cache_ptr": "*fp8e4nv"}
        | {"slot_mapping_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32"},
        {"BLOCK_SIZE": 16, "HEAD_SIZE": 128, "BLOCK_H": 8, "BLOCK_D": 128, "FP8": True},
    ),
    "rotary_and_cache": (
        rotary_and_cache._rotary_and_cache_kernel,
        {n: _BF16 for n in ("qkv_ptr", "q_out_ptr", "k_out_ptr")}
        | {"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
        | {"cache_ptr": "*fp8e4nv", "slot_mapping_ptr": "*i64"}
        | {"k_scale": "fp32", "v_scale": "fp32"},
        dict(HEAD_SIZE=128, HALF=64, BLOCK_SIZE=16, BLOCK_H=32, BLOCK_HKV=8, BLOCK_HALF=64)
        | dict(BLOCK_REST=1, BLOCK_D=128, FP8=True),
    ),
    "decode": (
        paged_attention._decode_kernel,
        {"q_ptr": _BF16, "cache_ptr": "*fp8e4nv", "out_ptr": _BF16}
        | {"seq_lens_ptr": "*i32", "block_table_ptr": "*i32"}
        | {n: "*fp32" for n in ("part_out_ptr", "part_m_ptr", "part_l_ptr")}
        | {"scale_log2": "fp32", "v_scale": "fp32"},
        dict(QPK=4, BLOCK_H=16, BLOCK_N=128, BLOCK_D=128, BLOCK_SIZE=16, HEAD_SIZE=128)
        | dict(SPLIT=True, INPUT_PRECISION="tf32", HEADS_FIRST=True, SCALE_V=True)
        | dict(SLIDING=False, FP16_DOT=True),
    ),
    "decode_merge_last": (
        paged_attention._decode_kernel,
        {"q_ptr": _BF16, "cache_ptr": "*fp8e4nv", "out_ptr": _BF16}
        | {"seq_lens_ptr": "*i32", "block_table_ptr": "*i32", "locks_ptr": "*i32"}
        | {n: "*fp32" for n in ("part_out_ptr", "part_m_ptr", "part_l_ptr")}
        | {"scale_log2": "fp32", "v_scale": "fp32"},
        dict(QPK=4, BLOCK_H=16, BLOCK_N=128, BLOCK_D=128, BLOCK_SIZE=16, HEAD_SIZE=128)
        | dict(SPLIT=True, INPUT_PRECISION="tf32", HEADS_FIRST=True, SCALE_V=True)
        | dict(SLIDING=False, FP16_DOT=True, MERGE_LAST=True, QPK_P2=4, CHUNK_S=8),
    ),
    "decode_reduce": (
        paged_attention._decode_reduce_kernel,
        {n: "*fp32" for n in ("part_out_ptr", "part_m_ptr", "part_l_ptr")} | {"out_ptr": _BF16},
        {"HEAD_SIZE": 128, "BLOCK_S": 64, "BLOCK_D": 128},
    ),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_pdl_kernel_waits_before_touching_memory(name: str) -> None:
    kernel, types, consts = _CASES[name]
    ptx = _ptx(kernel, types, consts, use_pdl=True)
    before, wait, after = ptx.partition("griddepcontrol.wait")
    assert wait, f"{name}: no griddepcontrol.wait in a PDL launch"
    assert re.search(_MEMORY, before) is None, f"{name}: memory access before the wait"
    assert "griddepcontrol.launch_dependents" in after
    assert re.search(_MEMORY, after) is not None
    plain = _ptx(kernel, types, consts, use_pdl=False)
    assert "griddepcontrol" not in plain


def test_pdl_switch_needs_the_request_and_a_capable_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert not pdl.pdl_requested()  # off unless the engine turns it on
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}
    monkeypatch.setattr(pdl, "_enabled", True)
    assert pdl.pdl_requested()
    assert not pdl.pdl_launch(cpu)  # never off CUDA
    pdl.enable_pdl(False)
    assert not pdl.pdl_launch(cpu) and not pdl.pdl_requested()
