#!/usr/bin/env bash
# Wave 3, nineteenth session's device plan, each part one device call from the repository
# root, carrying .whl (see scripts/device_lib.sh), results under $OUT:
#
#   PART=verify: what session 18 built and never ran on a GPU. FP8 MoE experts (W8A16 and the
#            W8A8 twins, checkpoints as stored) and the alignment's offsets spread over about
#            one program an SM (93aa85e): the MoE GPU tests for both and the FP8 MoE models
#            against their bf16 selves; Qwen3-30B-A3B's bf16 kernel table at 4,096 and 16,384
#            tokens (the alignment's share); the kernel table with FP8 experts; Qwen3-30B-A3B
#            offline in FP8 (batch 1, 1000/1000 at 256 requests).
#
#   PART=confirm: PART=verify's test step ran out of its 220 s after 23 passed (the alignment,
#            the FP8 expert kernels, the Qwen3-MoE FP8 model): the FP8 MoE and checkpoint tests
#            left (Mixtral FP8 against bf16, the stored MoE checkpoints, the dense checkpoint
#            since its set-up moved) and the block-scaled FP8 experts' kernel test; Qwen3-30B-A3B's
#            bf16 kernel table again with the held ceilings, the dense same-rows reference and
#            the tuner's finalist rounds; its table with block-scaled FP8 experts;
#            Qwen3-30B-A3B offline in bf16 and FP8 in the same call (batch 1, 1000/1000 at 128
#            requests).
#
#   PART=block: block-scaled FP8 experts with each K step's weight tile dequantized before its
#            dot (PART=confirm's form scaled each partial dot after it: 1.59 ms at 4,096
#            tokens, slower than bf16): their kernel test and table; the MoE checkpoint tests
#            on both devices (Qwen3-MoE per channel, per tensor and in 16 x 16 blocks, Mixtral
#            per channel).
#
#   PART=w8a8block (not run in session 19: written after its device budget was spent): the W8A8
#            form of block-scaled FP8 experts (activations per token and 128 columns): the
#            block-scaled kernel tests and the group quantizers' bit-exact tests, then
#            Qwen3-30B-A3B's and Mixtral-8x7B's block-scaled kernel tables (the tuner times the
#            W8A8 twins; PART=block's weight-only form ran 1.174 ms at Qwen3's 4,096 tokens).
#
#   OUT=/some/dir PART=verify bash scripts/gpu_session19.sh
set -u
ISSUE=session19
MOE_FILE=tests/gpu/test_fused_moe_gpu.py
case "${PART:-verify}" in
verify)
  BUDGET_S=${BUDGET_S:-570}
  . scripts/device_lib.sh
  moe_tests gpu_tests_verify.log "alignment or fp8" $MOE_FILE tests/gpu/test_gpu_models.py
  moe_table moe_kernel_bf16 --shapes qwen3-30b-a3b --tokens 4096 16384
  moe_table moe_kernel_fp8 --weights fp8 --tokens 1 64 512 4096
  offline_qwen3 fp8 --quantization fp8 --max-requests 256
  finish
  ;;
confirm)
  BUDGET_S=${BUDGET_S:-585}
  . scripts/device_lib.sh
  MOE_TESTS_S=300 moe_tests gpu_tests_confirm.log "block or fp8_moe or checkpoint" -v $MOE_FILE \
    tests/gpu/test_gpu_models.py tests/gpu/test_fp8_gpu.py
  moe_table moe_kernel_bf16 --shapes qwen3-30b-a3b --tokens 4096 16384
  moe_table moe_kernel_fp8_block --weights fp8-block --shapes qwen3-30b-a3b --tokens 1 64 4096
  offline_qwen3 bf16 --max-requests 128
  offline_qwen3 fp8 --quantization fp8 --max-requests 128
  finish
  ;;
block)
  BUDGET_S=${BUDGET_S:-300}
  . scripts/device_lib.sh
  MOE_TESTS_S=170 moe_tests gpu_tests_block.log "block or checkpoint" -v $MOE_FILE \
    tests/gpu/test_gpu_models.py
  moe_table moe_kernel_fp8_block --weights fp8-block --shapes qwen3-30b-a3b --tokens 64 4096
  finish
  ;;
w8a8block)
  BUDGET_S=${BUDGET_S:-420}
  . scripts/device_lib.sh
  MOE_TESTS_S=200 moe_tests gpu_tests_w8a8block.log "block or group or dynamic_activation" -v \
    $MOE_FILE tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_fused_gpu.py
  moe_table moe_kernel_fp8_block --weights fp8-block --tokens 1 64 512 4096
  finish
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
