"""The fused MoE kernel against its torch reference on a CUDA device, at the real layer shapes
of Qwen3-30B-A3B (128 experts, top 8, H 2048, I 768) and Mixtral-8x7B (8 experts, top 2,
H 4096, I 14336), bf16, decode to prefill token counts; its per-shape tuning; and a call
captured in a CUDA graph and replayed on new routing (no host sync inside). The decode path
(a GEMV per pair, no sorting) the same way, with ids of experts another rank holds. Every
grouped candidate, SiLU in GEMM 1's epilogue or not, and the tuner's choice between the two;
the zero fill of GEMM 2's output skipped only when the caller vouches every expert is local."""

from __future__ import annotations

import unittest.mock
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import tandem_kernels.fused_moe as fm  # noqa: E402
from tandem.layers.moe import select_experts  # noqa: E402
from tandem_kernels.moe_ref import fused_moe_ref  # noqa: E402
from tests.uninitialized import nan_filled_empty  # noqa: E402

DEV = torch.device("cuda")
# name -> (experts, top_k, hidden, intermediate, renormalize)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}


def _weights(shape: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts, _, hidden, inter, _ = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEV, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEV, generator=gen) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(
    shape: str, num_tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_experts, top_k, hidden, _, renorm = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=DEV, generator=gen)
    logits = torch.randn(num_tokens, num_experts, device=DEV, generator=gen)
    weights, ids = select_experts(logits, top_k, renorm)
    return x, weights, ids


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 intermediates round differently with another summation order: relative error of
    the whole output under 1%, no element off by more than 5% of the largest."""
    out, ref = out.float(), ref.float()
    rel = ((out - ref).norm() / ref.norm()).item()
    err = (out - ref).abs().max().item()
    assert rel < 0.01, f"relative error {rel}"
    assert err <= 0.05 * ref.abs().max().item(), f"max error {err}"


def _captured(run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run` called once on a side stream (compiles, warms the allocator), then captured:
    the graph and its output tensor, which each replay rewrites from the inputs' storage."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def _copy_into(statics: tuple[torch.Tensor, ...], fresh: tuple[torch.Tensor, ...]) -> None:
    """A captured call's inputs take new values in place (new routing for its replay)."""
    for static, new in zip(statics, fresh, strict=True):
        static.copy_(new)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 600, 4096])
def test_fused_moe_matches_reference_bf16(shape: str, num_tokens: int) -> None:
    w13, w2 = _weights(shape, torch.bfloat16)
    x, weights, ids = _routing(shape, num_tokens, seed=num_tokens)
    x = x.to(torch.bfloat16)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    _assert_close(out, ref)
    # Every config the tuner may pick gives the same result.
    key = fm._shape_key(w13, ids.shape[1])
    tuned = fm._configs.get((key, fm.token_bucket(num_tokens)))
    assert tuned is not None, "the first call of a shape tunes its token buckets"
    for config in (fm.default_config(num_tokens, ids.shape[1], w13.shape[0]), tuned):
        _assert_close(fm.fused_moe(x, w13, w2, weights, ids, config), ref)


def test_fused_moe_fp32_exact_products() -> None:
    shape = "qwen3-30b-a3b"
    w13, w2 = _weights(shape, torch.float32)
    x, weights, ids = _routing(shape, 33, seed=1)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_fused_moe_in_a_cuda_graph() -> None:
    shape = "qwen3-30b-a3b"
    w13, w2 = _weights(shape, torch.bfloat16)
    x, weights, ids = _routing(shape, 16, seed=2)
    x = x.to(torch.bfloat16)
    fm.fused_moe(x, w13, w2, weights, ids)  # tunes, compiles
    graph, out = _captured(lambda: fm.fused_moe(x, w13, w2, weights, ids))
    _copy_into((x, weights, ids), _routing(shape, 16, seed=3))
    graph.replay()
    _assert_close(out, fused_moe_ref(x, w13, w2, weights, ids))


