#!/usr/bin/env bash
# Wave 3, seventh session's H200 runs, each part one device call (from the repository root,
# carrying .whl):
#
#   PART=o:  the dense-attention probe (benchmarks/dense_attention_probe.py: which dense causal
#            kernels torch offers and their rates), then the offline table (128/128, 512/256,
#            1000/1000, batch 1) in bf16 and FP8 + FP8 KV, then FP8 + FP8 KV at 512/256 with the
#            cascade prefill off (the unexplained FP8 drop's A/B);
#   PART=bis: the FP8 drop against 7e225f4 (2026-12-03, FP8 weights 14,983 at 512/256), its tree
#            carried as .old: the step breakdown (FP8 + FP8 KV, 1,024 x 512) and the offline
#            512/256 with FP8 weights, each at HEAD and at .old on one machine; then the
#            1000/1000 figures PART=o ran out of time for (bf16, FP8 + FP8 KV);
#   PART=v:  after the decode kernel's register fix (attend_tile's MASK_BELOW): the attention GPU
#            tests (V_TESTS), the offline table in FP8 + FP8 KV, bf16 at 1000/1000 (carries .whl
#            and .whl2);
#   PART=f:  the FP8 decode kernel in fp16 (widen_kv's paired e4m3 -> fp16 conversion): its
#            GPU tests, then FP8 + FP8 KV offline at 512/256 (decode tuning's GB/s in the log);
#   PART=n:  left for the next device session: the FP8 decode tests (the fp16 read against the
#            fp32 reference, every candidate with the register caps), then FP8 + FP8 KV offline
#            at all three workloads and batch 1 (the capped candidates' first timing: decode
#            tuning's GB/s in the log), then PART=sp;
#   PART=sp: speculation at batch 1 and 32 (p = 0.7 and 0, k = 4), forced record, and the verify
#            step's device cost (scripts/gpu_session6.sh PART=sp).
#
#   OUT=/some/dir PART=o bash scripts/gpu_session7.sh
set -u
case "${PART:-o}" in
o)
  ISSUE=session7 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  env_report
  step "dense attention probe" 130 "$OUT/dense_probe.log" $PY -m benchmarks.dense_attention_probe \
    --out "$OUT/dense_probe.json"
  offline bf16 125
  # shellcheck disable=SC2086
  offline fp8_fp8kv 125 --quantization fp8 --kv-cache-dtype fp8
  TANDEM_PREFILL_CASCADE=0 WORKLOADS=512/256 offline fp8_fp8kv_paged 70 \
    --quantization fp8 --kv-cache-dtype fp8
  WORKLOADS=512/256 offline fp8_weights 70 --quantization fp8
  finish
  ;;
bis)
  ISSUE=session7 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  for tree in head old; do
    dir=.
    [ $tree = old ] && dir=.old
    # shellcheck disable=SC2086
    (cd $dir && step "step breakdown fp8+fp8kv ($tree)" 100 "$OUT/breakdown_$tree.log" \
      env PYTHONPATH=. $PY -m benchmarks.step_breakdown --model random:llama-3.1-8b \
      --device cuda --quantization fp8 --kv-cache-dtype fp8 --num-prompts 1024 \
      --out "$OUT/breakdown_$tree.json")
  done
  for tree in head old; do
    dir=.
    [ $tree = old ] && dir=.old
    (cd $dir && step "offline 512/256 fp8 weights ($tree)" 70 "$OUT/offline_fp8w_$tree.log" \
      env PYTHONPATH=. $PY -m benchmarks.offline_throughput --model random:llama-3.1-8b \
      --device cuda --skip-peer --workloads 512/256 --quantization fp8 \
      --out "$OUT/offline_fp8w_$tree.json")
    grep -E "tok/s|TPOT" "$OUT/offline_fp8w_$tree.log" | tail -n 3 >>"$summary"
  done
  WORKLOADS=1000/1000 offline bf16_1000 90
  # shellcheck disable=SC2086
  WORKLOADS=1000/1000 offline fp8_fp8kv_1000 90 --quantization fp8 --kv-cache-dtype fp8
  finish
  ;;
v)
  ISSUE=session7 BUDGET_S=${BUDGET_S:-560}
  . scripts/device_lib.sh
  ls .whl2/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-deps --upgrade --target /tmp/site \
    .whl2/*.whl >>"$LOGS/pip.log" 2>&1
  # shellcheck disable=SC2086
  step "attention GPU tests" 170 "$OUT/gpu_tests_attention.log" $PY -m pytest -q -m gpu -x \
    --timeout=160 ${V_TESTS:-tests/gpu/test_kernels_gpu.py tests/gpu/test_cascade_attention_gpu.py \
    tests/gpu/test_sliding_window_gpu.py tests/gpu/test_attention_backends_gpu.py}
  # shellcheck disable=SC2086
  offline fp8_fp8kv 210 --quantization fp8 --kv-cache-dtype fp8
  WORKLOADS=1000/1000 offline bf16_1000 150
  finish
  ;;
f)
  ISSUE=session7 BUDGET_S=${BUDGET_S:-180}
  . scripts/device_lib.sh
  step "fp8 decode GPU tests" 60 "$OUT/gpu_tests_fp8_decode.log" $PY -m pytest -q -m gpu \
    --timeout=55 "tests/gpu/test_fp8_gpu.py::test_attention_over_fp8_cache_at_real_sizes" \
    tests/gpu/test_kernels_gpu.py -k "fp8_cache or decode"
  # shellcheck disable=SC2086
  WORKLOADS=512/256 offline fp8_fp8kv_512 110 --quantization fp8 --kv-cache-dtype fp8
  finish
  ;;
n)
  ISSUE=session7 BUDGET_S=${BUDGET_S:-300}
  . scripts/device_lib.sh
  step "fp8 decode GPU tests" 90 "$OUT/gpu_tests_fp8_decode.log" $PY -m pytest -q -m gpu \
    --timeout=85 tests/gpu/test_fp8_gpu.py -k "decode or fp8_cache" \
    "tests/gpu/test_kernels_gpu.py::test_decode_every_tuning_candidate_and_the_tuned_config"
  # shellcheck disable=SC2086
  offline fp8_fp8kv 210 --quantization fp8 --kv-cache-dtype fp8
  finish
  ;;
sp)
  PART=sp bash scripts/gpu_session6.sh
  ;;
esac
