#!/usr/bin/env bash
# The Hopper dense prefill kernel's device calls (tandem_kernels/dense_attention_hopper.py;
# from the repository root, carrying .whl), each part one call:
#
#   PART=t:  its compile table on the device's own Triton (kernel_registers --dense), the
#            dense-attention probe (TFLOP/s beside cuDNN and our first kernel at 8 x 1,024 /
#            16 x 512 / 2 x 4,096 / 1 x 32,768; each entry checked against our first kernel),
#            its GPU tests (every start-up config against SDPA, TMA and pointer loads, one
#            compile across token counts, the start-up timing listing it), then the cascade GPU
#            tests with it as the dense part;
#   PART=e:  the engine A/B, bf16 offline at 512/256: the cascade forced with our first dense
#            kernel, then with the Hopper one at its untimed default config
#            (TANDEM_PREFILL_CASCADE=1 TANDEM_PREFILL_DENSE=...), then the start-up timing's own
#            pick (its prefill-path log lists every path's and Hopper config's milliseconds).
#
#   OUT=/some/dir PART=t bash scripts/gpu_dense8.sh
set -u
case "${PART:-t}" in
t)
  ISSUE=dense8 BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  env_report
  step "kernel_registers --dense" 45 "$OUT/kernel_registers_dense.log" \
    $PY -m benchmarks.kernel_registers --dense --out "$OUT/kernel_registers_dense.json"
  step "dense attention probe" 200 "$OUT/dense_probe.log" $PY -m benchmarks.dense_attention_probe \
    --out "$OUT/dense_attention_probe.json"
  step "hopper dense GPU tests" 180 "$OUT/gpu_tests_dense_hopper.log" $PY -m pytest -q -m gpu \
    --timeout=170 -rs -s tests/gpu/test_dense_hopper_gpu.py
  step "cascade GPU tests, hopper dense part" 110 "$OUT/gpu_tests_cascade_hopper.log" \
    $PY -m pytest -q -m gpu --timeout=100 tests/gpu/test_cascade_attention_gpu.py -k triton_hopper
  finish
  ;;
e)
  ISSUE=dense8e BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  export WORKLOADS=512/256
  TANDEM_PREFILL_CASCADE=1 TANDEM_PREFILL_DENSE=triton offline bf16_dense_triton 150
  TANDEM_PREFILL_CASCADE=1 TANDEM_PREFILL_DENSE=triton_hopper offline bf16_dense_hopper 150
  offline bf16_timed 150
  finish
  ;;
esac
