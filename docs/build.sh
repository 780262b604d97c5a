#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml) into build/site/, strictly: any warning (a broken
# link, anchor or API reference) fails it. Extra arguments go to `mkdocs build` (-d DIR: elsewhere).
# Needs the docs tools (pip install -e .[docs], or the .venv of .ci/env.sh), not torch or the build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
  python=.venv/bin/python
fi
exec "$python" -m mkdocs build --strict -f mkdocs.yml "$@"
