"""Which dense causal attention kernels this torch build offers for the cascade's dense part,
and how fast each runs (GPU, bf16, the 8B shape: 32 query heads, 8 KV heads, d 128).

For each shape (requests x tokens, no cached context) it checks each candidate against our
Triton dense kernel (output and LSE) and times it (`do_bench` median), printing causal TFLOP/s:
- `sdpa:<backend>`: `scaled_dot_product_attention` on `[R, H, S, D]` under one backend
  (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION), `enable_gqa=True`; no LSE;
- `cudnn_varlen[:rep]`: `aten._cudnn_attention_forward` with `cum_seq_q`/`cum_seq_k` on the
  packed `[T, H, D]` rows (`:rep`: K/V repeated to H heads first, timed without the repeat);
- `flash_varlen`: `aten._flash_attention_forward`, varlen (the cascade's "flash" candidate);
- `triton[:BMxBNxWxS]`: our dense kernel, default and tuned;
- `hopper[:BMxBNxWxS[rN]]`: our Hopper dense kernel (`dense_attention_hopper`, sm_90 only), its
  untimed default and every start-up config (`HOPPER_CONFIGS`), on K/V as `forward` gets them
  (views of one qkv tensor, read through TMA);
- `tandem_cudnn`: the cascade's "cudnn" dense part (`dense_causal_attention(impl="cudnn")`:
  cuDNN attention over `[R, H, L, D]` views of one qkv tensor, output and LSE copied back).

    timeout 200 python -m benchmarks.dense_attention_probe --out dense_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from tandem_kernels import dense_attention_hopper as dh
from tandem_kernels.cascade_attention import dense_causal_attention

H, HKV, D = 32, 8, 128
SHAPES = [(8, 1024), (16, 512), (2, 4096), (1, 32768)]
TRITON_CONFIGS = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]


def _flops(num_reqs: int, n: int) -> float:
    return 4 * num_reqs * n * (n + 1) / 2 * H * D


def _lse_rows(lse: torch.Tensor, num_reqs: int, n: int) -> torch.Tensor:
    """Any of the layouts seen ([H, T], [T, H], [R, H, S], [T, H, 1]) -> [H, T]."""
    t = num_reqs * n
    if lse.dim() == 3 and lse.shape[-1] == 1:
        lse = lse[..., 0]
    if lse.dim() == 3:  # [R, H, S]
        return lse.permute(1, 0, 2).reshape(H, t)
    if lse.shape == (t, H):
        return lse.t()
    return lse


def probe_shape(num_reqs: int, n: int) -> dict[str, float | str]:
    """Every candidate at `num_reqs` x `n` tokens: causal TFLOP/s, or the error it raised."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    torch.manual_seed(0)
    t = num_reqs * n
    q = torch.randn(t, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(t, HKV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, n, device=dev, dtype=torch.int32)
    scale = 1.0 / math.sqrt(D)
    ref_out, ref_lse = dense_causal_attention(q, k, v, cu, scale, max_query_len=n, impl="triton")
    flops = _flops(num_reqs, n)
    rates: dict[str, float | str] = {}

    def run(name: str, call: Callable[[], Any], check: Callable[[Any], None]) -> None:
        try:
            check(call())
            ms = triton.testing.do_bench(call, warmup=20, rep=100, return_mode="median")
            rates[name] = round(flops / ms / 1e9, 1)
        except Exception as exc:
            rates[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"  {name}: {rates[name]}", flush=True)

    def check_out(out: Any) -> None:
        torch.testing.assert_close(out.reshape(ref_out.shape), ref_out, atol=2e-2, rtol=2e-2)

    def check_pair(res: Any) -> None:
        check_out(res[0])
        got = _lse_rows(res[1], num_reqs, n).float()
        torch.testing.assert_close(got, ref_lse, atol=2e-2, rtol=2e-2)

    qd = q.view(num_reqs, n, H, D).transpose(1, 2)
    kd = k.view(num_reqs, n, HKV, D).transpose(1, 2)
    vd = v.view(num_reqs, n, HKV, D).transpose(1, 2)

    def sdpa(backend: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                o = torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True
                )
            return o.transpose(1, 2)

        return call

    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        run(f"sdpa:{backend}", sdpa(backend), check_out)

    def cudnn(kk: torch.Tensor, vv: torch.Tensor) -> Callable[[], Any]:
        return lambda: torch.ops.aten._cudnn_attention_forward(
            q, kk, vv, None, cu, cu, n, n, True, 0.0, True, False, scale=scale
        )[:2]

    rep = H // HKV
    run("cudnn_varlen", cudnn(k, v), check_pair)
    run(
        "cudnn_varlen:rep",
        cudnn(k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)),
        check_pair,
    )
    run(
        "flash_varlen",
        lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale
        )[:2],
        check_pair,
    )

    def ours(*config: int) -> Callable[[], Any]:
        knobs = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), config, strict=False))
        return lambda: dense_causal_attention(
            q, k, v, cu, scale, max_query_len=n, impl="triton", **knobs
        )

    run("triton", ours(), check_pair)
    for config in TRITON_CONFIGS:
        run("triton:" + "x".join(map(str, config)), ours(*config), check_pair)

    if torch.cuda.get_device_capability(dev)[0] == 9:
        # K/V as the engine's `forward` gets them: strided views of one qkv projection.
        qkv = torch.cat([q, k, v], dim=1)
        hq, hk, hv = qkv[:, :H], qkv[:, H : H + HKV], qkv[:, H + HKV :]

        def hopper(config: dh.HopperConfig) -> Callable[[], Any]:
            return lambda: dh.dense_hopper_attention(hq, hk, hv, cu, scale, config=config)

        run("hopper", hopper(dh.default_hopper_config(n, D)), check_pair)
        for config in dh.HOPPER_CONFIGS:
            run("hopper:" + dh.hopper_config_name(config), hopper(config), check_pair)
    # The cascade's "cudnn" dense part as the engine calls it: views of one qkv tensor in,
    # the output and LSE copied to this module's layouts.
    qkv = torch.cat([q, k, v], dim=1)
    vq, vk, vv = qkv[:, :H], qkv[:, H : H + HKV], qkv[:, H + HKV :]
    run(
        "tandem_cudnn",
        lambda: dense_causal_attention(vq, vk, vv, cu, scale, max_query_len=n, impl="cudnn"),
        check_pair,
    )
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="dense_attention_probe.json")
    ns = ap.parse_args()
    result: dict[str, Any] = {"torch": torch.__version__, "shapes": []}
    with contextlib.suppress(Exception):
        result["cudnn"] = torch.backends.cudnn.version()
    for num_reqs, n in SHAPES:
        print(f"{num_reqs} x {n}:", flush=True)
        rates = probe_shape(num_reqs, n)
        result["shapes"].append({"num_reqs": num_reqs, "tokens": n, "tflops": rates})
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
