"""`--attention-backend` with vLLM's names: TRITON_ATTN is the Triton backend, FLASHINFER and
FLASH_ATTN are optional backends that need their packages (a ConfigError naming the package
where it is absent), and FlashInfer's page table built from tandem's metadata. The optional
backends against the torch reference run in tests/gpu/test_attention_backends_gpu.py."""

from __future__ import annotations

import typing

import pytest
import torch

from tandem.config import (
    ATTENTION_BACKEND_ALIASES,
    ConfigError,
    DeviceConfig,
    attention_backend_name,
)
from tandem.layers.attention import get_attention_backend
from tandem.layers.attention.flashinfer_backend import page_table

_OPTIONAL = {
    "FLASHINFER": ("flashinfer-python", ("flashinfer",)),
    "FLASH_ATTN": ("vllm-flash-attn", ("vllm", "vllm_flash_attn", "flash_attn")),
}


def _installed(modules: tuple[str, ...]) -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.parametrize(
    ("value", "backend"),
    [
        ("TRITON_ATTN", "triton"),
        ("triton", "triton"),
        ("torch", "torch"),
        ("cpu", "cpu"),
        ("auto", "auto"),
        ("FLASHINFER", "flashinfer"),
        ("FLASH_ATTN", "flash_attn"),
    ],
)
def test_vllm_names_and_the_lowercase_ones(value: str, backend: str) -> None:
    assert ATTENTION_BACKEND_ALIASES[value] == backend
    if value in _OPTIONAL and not _installed(_OPTIONAL[value][1]):
        return  # absent here: the next test
    assert attention_backend_name(value) == backend
    assert DeviceConfig(attention_backend=value).attention_backend == value  # type: ignore[arg-type]


def test_the_flag_choices_are_the_alias_table() -> None:
    hint = typing.get_type_hints(DeviceConfig)["attention_backend"]
    assert set(typing.get_args(hint)) == set(ATTENTION_BACKEND_ALIASES)


def test_triton_attn_is_the_triton_backend() -> None:
    assert get_attention_backend("TRITON_ATTN").name == "triton"
    assert get_attention_backend("triton").name == "triton"


