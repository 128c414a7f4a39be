# Shared by the device scripts (scripts/gpu_issue*.sh): source it after setting PY, OUT, LOGS,
# BUDGET_S, START and summary. It puts the services' Python packages on the path (a bare
# machine gets them from .whl/ into /tmp/site) and defines `step`.

# What the services import beyond torch/numpy (the frontend: uvicorn + starlette, and their
# anyio/h11/click). All of .whl/ is installed (--upgrade: a /tmp/site left by an earlier run
# with fewer wheels is completed).
NEED_IMPORTS="import grpc, google.protobuf, grpc_health, grpc_reflection, prometheus_client, \
uvicorn, starlette, anyio, h11, click"
if ! $PY -c "$NEED_IMPORTS" 2>/dev/null; then
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  if ! $PY -c "$NEED_IMPORTS" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps --upgrade --target /tmp/site .whl/*.whl \
      >"$LOGS/pip.log" 2>&1 || echo "pip install of .whl/ into /tmp/site failed (pip.log)" \
      | tee -a "$summary"
  fi
  $PY -c "$NEED_IMPORTS" 2>>"$LOGS/pip.log" \
    || echo "still missing after .whl/: see pip.log; serving steps will fail" | tee -a "$summary"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME LIMIT_S LOG CMD...   (the limit is cut to what is left of the budget)
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped (budget spent)" | tee -a "$summary"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0))s of $limit) -> $(basename "$log")" | tee -a "$summary"
  tail -n 15 "$log"
}