def _drop_to_other_rank(ids: torch.Tensor, num_experts: int) -> None:
    """Expert parallel: some pairs name experts another rank holds (ids >= E): every third
    token's last; with more than one token, all of the last token's."""
    ids[::3, -1] = num_experts
    if ids.shape[0] > 1:
        ids[-1] = num_experts + 3


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_decode_path_matches_reference_bf16(shape: str, num_tokens: int) -> None:
    w13, w2 = _weights(shape, torch.bfloat16)
    x, weights, ids = _routing(shape, num_tokens, seed=10 + num_tokens)
    x = x.to(torch.bfloat16)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    ep_ids = ids.clone()
    _drop_to_other_rank(ep_ids, w13.shape[0])
    ep_ref = fused_moe_ref(x, w13, w2, weights, ep_ids)
    assert ep_ref.abs().max() > 0
    assert num_tokens == 1 or ep_ref[-1].abs().max() == 0
    for config in fm._DECODE_CANDIDATES:
        out = fm.fused_moe(x, w13, w2, weights, ids, config)
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        _assert_close(out, ref)
        out = fm.fused_moe(x, w13, w2, weights, ep_ids, config)
        _assert_close(out, ep_ref)
        if num_tokens > 1:
            assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_decode_path_fp32_exact_products() -> None:
    shape = "qwen3-30b-a3b"
    w13, w2 = _weights(shape, torch.float32)
    x, weights, ids = _routing(shape, 5, seed=4)
    out = fm.fused_moe(x, w13, w2, weights, ids, fm._DEFAULT_DECODE)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_tuner_times_the_decode_path_for_small_buckets_in_a_graph() -> None:
    """Buckets of at most _DECODE_TUNE_MAX_ROWS rows per expert time the decode candidates
    (replayed from a graph) beside the grouped ones; larger buckets do not."""
    w13, w2 = _weights("mixtral-8x7b", torch.bfloat16)
    tuned = fm.tune_fused_moe(w13, w2, 2, max_tokens=64)
    key = fm._shape_key(w13, 2)
    logs = {
        e["num_tokens"]: e
        for e in fm.tuning_log
        if e["key"] == [*key[:4], str(key[4])] and e["num_tokens"] <= 64
    }
    assert sorted(logs) == [1, 2, 4, 8, 16, 32, 64] and set(tuned) >= set(logs)
    for bucket, entry in logs.items():
        decode_timed = [n for n in entry["ms"] if n.startswith("decode:")]
        small = bucket * 2 <= fm._DECODE_TUNE_MAX_ROWS * 8
        assert entry["timed_in_graph"] == small
        assert len(decode_timed) == (len(fm._DECODE_CANDIDATES) if small else 0), entry
        assert entry["best"] == fm.config_name(tuned[bucket])


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_path_in_a_cuda_graph(shape: str, stages: int) -> None:
    """Captured with one routing, replayed on others (ids of absent experts included): the
    decode path reads the routing on the device only; plain loads and cp.async prefetch."""
    w13, w2 = _weights(shape, torch.bfloat16)
    x, weights, ids = _routing(shape, 4, seed=5)
    x = x.to(torch.bfloat16)
    config = fm._DEFAULT_DECODE._replace(num_stages1=stages, num_stages2=stages)
    graph, out = _captured(lambda: fm.fused_moe(x, w13, w2, weights, ids, config))
    for seed in (6, 7):
        x2, weights2, ids2 = _routing(shape, 4, seed=seed)
        if seed == 7:
            _drop_to_other_rank(ids2, w13.shape[0])
        _copy_into((x, weights, ids), (x2, weights2, ids2))
        graph.replay()
        _assert_close(out, fused_moe_ref(x, w13, w2, weights, ids))
        if seed == 7:
            assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 64, 4096, 16384])
