#!/usr/bin/env bash
# The test command of the README: sets up .venv (see .ci/env.sh), then runs pytest on tests/.
# Extra arguments go to pytest (e.g. bash tests/run.sh -k errors).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/env.sh
python -m pytest tests -q "$@"
