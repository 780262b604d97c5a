# Sourced by .ci/env.sh and .ci/run: the CI matrix, one (Python, torch) pair a leg, each leg in a
# venv of its own (.venv for the first, the default; .venv-NAME for the others) with its torch
# pinned exactly. FUSED_EMA_LEG=NAME selects one for env.sh.
#   py311-torch2.13  the default: torch 2.13.0, the CPU wheel
#   py312-torch2.11  the GPU machine's pair; the registry's torch is a CUDA build (built CPU-only)
#   py313-torch2.15  the newest torch the registry serves, a CUDA build too (built CPU-only)
# shellcheck shell=bash

# name, Python (major.minor), torch (exact), 1 where fused_ema is built CPU-only though the torch
# is a CUDA build (with nvcc found, setup.py would compile the CUDA kernel too: many minutes).
FUSED_EMA_LEG_TABLE="
py311-torch2.13 3.11 2.13.0 0
py312-torch2.11 3.12 2.11.0 1
py313-torch2.15 3.13 2.15.0 1"
read -r -a FUSED_EMA_LEGS <<<"$(awk 'NF { printf "%s ", $1 }' <<<"$FUSED_EMA_LEG_TABLE")"

# fused_ema_leg NAME: sets FUSED_EMA_LEG_PYTHON, FUSED_EMA_LEG_TORCH, FUSED_EMA_LEG_FORCE_CPU and
# FUSED_EMA_LEG_VENV (its name under the repository root); returns 1 for an unknown leg.
# shellcheck disable=SC2034
fused_ema_leg() {
  local name
  read -r name FUSED_EMA_LEG_PYTHON FUSED_EMA_LEG_TORCH FUSED_EMA_LEG_FORCE_CPU \
    <<<"$(awk -v leg="$1" '$1 == leg' <<<"$FUSED_EMA_LEG_TABLE")"
  [ -n "$name" ] || return 1
  FUSED_EMA_LEG_VENV=.venv-$name
  if [ "$name" = "${FUSED_EMA_LEGS[0]}" ]; then
    FUSED_EMA_LEG_VENV=.venv
  fi
}

# fused_ema_find_python 3.12: prints an interpreter of that version: python3.12 if it runs, else
# the newest pyenv-installed 3.12.x; returns 1 if there is none.
fused_ema_find_python() {
  local version=$1 found
  if found=$("python$version" -c 'import sys; print(sys.executable)' 2>/dev/null); then
    echo "$found"
    return 0
  fi
  if command -v pyenv >/dev/null 2>&1; then
    found=$(pyenv versions --bare 2>/dev/null | grep -E "^${version//./\\.}\.[0-9]+$" | sort -V \
      | tail -n 1)
    if [ -n "$found" ] && PYENV_VERSION=$found pyenv which "python$version" 2>/dev/null; then
      return 0
    fi
  fi
  return 1
}