@pytest.mark.parametrize("block_m", [16, 128])
def test_alignment_kernels_equal_the_torch_reference(
    shape: str, num_tokens: int, block_m: int
) -> None:
    """The three-launch alignment (`tandem_kernels/moe_align.py`) gives the torch reference's
    sorted ids, expert ids and padded length exactly, at the real shapes' routing, with some
    ids naming another rank's experts."""
    from tandem_kernels import moe_align

    num_experts = SHAPES[shape][0]
    _, _, ids = _routing(shape, num_tokens, seed=num_tokens + block_m)
    ids = ids.to(torch.int32)
    _drop_to_other_rank(ids, num_experts)
    got = moe_align.moe_align_block_size(ids, block_m, num_experts)
    want = moe_align.moe_align_block_size_ref(ids, block_m, num_experts)
    for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_post"), got, want, strict=True):
        assert torch.equal(g, w.to(torch.int32)), name


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_fp8_expert_weights_match_the_dequantized_reference(shape: str, num_tokens: int) -> None:
    """FP8 (e4m3) experts with a scale per expert and row (`Fp8MoEMethod`'s layout), bf16
    activations, at the real shapes: a few grouped configs of both SiLU forms, through
    pointers and through TMA, the decode path at one token, each against the reference on
    the dequantized weights; with FP8 activations too (W8A8) and the tuned call, within
    FP8's error of it. The tuner times W8A8 twins and never offers the bf16-only torch
    grouped-GEMM path for FP8 weights."""
    from tandem_kernels.fp8 import quantize_expert_rows

    w13, w2 = _weights(shape, torch.bfloat16)
    q13, s13 = quantize_expert_rows(w13)
    q2, s2 = quantize_expert_rows(w2)
    x, weights, ids = _routing(shape, num_tokens, seed=50 + num_tokens)
    x = x.to(torch.bfloat16)
    ref = fused_moe_ref(x, q13, q2, weights, ids, s13, s2)
    assert fm.b_tma_usable(q13, q2)
    base = fm.MoEConfig(64, 128, 64, 8, 8, 3)
    configs = [
        base,
        base._replace(b_tma=True),
        fm.MoEConfig(128, 64, 64, 8, 4, 4, True),
        fm.MoEConfig(128, 64, 64, 8, 4, 4, True, b_tma=True),
        fm.MoEConfig(16, 64, 128, 1, 4, 3, True, down=fm.GemmTiles(128, 64, 8, 4, 3)),
    ]
    if num_tokens == 1:
        configs += list(fm._DECODE_CANDIDATES[:3])
    for config in configs:
        out = fm.fused_moe(x, q13, q2, weights, ids, config, w13_scale=s13, w2_scale=s2)
        _assert_close(out, ref)
    # W8A8 (`fp8_act`): x and act in e4m3 per token too, within FP8's error of the reference.
    for config in (base._replace(fp8_act=True), configs[3]._replace(fp8_act=True)):
        out = fm.fused_moe(x, q13, q2, weights, ids, config, w13_scale=s13, w2_scale=s2)
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 0.06, (fm.config_name(config), rel)
    tuned = fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    rel = ((tuned.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 0.06, rel
    key = fm._shape_key(q13, ids.shape[1])
    entries = [e for e in fm.tuning_log if e["key"] == [*key[:4], str(key[4])]]
    assert entries and all(fm._GROUPED_MM_NAME not in e["ms"] for e in entries)
    grouped = [e for e in entries if not e["timed_in_graph"]]
    assert all(any(n.endswith("+a8") for n in e["ms"]) for e in grouped)


@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_block_fp8_expert_weights_match_the_dequantized_reference(num_tokens: int) -> None:
    """Block-scaled FP8 experts (`weight_block_size` [128, 128], Qwen3-30B-A3B-FP8's
    checkpoint layout) at the Qwen3-30B-A3B shape, bf16 activations: grouped configs of both
    SiLU forms, through pointers and through TMA, GEMM 2's own tiles, BLOCK_K 32 (four K
    steps a tile column), the decode path's candidates lowered for the blocks at one token,
    each against the reference on the dequantized weights; with FP8 activations too (W8A8:
    x and act per token and 128 columns, e4m3 dots) in both SiLU forms, and the tuned call,
    within FP8's error of it. The tuner times only configs that fit the blocks, under the
    block's own key, W8A8 twins on the grouped buckets, no torch grouped-GEMM path."""
    from tandem_kernels.fp8 import quantize_expert_blocks

    shape, block = "qwen3-30b-a3b", (128, 128)
    w13, w2 = _weights(shape, torch.bfloat16)
    q13, s13 = quantize_expert_blocks(w13, block)
    q2, s2 = quantize_expert_blocks(w2, block)
    assert s13.shape == (128, 2 * 768 // 128, 2048 // 128)
    assert s2.shape == (128, 2048 // 128, 768 // 128)
    x, weights, ids = _routing(shape, num_tokens, seed=70 + num_tokens)
    x = x.to(torch.bfloat16)
    ref = fused_moe_ref(x, q13, q2, weights, ids, s13, s2, block)
    scales = {"w13_scale": s13, "w2_scale": s2, "weight_block_size": block}
    assert fm.b_tma_usable(q13, q2)
    base = fm.MoEConfig(64, 128, 64, 8, 8, 3)
    configs: list[fm.FusedMoEConfig] = [
        base,
        base._replace(b_tma=True),
        fm.MoEConfig(128, 128, 32, 8, 4, 4),
        fm.MoEConfig(128, 64, 64, 8, 4, 4, True),
        fm.MoEConfig(128, 64, 64, 8, 4, 4, True, b_tma=True),
        fm.MoEConfig(16, 64, 128, 1, 4, 3, True, down=fm.GemmTiles(128, 64, 8, 4, 3)),
    ]
    if num_tokens == 1:
        configs += [fm.for_block_size(c, block[1]) for c in fm._DECODE_CANDIDATES[:4]]
    for config in configs:
        assert fm.fits_block(config, block), config
        out = fm.fused_moe(x, q13, q2, weights, ids, config, **scales)
        _assert_close(out, ref)
    # W8A8 (`fp8_act`): within FP8's error of the reference, and not the weight-only result.
    weight_only = fm.fused_moe(x, q13, q2, weights, ids, base, **scales).float()
    for config in (configs[0], configs[2], configs[4], configs[5]):
        a8 = config._replace(fp8_act=True)
        assert fm.fits_block(a8, block), a8
        out = fm.fused_moe(x, q13, q2, weights, ids, a8, **scales).float()
        rel = ((out - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 0.06, (fm.config_name(a8), rel)
        assert not torch.allclose(out, weight_only), fm.config_name(a8)
    tuned = fm.fused_moe(x, q13, q2, weights, ids, **scales)
    rel = ((tuned.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 0.06, rel
    key = fm._log_key(fm._shape_key(q13, ids.shape[1], block))
    entries = [e for e in fm.tuning_log if e["key"] == key]
    assert entries, "the first call of a shape tunes its token buckets"
    for entry in entries:
        names = [*entry["ms"], entry["best"]]
        assert all(fm.fits_block(fm.config_from_name(n), block) for n in names), names
    grouped = [e for e in entries if not e["timed_in_graph"]]
    assert all(any(n.endswith("+a8") for n in e["ms"]) for e in grouped)


def test_tiny_layers_take_the_default_rule_untuned() -> None:
    """Expert weights under _MIN_TUNE_BYTES (test-sized models) are not timed: the call runs
    the default rule and leaves no tuning entry; a real layer's shape is tuned (above)."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    w13 = torch.randn(8, 96, 64, device=DEV, generator=gen) * 64**-0.5
    w2 = torch.randn(8, 64, 48, device=DEV, generator=gen) * 48**-0.5
    assert (w13.numel() + w2.numel()) * 4 < fm._MIN_TUNE_BYTES
    x = torch.randn(8, 64, device=DEV, generator=gen)
    weights, ids = select_experts(torch.randn(8, 8, device=DEV, generator=gen), 2, True)
    before = len(fm.tuning_log)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    assert len(fm.tuning_log) == before
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [64, 4096])
def test_every_grouped_candidate_matches_reference_bf16(shape: str, num_tokens: int) -> None:
    """Each of `_CANDIDATES` (both SiLU forms), and each of `_DOWN_CANDIDATES` as GEMM 2's
    tiles under a config of each form at block_m 64 and 128, and every candidate with the
    weights through TMA (`b_tma`), against the reference, on all-local ids and on ids with
    experts another rank holds (those pairs add nothing; the last token gets zeros)."""
    w13, w2 = _weights(shape, torch.bfloat16)
    x, weights, ids = _routing(shape, num_tokens, seed=20 + num_tokens)
    x = x.to(torch.bfloat16)
    ep_ids = ids.clone()
    _drop_to_other_rank(ep_ids, w13.shape[0])
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    ep_ref = fused_moe_ref(x, w13, w2, weights, ep_ids)
    forms = {c.silu_in_epilogue for c in fm._CANDIDATES}
    assert forms == {False, True}
    bases = (fm.MoEConfig(64, 128, 64, 8, 8, 3), fm.MoEConfig(128, 64, 64, 8, 4, 4, True))
    with_down = tuple(b._replace(down=d) for b in bases for d in fm._DOWN_CANDIDATES)
    assert fm.b_tma_usable(w13, w2)
    with_tma = tuple(c._replace(b_tma=True) for c in fm._CANDIDATES + with_down)
    for config in fm._CANDIDATES + with_down + with_tma:
        out = fm.fused_moe(x, w13, w2, weights, ids, config)
        assert out.dtype == torch.bfloat16
        _assert_close(out, ref)
        out = fm.fused_moe(x, w13, w2, weights, ep_ids, config)
        _assert_close(out, ep_ref)
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), fm.config_name(config)


def test_tuner_times_both_silu_forms_and_may_keep_the_epilogue_one() -> None:
    """A grouped bucket times the unfused and the SiLU-epilogue candidates side by side, then
    GEMM 2's tiles on the fastest of each form, and keeps the fastest of all; given only
    epilogue candidates, it keeps one, and a call with no config runs it (no separate SiLU
    pass). Qwen3-30B-A3B's weights under top_k 6 and 5: keys no other test tunes."""
    w13, w2 = _weights("qwen3-30b-a3b", torch.bfloat16)
    num_experts = w13.shape[0]
    tuned = fm.tune_fused_moe(w13, w2, 6, max_tokens=4096)
    key = fm._shape_key(w13, 6)
    (entry,) = [
        e for e in fm.tuning_log if e["key"] == [*key[:4], str(key[4])] and e["num_tokens"] == 4096
    ]
    timed = set(entry["ms"])
    for config in fm._CANDIDATES:  # 192 rows an expert: no tile is too tall to be timed
        assert fm.config_name(config) in timed, fm.config_name(config)
    with_down = [fm.config_from_name(n) for n in timed if "/down:" in n]
    assert {c.silu_in_epilogue for c in with_down} == {False, True}
    with_tma = [fm.config_from_name(n) for n in timed if n.endswith("+tma")]
    assert sorted(c.silu_in_epilogue for c in with_tma) == [False, True]
    assert entry["best"] == min(entry["ms"], key=entry["ms"].get)
    assert entry["best"] == fm.config_name(tuned[4096])

    epilogue_only = fm.tune_fused_moe(
        w13,
        w2,
        5,
        4096,
        candidates=fm._SILU_EPILOGUE_CANDIDATES,
        decode_candidates=(),
        grouped_mm=False,
    )
    assert epilogue_only[4096].silu_in_epilogue
    gen = torch.Generator(device=DEV).manual_seed(21)
    x = torch.randn(3000, w13.shape[2], device=DEV, generator=gen).to(torch.bfloat16)
    logits = torch.randn(3000, num_experts, device=DEV, generator=gen)
    weights, ids = select_experts(logits, 5, True)
    with unittest.mock.patch.object(fm, "silu_and_mul", side_effect=AssertionError):
        out = fm.fused_moe(x, w13, w2, weights, ids)
    _assert_close(out, fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.parametrize("silu_in_epilogue", [False, True])
def test_zero_fill_is_skipped_only_when_every_expert_is_local(silu_in_epilogue: bool) -> None:
    """With every buffer handed out full of NaN: `all_experts_local=True` on local ids
    matches the reference (every down row written); ids >= E by default match theirs (the
    fill taken); ids >= E under the keyword give NaN in exactly the tokens with such a pair
    (the fill skipped)."""
    shape = "qwen3-30b-a3b"
    w13, w2 = _weights(shape, torch.bfloat16)
    x, weights, ids = _routing(shape, 600, seed=30)
    x = x.to(torch.bfloat16)
    ep_ids = ids.clone()
    _drop_to_other_rank(ep_ids, w13.shape[0])
    config = fm.MoEConfig(64, 64, 64, 8, 4, 4, silu_in_epilogue)
    with nan_filled_empty():
        local = fm.fused_moe(x, w13, w2, weights, ids, config, all_experts_local=True)
        ep = fm.fused_moe(x, w13, w2, weights, ep_ids, config)
        broken = fm.fused_moe(x, w13, w2, weights, ep_ids, config, all_experts_local=True)
    _assert_close(local, fused_moe_ref(x, w13, w2, weights, ids))
    _assert_close(ep, fused_moe_ref(x, w13, w2, weights, ep_ids))
    has_absent = (ep_ids >= w13.shape[0]).any(dim=1)
    assert torch.equal(broken.isnan().any(dim=1), has_absent)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [64, 600, 4096])
def test_grouped_mm_path_matches_reference_bf16(shape: str, num_tokens: int) -> None:
    """The torch grouped-GEMM path (torch._grouped_mm) with every buffer handed out full of
    NaN: local ids, ids of another rank's experts (their rows zeroed), and the same result
    replayed from a CUDA graph on new routing."""
    w13, w2 = _weights(shape, torch.bfloat16)
    assert fm.grouped_mm_supported(w13, w2)
    x, weights, ids = _routing(shape, num_tokens, seed=40 + num_tokens)
    x = x.to(torch.bfloat16)
    ep_ids = ids.clone()
    _drop_to_other_rank(ep_ids, w13.shape[0])
    config = fm.GroupedMMConfig()
    with nan_filled_empty():
        local = fm.fused_moe(x, w13, w2, weights, ids, config, all_experts_local=True)
        ep = fm.fused_moe(x, w13, w2, weights, ep_ids, config)
    _assert_close(local, fused_moe_ref(x, w13, w2, weights, ids))
    _assert_close(ep, fused_moe_ref(x, w13, w2, weights, ep_ids))
    graph, out = _captured(lambda: fm.fused_moe(x, w13, w2, weights, ep_ids, config))
    x2, weights2, ids2 = _routing(shape, num_tokens, seed=41 + num_tokens)
    _drop_to_other_rank(ids2, w13.shape[0])
    _copy_into((x, weights, ep_ids), (x2, weights2, ids2))
    graph.replay()
    _assert_close(out, fused_moe_ref(x, w13, w2, weights, ep_ids))


def test_tuner_times_the_grouped_mm_path_past_the_decode_buckets() -> None:
    """Buckets the decode path is timed for leave the grouped-GEMM path out; larger ones time
    it beside the Triton configs (its name in the log), whichever wins."""
    w13, w2 = _weights("qwen3-30b-a3b", torch.bfloat16)
    fm.tune_fused_moe(w13, w2, 8, max_tokens=1024)
    key = [128, 2 * 768, 2048, 8, str(torch.bfloat16)]
    entries = {e["num_tokens"]: e for e in fm.tuning_log if e["key"] == key}
    assert entries, "the shape was tuned"
    for bucket, entry in entries.items():
        assert ("grouped-mm" in entry["ms"]) == (not entry["timed_in_graph"]), bucket
    assert "grouped-mm" in entries[1024]["ms"]
