"""Registers, shared memory and occupancy of the paged decode kernel per tile config, compiled
for the H200 (sm_90a) on any machine: no GPU needed, only Triton and the ptxas its wheel carries.

A kernel whose register count crosses an occupancy step runs slower on the device without any
change to its loops: a lower-bound compare added to the masked tail tile (the sliding-window
edge, checked for every layer) took the FP8 decode kernel's 128-key config from 168 to 182
registers a thread under Triton 3.6, so 2 blocks of 4 warps fit an SM instead of 3, and it ran
20% slower on the H200 (0.479 -> 0.586 ms for 512 x 1,024 tokens). This prints, for each decode
candidate (`paged_attention._DECODE_CANDIDATES`) and cache dtype, the registers a thread, spill
bytes, shared memory a block and the blocks an SM holds by each, so such a change shows before a
device session. It compiles with what a real launch specializes on (aligned tensors, strides
divisible by 16): without that, loads are not vectorized and the counts mean nothing.

    python -m benchmarks.kernel_registers --out kernel_registers.json

`--dense` prints the same for the Hopper dense prefill kernel's configs
(`dense_attention_hopper.HOPPER_CONFIGS`, bf16, K/V through TMA or pointer loads) instead;
`--moe` for the fused MoE kernel's grouped GEMMs (bf16): GEMM 1 and GEMM 2 of every grouped
candidate (`fused_moe._CANDIDATES`, SiLU in GEMM 1's epilogue or not), then GEMM 2 under each
of its own tile sets (`fused_moe._DOWN_CANDIDATES`) at every block_m the candidates use.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tandem_kernels import dense_attention_hopper as dh
from tandem_kernels import fp8_w8a16 as w8
from tandem_kernels import fused_moe as fm
from tandem_kernels import paged_attention as pa

# The 8B shape: 32 query heads over 8 KV heads (QPK 4), head size 128, 16-token blocks.
QPK, HEAD_SIZE, BLOCK_SIZE = 4, 128, 16
CACHE_TYPES = {"fp8": "*fp8e4nv", "bf16": "*bf16"}


def _signature(cache_type: str) -> dict[str, str]:
    sig: dict[str, str] = {}
    for name in pa._decode_kernel.arg_names:
        if name.isupper():
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        elif name in ("scale_log2", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    sig["cache_ptr"] = cache_type
    for name in ("part_out_ptr", "part_m_ptr", "part_l_ptr"):
        sig[name] = "*fp32"
    sig["seq_lens_ptr"] = sig["block_table_ptr"] = "*i32"
    return sig


# What a real launch specializes on (16-byte aligned tensors, ints divisible by 16), less the
# arguments the kernel is told not to specialize: without these, loads are not vectorized.
_ALIGNED = ("q_ptr", "cache_ptr", "out_ptr", "part_out_ptr", "part_m_ptr", "part_l_ptr",
            "num_heads", "stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head",
            "stride_c_block", "stride_c_kv", "stride_c_off", "stride_c_head")  # fmt: skip


def _attrs() -> dict[tuple[int, ...], list[list[Any]]]:
    names = pa._decode_kernel.arg_names
    return {(names.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED}


def decode_kernel_ptx(
    cache_type: str,
    block_n: int,
    warps: int,
    stages: int,
    heads_first: bool,
    sliding: bool,
    fp16_dot: bool,
    max_registers: int = 0,
    use_pdl: bool = False,
) -> tuple[str, int]:
    """PTX of `_decode_kernel` for sm_90a at one config (no split, a bf16 query) and the
    shared memory a block takes (bytes). `fp16_dot`: an FP8 cache read in fp16 (sm_89+
    launches); `use_pdl`: launched with programmatic dependent launch (tandem_kernels.pdl)."""
    constants = {
        "QPK": QPK,
        "BLOCK_H": max(triton.next_power_of_2(QPK), 16),
        "BLOCK_N": block_n,
        "BLOCK_D": triton.next_power_of_2(HEAD_SIZE),
        "BLOCK_SIZE": BLOCK_SIZE,
        "HEAD_SIZE": HEAD_SIZE,
        "SPLIT": False,
        "INPUT_PRECISION": "tf32",
        "HEADS_FIRST": heads_first,
        "SCALE_V": True,
        "SLIDING": sliding,
        "FP16_DOT": fp16_dot,
        "USE_PDL": use_pdl,
    }
    src = ASTSource(pa._decode_kernel, _signature(cache_type), constants, _attrs())
    options: dict[str, int] = {"num_warps": warps, "num_stages": stages}
    if max_registers:
        options["maxnreg"] = max_registers
    if use_pdl:
        options["launch_pdl"] = True
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm["ptx"], int(kernel.metadata.shared)


def ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers per thread and spill bytes, as a ptxas in Triton's wheel reports them (the
    first that takes this PTX version: the wheel carries one per CUDA release it targets)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    text = ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for ptxas in sorted(bin_dir.glob("ptxas*")):
            res = subprocess.run(
                [str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                capture_output=True,
                text=True,
            )
            text = res.stdout + res.stderr
            if res.returncode == 0:
                break
        else:
            raise RuntimeError(f"no ptxas in {bin_dir} took the PTX: {text[-300:]}")
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {
        "registers": int(regs.group(1)) if regs else -1,
        "spill_bytes": int(spill.group(1)) if spill else 0,
    }


def dense_hopper_ptx(config: dh.HopperConfig, tma: bool) -> tuple[str, int]:
    """PTX of `_dense_hopper_kernel` for sm_90a at `config` (bf16, the 8B shape) and the shared
    memory a block takes (bytes); `tma`: K/V through tensor descriptors, else pointers."""
    block_m, block_n, warps, stages, max_registers = config
    kernel = dh._dense_hopper_kernel
    sig: dict[str, str] = {}
    for name in kernel.arg_names:
        if name.isupper():
            sig[name] = "constexpr"
        elif name.endswith("_ptr") or name.endswith("_src"):
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
    sig["lse_ptr"], sig["cu_seqlens_ptr"] = "*fp32", "*i32"
    if tma:
        sig["k_src"] = sig["v_src"] = f"tensordesc<bf16[{block_n}, {HEAD_SIZE}]>"
    constants = {
        "QPK": QPK,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": HEAD_SIZE,
        "HEAD_SIZE": HEAD_SIZE,
        "INPUT_PRECISION": "tf32",
        "TMA": tma,
        "NUM_STAGES": stages,
    }
    # As a launch specializes: aligned tensors, strides divisible by 16 (the LSE's head stride
    # and the sequence offsets are not specialized on).
    aligned = [n for n in kernel.arg_names if n.startswith("stride_") or n.endswith("_ptr")]
    aligned = [n for n in aligned if n not in ("stride_lse_head", "cu_seqlens_ptr")]
    if not tma:
        aligned += ["k_src", "v_src"]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    index = kernel.arg_names.index
    src = ASTSource(kernel, sig, {(index(n),): v for n, v in constants.items()}, attrs)
    options: dict[str, int] = {"num_warps": warps, "num_stages": stages}
    if max_registers:
        options["maxnreg"] = max_registers
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], int(compiled.metadata.shared)


def dense_rows(configs: tuple[dh.HopperConfig, ...] = dh.HOPPER_CONFIGS) -> list[dict[str, Any]]:
    """Registers, spills, shared memory and blocks an SM of the Hopper dense kernel's configs,
    with TMA and with pointer loads, printed as they compile."""
    rows: list[dict[str, Any]] = []
    for config in configs:
        for tma in (True, False):
            ptx, shared = dense_hopper_ptx(config, tma)
            name = dh.hopper_config_name(config)
            loads = "tma" if tma else "ptr"
            usage = compiled_usage(f"{name:14s} {loads}", ptx, shared, config[2])
            rows.append({"config": name, "loads": loads, **usage})
    return rows


def moe_gemm_ptx(block_m: int, tiles: fm.GemmTiles, epilogue: fm.Epilogue) -> tuple[str, int]:
    """PTX of `_fused_moe_kernel` for sm_90a (bf16) at one block_m and GEMM's tiles, with
    GEMM 1's epilogue (None or "silu_and_mul": rows of x read by pair // 8) or GEMM 2's
    ("routed_weight"), and the shared memory a block takes (bytes)."""
    kernel = fm._fused_moe_kernel
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    unit_strides = ("stride_ak", "stride_bk", "stride_cn")  # a launch specializes 1s away
    sig: dict[str, str] = {}
    for name in kernel.arg_names:
        if name in constexpr or name in unit_strides:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        else:
            sig[name] = "i32"
    sig["topk_weights_ptr"] = "*fp32"
    for name in ("sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr"):
        sig[name] = "*i32"
    constants: dict[str, Any] = {
        "A_ROW_DIV": 1 if epilogue == "routed_weight" else 8,
        "MUL_ROUTED_WEIGHT": epilogue == "routed_weight",
        "SILU_AND_MUL": epilogue == "silu_and_mul",
        "BLOCK_M": block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "GROUP_M": tiles.group_m,
        "INPUT_PRECISION": "tf32",
        **dict.fromkeys(unit_strides, 1),
    }
    # As a launch at the real shapes specializes: aligned tensors, sizes and strides divisible
    # by 16 (the real length's one-element tensor is not specialized on).
    aligned = [n for n in kernel.arg_names if sig[n] != "constexpr"]
    aligned.remove("num_tokens_post_padded_ptr")
    index = kernel.arg_names.index
    attrs = {(index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(kernel, sig, {(index(n),): v for n, v in constants.items()}, attrs)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], int(compiled.metadata.shared)


def moe_rows() -> list[dict[str, Any]]:
    """Registers, spills, shared memory and blocks an SM of the fused MoE kernel's GEMMs at
    every grouped candidate and GEMM 2 tile set, printed as they compile."""
    runs: list[tuple[str, str, int, fm.GemmTiles, fm.Epilogue]] = []
    for config in fm._CANDIDATES:
        gate_up: fm.Epilogue = "silu_and_mul" if config.silu_in_epilogue else None
        name = fm.config_name(config)
        runs.append((name, "gemm1", config.block_m, config.gate_up_tiles, gate_up))
        runs.append((name, "gemm2", config.block_m, config.down_tiles, "routed_weight"))
    for block_m in sorted({c.block_m for c in fm._CANDIDATES}):
        for down in fm._DOWN_CANDIDATES:
            name = f"{block_m}/down:{'x'.join(map(str, down))}"
            runs.append((name, "gemm2", block_m, down, "routed_weight"))
    rows: list[dict[str, Any]] = []
    for name, gemm, block_m, tiles, epilogue in runs:
        ptx, shared = moe_gemm_ptx(block_m, tiles, epilogue)
        usage = compiled_usage(f"{name:40s} {gemm}", ptx, shared, tiles.num_warps)
        rows.append({"config": name, "gemm": gemm, **usage})
    return rows


# The 8B's linear layers at batch sizes the W8A16 kernels serve: (name, N, K, gated input).
W8A16_SHAPES = (
    ("qkv", 6144, 4096, False),
    ("o", 4096, 4096, False),
    ("gate_up", 28672, 4096, False),
    ("down", 4096, 14336, True),
)


def w8a16_ptx(config: w8.Config, n: int, k: int, gated: bool, use_pdl: bool) -> tuple[str, int]:
    """PTX of the W8A16 kernel `config` selects (the GEMV form below 16 rows, else the
    tensor-core form) for sm_90a at an `[N, K]` e4m3 weight and a bf16 x, and the shared
    memory a block takes (bytes). `use_pdl`: launched with programmatic dependent launch."""
    gemv = config.block_m < 16
    kernel = w8._w8a16_gemv_kernel if gemv else w8._w8a16_kernel
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    sig: dict[str, str] = {}
    for name in kernel.arg_names:
        if name in constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        else:
            sig[name] = "i32"
    sig["w_ptr"], sig["s_ptr"], sig["ws_ptr"], sig["locks_ptr"] = (
        "*fp8e4nv", "*fp32", "*fp32", "*i32",
    )  # fmt: skip
    constants: dict[str, Any] = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "SPLIT_K": config.split_k,
        "EVEN_K": k % (config.block_k * config.split_k) == 0,
        "GATED": gated,
        "USE_PDL": use_pdl,
    }
    if gemv:
        constants.update(EARLY_WEIGHT=use_pdl, PREFETCH=config.prefetch, IN_PLACE=config.in_place)
    else:
        constants.update(SWAP_AB=config.swap_ab, INPUT_PRECISION="tf32")
    # As a launch specializes: aligned tensors and N, K, strides divisible by 16 (M and the
    # per-tensor scale's stride 0 are not).
    aligned = [n_ for n_ in kernel.arg_names if sig[n_] != "constexpr"]
    aligned = [n_ for n_ in aligned if n_ not in ("M", "stride_s")]
    index = kernel.arg_names.index
    attrs = {(index(n_),): [["tt.divisibility", 16]] for n_ in aligned}
    src = ASTSource(kernel, sig, {(index(n_),): v for n_, v in constants.items()}, attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if use_pdl:
        options["launch_pdl"] = True
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], int(compiled.metadata.shared)


def w8a16_rows(use_pdl: bool) -> list[dict[str, Any]]:
    """Registers, spills, shared memory and blocks an SM of every W8A16 candidate up to 16
    rows at the 8B's four linear shapes, printed as they compile."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[w8.Config, str]] = set()
    for bucket in (b for b in w8.M_BUCKETS if b <= 16):
        for config in w8.candidates(bucket):
            for shape, n, k, gated in W8A16_SHAPES:
                if (gated and bucket > w8.GATED_MAX_M) or (config, shape) in seen:
                    continue
                seen.add((config, shape))
                ptx, shared = w8a16_ptx(config, n, k, gated, use_pdl)
                label = f"{config.name:18s} {shape:8s}"
                usage = compiled_usage(label, ptx, shared, config.num_warps)
                rows.append({"config": config.name, "shape": shape, **usage})
    return rows


