#!/usr/bin/env bash
# The test command of the README: sets up the venv (.venv; see .ci/env.sh), then runs pytest on
# tests/ in one worker process a CPU (pytest-xdist; FUSED_EMA_TEST_WORKERS=N sets the number, 0
# runs in this process). Extra arguments go to pytest (e.g. bash tests/run.sh -k errors).
# FUSED_EMA_LEG=NAME runs one leg of the CI matrix instead (.ci/legs.sh; bash .ci/run: them all).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/env.sh
pytest_started=$SECONDS
status=0
# worksteal: the tests take from 1 ms to a minute; an idle worker takes over queued ones.
python -m pytest tests -q -n "${FUSED_EMA_TEST_WORKERS:-$(nproc)}" --dist worksteal "$@" \
  || status=$?
printf '[fused_ema tests%s] pytest exited %d after %ds (setup %ds, build %ds)\n' \
  "${FUSED_EMA_LEG:+ $FUSED_EMA_LEG}" "$status" "$((SECONDS - pytest_started))" \
  "$FUSED_EMA_SETUP_S" "$FUSED_EMA_BUILD_S"
exit "$status"
