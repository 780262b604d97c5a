#!/usr/bin/env bash
# The main job of the README: sets up .venv (see .ci/env.sh), then runs the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/env.sh
python -m benchmarks.bench "$@"
