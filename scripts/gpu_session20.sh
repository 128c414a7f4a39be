#!/usr/bin/env bash
# Wave 3, twentieth session's device plan, each part one device call from the repository
# root, carrying .whl (see scripts/device_lib.sh), results under $OUT:
#
#   PART=fuse: issue 28's batch 1 (FP8 weights, FP8 KV cache, --enable-pdl) three ways in one
#            call, after the GPU tests of what changed (the kernel files, the PDL chain, the
#            W8A16 tuner, FP8 decode; ~200 s):
#              alone     the W8A16 tuner timing its candidates back to back
#                        (TANDEM_W8A16_TIMING=alone) and both fusions off: session 16's 2.84 ms
#              chain     the tuner timing each candidate after a short kernel, as a step runs
#                        it (the default with PDL), fusions off
#              fused     chain, and two launches fewer a decoder layer: the split decode
#                        partitions merged by the last program of each (request, KV head)
#                        (TANDEM_DECODE_MERGE=last) and the rotary embedding with the K/V
#                        write in one kernel (TANDEM_ROTARY_KV=fused), both off by default
#                        until this A/B
#
#   PART=table: issue 28's table: FP8 weights + FP8 KV cache + PDL at 128/128, 512/256,
#            1000/1000 and batch 1, with both fusions on (FUSED=0: off).
#
#   PART=served: issue 30's served table at the defaults (the attention issue's load, fresh
#            prompts per rate, 5 / 15 / 25 req/s and all at once) in bf16, then in FP8 (weights
#            and KV cache, no PDL): issue 28's served comparison in the same call; both fusions
#            on (FUSED=0: off).
#
# Written in session 20, whose device was withdrawn before its first call: none of it has run.
#
#   OUT=/some/dir PART=fuse bash scripts/gpu_session20.sh
set -u
ISSUE=session20
FP8="--quantization fp8 --kv-cache-dtype fp8 --enable-pdl"
fused() {  # fused CMD...: CMD with both fusions on (their switches; FUSED=0: as is)
  (
    [ "${FUSED:-1}" = 1 ] && export TANDEM_DECODE_MERGE=last TANDEM_ROTARY_KV=fused
    "$@"
  )
}
case "${PART:-fuse}" in
fuse)
  BUDGET_S=${BUDGET_S:-580}
  . scripts/device_lib.sh
  env_report
  step "GPU tests" 200 "$OUT/gpu_tests_fuse.log" $PY -m pytest -q -m gpu --timeout=200 -rs \
    --tb=short --durations=8 tests/gpu/test_kernels_gpu.py tests/gpu/test_pdl_gpu.py \
    tests/gpu/test_fp8_w8a16_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_cascade_attention_gpu.py
  grep -E "passed|failed" "$OUT/gpu_tests_fuse.log" | tail -n 1 | sed "s/^/tests: /" >>"$summary"
  export WORKLOADS=none
  # shellcheck disable=SC2086  # the flags one a word
  TANDEM_W8A16_TIMING=alone offline fp8_b1_alone 120 $FP8
  # shellcheck disable=SC2086
  offline fp8_b1_chain 120 $FP8
  # shellcheck disable=SC2086
  fused offline fp8_b1_chain_fused 120 $FP8
  finish
  ;;
table)
  BUDGET_S=${BUDGET_S:-580}
  . scripts/device_lib.sh
  # shellcheck disable=SC2086
  fused offline fp8_table 560 $FP8
  finish
  ;;
served)
  mkdir -p "$OUT/bf16" "$OUT/fp8"
  OUT="$OUT/bf16" RUNS=unified OFFLINE=none RATES=5,15,25,inf BUDGET_S=285 \
    fused bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| unified|answered|total"
  OUT="$OUT/fp8" RUNS=unified OFFLINE=none RATES=5,15,25,inf BUDGET_S=285 \
    ENGINE_EXTRA="--quantization fp8 --kv-cache-dtype fp8" \
    fused bash scripts/gpu_issue14.sh 2>&1 | grep -E "^\| unified|answered|total"
  rm -f "$OUT"/*/issue14.png
  ;;
*)
  echo "unknown PART=${PART}" >&2
  exit 2
  ;;
esac