@pytest.mark.parametrize(("flag", "setting"), [("0", False), ("1", True), ("", None)])
def test_prefill_cascade_flag(
    flag: str, setting: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TANDEM_PREFILL_CASCADE forces the all-paged kernel (0) or the cascade (1); unset, the
    backend leaves it to `prefill_path`, which keeps the all-paged kernel off CUDA."""
    from tandem_kernels.cascade_attention import prefill_path

    monkeypatch.setenv("TANDEM_PREFILL_CASCADE", flag)
    assert get_attention_backend("triton").prefill_cascade is setting
    cache = torch.zeros(4, 2, 16, 2, 8)
    query = torch.zeros(3, 4, 8)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    args = (query, query[:, :2], query[:, :2], cache, qsl, lens, table, 1.0)
    assert prefill_path(*args, max_query_len=3) == "paged"


@pytest.mark.parametrize(("flag", "fused"), [("", False), ("fused", True), ("separate", False)])
def test_rotary_kv_flag(flag: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """TANDEM_ROTARY_KV=fused has the Triton backend's `forward_qkv` rotate and write K/V in
    one kernel; by default (or "separate") it splits, rotates and calls `forward`. The backend
    says it fuses either way (the layer hands it the projection)."""
    if flag:
        monkeypatch.setenv("TANDEM_ROTARY_KV", flag)
    else:
        monkeypatch.delenv("TANDEM_ROTARY_KV", raising=False)
    backend = get_attention_backend("triton")
    assert backend.fuses_rotary_kv_write and backend.fuse_rotary_kv is fused
    monkeypatch.setenv("TANDEM_ROTARY_KV", "1")
    with pytest.raises(ValueError, match="TANDEM_ROTARY_KV"):
        get_attention_backend("triton")


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"FLASHINFER.*got 'XFORMERS'"):
        DeviceConfig(attention_backend="XFORMERS")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", sorted(_OPTIONAL))
def test_an_absent_optional_backend_is_a_config_error_naming_its_package(value: str) -> None:
    package, modules = _OPTIONAL[value]
    if _installed(modules):
        pytest.skip(f"{package} is installed here: tests/gpu runs the backend")
    with pytest.raises(ConfigError, match=f"{value} needs the {package}"):
        DeviceConfig(attention_backend=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=package):
        get_attention_backend(value)
    with pytest.raises(ConfigError, match=package):
        get_attention_backend(value.lower())


def test_flashinfers_error_names_the_extra_that_installs_it() -> None:
    import tomllib
    from pathlib import Path

    if _installed(_OPTIONAL["FLASHINFER"][1]):
        pytest.skip("flashinfer-python is installed here")
    with pytest.raises(ConfigError, match=r"pip install 'tandem\[flashinfer\]'"):
        DeviceConfig(attention_backend="FLASHINFER")
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert [r.split(">")[0] for r in extras["flashinfer"]] == ["flashinfer-python"]


def test_flashinfer_page_table_from_block_table_and_lengths() -> None:
    block = 16
    seq_lens = [1, 16, 17, 40]
    table = torch.tensor([[7, 0, 0], [3, 0, 0], [5, 9, 0], [2, 4, 8]], dtype=torch.int32)
    indptr, indices, last = page_table(table, seq_lens, block)
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert indices.tolist() == [7, 3, 5, 9, 2, 4, 8]
    assert last.tolist() == [1, 16, 1, 8]
    assert indptr.dtype == last.dtype == torch.int32 and indices.dtype == torch.int32


@pytest.mark.parametrize("seed", range(4))
def test_flashinfer_page_table_against_a_loop(seed: int) -> None:
    """The vectorized page table against the plain per-request loop, lengths 0 and block
    multiples among them, and an empty step."""
    import random

    rng = random.Random(seed)
    block = rng.choice([1, 16, 32])
    n = rng.randrange(0, 40)
    seq_lens = [rng.choice([0, block, 2 * block, rng.randrange(1, 700)]) for _ in range(n)]
    width = max([-(-s // block) for s in seq_lens] + [1]) + rng.randrange(3)
    table = torch.randint(0, 10_000, (n, width), dtype=torch.int32)
    indptr, indices, last = page_table(table, seq_lens, block)
    want_indptr, want_indices, want_last = [0], [], []
    for r, s in enumerate(seq_lens):
        p = -(-s // block)
        want_indptr.append(want_indptr[-1] + p)
        want_indices += table[r, :p].tolist()
        want_last.append(s - (p - 1) * block if p else 0)
    assert indptr.tolist() == want_indptr
    assert indices.tolist() == want_indices
    assert last.tolist() == want_last


def test_every_backend_takes_the_callers_arguments() -> None:
    """Every registered backend's overrides of `AttentionBackend`'s interface (`forward`,
    `forward_qkv`, `write_kv`, `plan_step`, `tune`) bind the base's whole argument list, each
    argument passed as the base declares it (positionally or by keyword). FLASHINFER's
    `write_kv` lacked the KV scales the piecewise graphs pass until its first GPU run failed on
    them; FLASH_ATTN's, until this test. The optional modules import without their packages."""
    import importlib
    import inspect

    from tandem.layers.attention import backend as base

    for module in base._MODULES.values():
        importlib.import_module(module)
    assert set(base._REGISTRY) >= set(base._MODULES)
    interface = ("forward", "forward_qkv", "write_kv", "plan_step", "tune")
    for method in interface:
        declared = inspect.signature(getattr(base.AttentionBackend, method)).parameters.values()
        args = [p.name for p in declared if p.kind is p.POSITIONAL_OR_KEYWORD]
        kwargs = {p.name: p.name for p in declared if p.kind is p.KEYWORD_ONLY}
        for cls in base._REGISTRY.values():
            try:
                inspect.signature(getattr(cls, method)).bind(*args, **kwargs)
            except TypeError as exc:
                raise AssertionError(f"{cls.__name__}.{method}: {exc}") from None
