#!/usr/bin/env bash
# Wave 3, eighteenth session's device plan, each part one device call from the repository
# root, carrying .whl (see scripts/device_lib.sh), results under $OUT:
#
#   PART=moe: the fused MoE kernel with the expert weights through TMA descriptors
#            (`MoEConfig.b_tma`, timed by the tuner on the fastest config of each SiLU form):
#            its GPU tests, then the kernel table for both shapes with each call's device time
#            by kernel (`--breakdown`: where issue 32's 4,096 tokens spend it), then the Hopper
#            dense kernel at head sizes 64 and 256 (`HOPPER_HEAD_SIZES` widened to them) and
#            Gemma 3 4B's engine tests (head size 256) on it.
#
#   PART=align: the alignment in three Triton launches (`tandem_kernels/moe_align.py`,
#            replacing an argsort and ~15 small torch kernels: ~100 us of PART=moe's 967 at
#            Qwen3-30B-A3B 4,096 tokens on an H100): its GPU tests and the MoE file's other
#            tests that run the grouped path (and the grouped-GEMM path, whose routed weights
#            now ride in the SiLU pass), the kernel table with its breakdown again, then
#            Qwen3-30B-A3B offline at 1000/1000 (512 requests; session 13: 6,321 out tok/s).
#
#   PART=align2: the alignment with about one program an SM (PART=align's one-program offsets
#            kernel took 35 us at 4,096 tokens): its GPU tests, Qwen3-30B-A3B's kernel table.
#
#   PART=fp8moe (not run in session 18: its device budget was spent): FP8 MoE experts
#            (`--quantization fp8` now reaches them: weight-only e4m3 with a scale per expert
#            and row, and W8A8 twins the tuner times) and PART=align2's alignment: the MoE GPU
#            tests for both, the FP8 MoE models against their bf16 selves, the kernel table
#            with FP8 experts, then Qwen3-30B-A3B offline in bf16 and FP8 (batch 1, 1000/1000
#            at 512 requests).
#
#   OUT=/some/dir PART=moe bash scripts/gpu_session18.sh
set -u
ISSUE=session18

MOE_FILE=tests/gpu/test_fused_moe_gpu.py
ALL_TOKENS=(--tokens 1 64 512 4096 16384)
case "${PART:-moe}" in
moe)
  BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  moe_tests gpu_tests_moe.log "grouped_candidate or tuner_times" $MOE_FILE
  moe_table moe_kernel "${ALL_TOKENS[@]}"
  step "hopper heads + gemma" 150 "$OUT/gpu_tests_heads.log" $PY -m pytest -q -m gpu \
    --timeout=140 -rs --tb=short tests/gpu/test_dense_hopper_gpu.py \
    tests/gpu/test_sliding_window_gpu.py tests/gpu/test_hybrid_kv_gpu.py -k "head_sizes or 4b"
  grep -E "passed|failed" "$OUT/gpu_tests_heads.log" | tail -n 1 | sed "s/^/heads: /" >>"$summary"
  finish
  ;;
align)
  BUDGET_S=${BUDGET_S:-500}
  . scripts/device_lib.sh
  moe_tests gpu_tests_align.log \
    "alignment or grouped_candidate or tuner_times or graph or expert_parallel or grouped_mm" \
    $MOE_FILE
  moe_table moe_kernel "${ALL_TOKENS[@]}"
  offline_qwen3 bf16
  finish
  ;;
align2)
  BUDGET_S=${BUDGET_S:-180}
  . scripts/device_lib.sh
  moe_tests gpu_tests_align2.log alignment $MOE_FILE
  moe_table moe_kernel --shapes qwen3-30b-a3b --tokens 64 512 4096 16384
  finish
  ;;
fp8moe)
  BUDGET_S=${BUDGET_S:-580}
  . scripts/device_lib.sh
  moe_tests gpu_tests_fp8moe.log "alignment or fp8" $MOE_FILE tests/gpu/test_gpu_models.py
  moe_table moe_kernel_fp8 --weights fp8 "${ALL_TOKENS[@]}"
  offline_qwen3 bf16
  offline_qwen3 fp8 --quantization fp8
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