# sm_90 per SM: 64K 32-bit registers (allocated per warp in 256s), 228 KB of shared memory
# (1 KB of it reserved per block), at most 64 warps and 32 blocks.
_SM_REGISTERS, _SM_SHARED, _SM_WARPS, _SM_BLOCKS = 65536, 233472, 64, 32


def compiled_usage(label: str, ptx: str, shared: int, warps: int) -> dict[str, Any]:
    """ptxas's registers and spills of `ptx`, its `shared` bytes and the blocks of `warps`
    warps an SM holds, printed as one line after `label`."""
    usage = ptxas_usage(ptx)
    occupancy = blocks_per_sm(usage["registers"], shared, warps)
    print(
        f"{label} {usage['registers']:4d} registers {usage['spill_bytes']:5d} B spilled "
        f"{shared:6d} B shared  {occupancy['blocks_per_sm']} blocks/SM",
        flush=True,
    )
    return {**usage, "shared": shared, **occupancy}


def blocks_per_sm(registers: int, shared: int, warps: int) -> dict[str, int]:
    """How many blocks of `warps` warps one SM holds by registers, by shared memory, and both."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = _SM_REGISTERS // (per_warp * warps)
    by_shared = _SM_SHARED // (shared + 1024) if shared else _SM_BLOCKS
    return {
        "blocks_by_registers": by_regs,
        "blocks_by_shared": by_shared,
        "blocks_per_sm": min(by_regs, by_shared, _SM_WARPS // warps, _SM_BLOCKS),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--sliding", action="store_true", help="the sliding-window variant")
    ap.add_argument("--dense", action="store_true", help="the Hopper dense prefill kernel")
    ap.add_argument("--moe", action="store_true", help="the fused MoE kernel's grouped GEMMs")
    ap.add_argument("--w8a16", action="store_true", help="the W8A16 kernels (GEMV and tiles)")
    ap.add_argument(
        "--pdl", action="store_true", help="decode / W8A16 kernels as launched with PDL"
    )
    ns = ap.parse_args()
    if ns.w8a16:
        if ns.out:
            result = {"triton": triton.__version__, "kernel": "w8a16", "pdl": ns.pdl}
            result["rows"] = w8a16_rows(ns.pdl)
            Path(ns.out).write_text(json.dumps(result, indent=1))
        else:
            w8a16_rows(ns.pdl)
        return
    if ns.moe or ns.dense:
        kernel, rows = ("fused_moe", moe_rows()) if ns.moe else ("dense_hopper", dense_rows())
        if ns.out:
            result = {"triton": triton.__version__, "kernel": kernel, "rows": rows}
            Path(ns.out).write_text(json.dumps(result, indent=1))
        return
    rows: list[dict[str, Any]] = []
    for kind, cache_type in CACHE_TYPES.items():
        for block_n, warps, stages, heads_first, cap in pa._DECODE_CANDIDATES:
            ptx, shared = decode_kernel_ptx(
                cache_type,
                block_n,
                warps,
                stages,
                heads_first,
                ns.sliding,
                kind == "fp8",
                cap,
                ns.pdl,
            )
            name = pa._config_name((block_n, warps, stages, heads_first, cap))
            usage = compiled_usage(f"{kind:5s} {name:22s}", ptx, shared, warps)
            rows.append({"cache": kind, "config": name, **usage})
    if ns.out:
        result = {"triton": triton.__version__, "sliding": ns.sliding, "pdl": ns.pdl}
        result["rows"] = rows
        Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
