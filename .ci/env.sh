# Sourced by tests/run.sh, benchmarks/run.sh and .ci/run: makes a venv (once) with torch, the test
# and benchmark dependencies and fused_ema built in place, then activates it. Rebuilds only when
# csrc/, setup.py or pyproject.toml changed. FUSED_EMA_LEG picks a (Python, torch) pair of the CI
# matrix (.ci/legs.sh; default py311-torch2.13 in .venv): its interpreter, exact torch, venv, and
# a CPU-only build. Override: FUSED_EMA_VENV (where), PYTHON (which interpreter), FUSED_EMA_TORCH
# (the torch requirement, default the leg's, torch==2.13.0: a CPU build here).
# shellcheck shell=bash
set -euo pipefail
FUSED_EMA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=.ci/legs.sh
source "$FUSED_EMA_ROOT/.ci/legs.sh"

fused_ema_log() { printf '[fused_ema setup%s] %s\n' "${FUSED_EMA_LEG:+ $FUSED_EMA_LEG}" "$*" >&2; }
fused_ema_fail() {
  fused_ema_log "FAILED: $*"
  exit 1
}
fused_ema_setup_started=$SECONDS
FUSED_EMA_BUILD_S=0

if ! fused_ema_leg "${FUSED_EMA_LEG:-${FUSED_EMA_LEGS[0]}}"; then
  fused_ema_fail "unknown FUSED_EMA_LEG=$FUSED_EMA_LEG (the legs: ${FUSED_EMA_LEGS[*]})"
fi
if [ -z "${PYTHON:-}" ] && ! PYTHON=$(fused_ema_find_python "$FUSED_EMA_LEG_PYTHON"); then
  # Without FUSED_EMA_LEG any Python 3.10+ will do (python3); a named leg needs its own.
  [ -z "${FUSED_EMA_LEG:-}" ] || fused_ema_fail "no Python $FUSED_EMA_LEG_PYTHON found" \
    "(python$FUSED_EMA_LEG_PYTHON, pyenv): install it or set PYTHON"
  PYTHON=python3
fi
export FUSED_EMA_VENV=${FUSED_EMA_VENV:-$FUSED_EMA_ROOT/$FUSED_EMA_LEG_VENV}
FUSED_EMA_TORCH=${FUSED_EMA_TORCH:-torch==$FUSED_EMA_LEG_TORCH}
# A registry torch is a CUDA build: with nvcc found, setup.py would build the CUDA kernel too
# (many minutes); a named leg builds the CPU kernel only unless FUSED_EMA_FORCE_CUDA is set.
if [ -n "${FUSED_EMA_LEG:-}" ] && [ "$FUSED_EMA_LEG_FORCE_CPU" = 1 ] \
    && [ -z "${FUSED_EMA_FORCE_CUDA:-}" ]; then
  export FUSED_EMA_FORCE_CPU=${FUSED_EMA_FORCE_CPU:-1}
fi

if [ ! -x "$FUSED_EMA_VENV/bin/python" ]; then
  fused_ema_log "creating $FUSED_EMA_VENV with $PYTHON"
  "$PYTHON" -m venv "$FUSED_EMA_VENV"
fi
# shellcheck disable=SC1091
source "$FUSED_EMA_VENV/bin/activate"
fused_ema_python=$(python -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
if [ -n "${FUSED_EMA_LEG:-}" ] && [ "${fused_ema_python%.*}" != "$FUSED_EMA_LEG_PYTHON" ]; then
  fused_ema_fail "$FUSED_EMA_VENV has Python $fused_ema_python, the leg needs" \
    "$FUSED_EMA_LEG_PYTHON: remove that venv or set FUSED_EMA_VENV"
fi

# torch first, exactly the version asked for (an exact pin lifts any pip constraint on torch for
# this one command: the machine's own caps it below the newest release).
fused_ema_torch_pin=$(sed -n 's/^torch==\([0-9][0-9A-Za-z.+]*\)$/\1/p' <<<"$FUSED_EMA_TORCH")
fused_ema_torch_is() {
  local have
  have=$(python -c "import torch; print(torch.__version__)" 2>/dev/null) || return 1
  [ -z "$fused_ema_torch_pin" ] || [ "$have" = "$fused_ema_torch_pin" ] \
    || { [[ $fused_ema_torch_pin != *+* ]] && [ "${have%%+*}" = "$fused_ema_torch_pin" ]; }
}
if ! fused_ema_torch_is; then
  fused_ema_log "installing $FUSED_EMA_TORCH"
  if [ -n "$fused_ema_torch_pin" ]; then
    PIP_CONSTRAINT=/dev/null python -m pip install -q "$FUSED_EMA_TORCH"
  else
    python -m pip install -q "$FUSED_EMA_TORCH"
  fi
  fused_ema_torch_is || fused_ema_fail "asked for $FUSED_EMA_TORCH, $FUSED_EMA_VENV has torch" \
    "$(python -c "import torch; print(torch.__version__)" 2>&1 | tail -n 1)"
fi
fused_ema_torch_version=$(python -c "import torch; print(torch.__version__)" 2>/dev/null)

# fused_ema_pinned NAME==VERSION...: whether each package is installed at exactly that version.
fused_ema_pinned() {
  python -c "
import importlib.metadata as m, sys
want = dict(r.split('==') for r in sys.argv[1:])
assert all(m.version(name) == version for name, version in want.items())
" "$@" >/dev/null 2>&1
}

# The rest is checked and installed (what is missing) once per venv and version of this script.
fused_ema_setup_stamp=$( (cat "$FUSED_EMA_ROOT/.ci/env.sh"; echo "$fused_ema_python"
  echo "$fused_ema_torch_version") | sha256sum | cut -c1-16)
fused_ema_setup_stamp_file="$FUSED_EMA_VENV/.fused_ema_setup"
if [ "$(cat "$fused_ema_setup_stamp_file" 2>/dev/null)" != "$fused_ema_setup_stamp" ]; then
  # safetensors: fused_ema.posthoc's snapshot files (a dependency of the package)
  fused_ema_requirements="setuptools>=64 wheel ninja safetensors pytest pytest-xdist hypothesis
    numpy matplotlib tqdm"
  if ! python -c "import ninja, safetensors, pytest, xdist, hypothesis, numpy, matplotlib, tqdm" \
      >/dev/null 2>&1; then
    fused_ema_log "installing build, test and benchmark tools"
    # shellcheck disable=SC2086
    python -m pip install -q $fused_ema_requirements
  fi
  if ! python -c "import ema_pytorch, torch_ema" >/dev/null 2>&1; then
    fused_ema_log "installing the EMA libraries compared against (ema-pytorch, torch-ema)"
    python -m pip install -q --no-deps ema-pytorch torch-ema \
      || fused_ema_log "could not install ema-pytorch/torch-ema: those comparisons will be skipped"
  fi
  # timm is compared through one file, timm/utils/model_ema.py, loaded on its own
  # (benchmarks/peers.py): importing the timm package would import torchvision, which has no CPU
  # build for every torch.
  fused_ema_timm=1.0.31
  if [ "$(python -c 'import importlib.metadata as m; print(m.version("timm"))' 2>/dev/null)" \
      != "$fused_ema_timm" ]; then
    fused_ema_log "installing timm==$fused_ema_timm without its dependencies (for ModelEmaV3)"
    python -m pip install -q --no-deps "timm==$fused_ema_timm" \
      || fused_ema_log "could not install timm==$fused_ema_timm: its comparisons will be skipped"
  fi
  # The framework integrations are tested with the real frameworks (diffusers: the migration
  # tests). They go in without their dependencies, which would pull another torch, then their
  # pure-Python dependencies with pip's usual resolution (none of those needs torch, so torch stays
  # as it is).
  fused_ema_frameworks="lightning==2.6.6 pytorch-lightning==2.6.6 lightning-utilities==0.15.3
    torchmetrics==1.9.0 transformers==5.23.0 accelerate==1.15.0 diffusers==0.42.1"
  fused_ema_framework_deps="huggingface-hub>=1.32.0,<3.0 tokenizers>=0.23.1,<0.24.0
    regex>=2025.10.22 safetensors>=0.8.0 typer pyyaml psutil requests importlib-metadata"
  # shellcheck disable=SC2086
  if ! fused_ema_pinned $fused_ema_frameworks || ! python -c "
import huggingface_hub, tokenizers, safetensors, regex, typer, yaml, psutil, requests
" >/dev/null 2>&1; then
    fused_ema_log "installing lightning, transformers, accelerate, diffusers (torch left as is)"
    # shellcheck disable=SC2086
    { python -m pip install -q --no-deps $fused_ema_frameworks \
        && python -m pip install -q $fused_ema_framework_deps; } \
      || fused_ema_log "could not install lightning/transformers/accelerate/diffusers:" \
        "those tests will be skipped"
  fi
  # DeepSpeed, for the ZeRO-3 tests (tests/test_zero3.py), on the legs whose torch it was checked
  # with (2.13): built without its C++ ops (DS_BUILD_OPS=0) in this venv (its setup.py imports
  # torch: no isolated build env, which would fetch another torch) and without its dependencies,
  # then its pure-Python ones. Elsewhere those tests skip.
  fused_ema_deepspeed="deepspeed==0.19.8"
  fused_ema_deepspeed_deps="einops hjson msgpack py-cpuinfo pydantic>=2.0.0 psutil packaging"
  # shellcheck disable=SC2086
  if [[ "$fused_ema_torch_version" == 2.13.* ]] && { ! fused_ema_pinned $fused_ema_deepspeed \
      || ! python -c "import einops, hjson, msgpack, cpuinfo, pydantic" >/dev/null 2>&1; }; then
    fused_ema_log "installing $fused_ema_deepspeed without its ops or dependencies (torch left as is)"
    # shellcheck disable=SC2086
    { DS_BUILD_OPS=0 python -m pip install -q --no-build-isolation --no-deps $fused_ema_deepspeed \
        && python -m pip install -q $fused_ema_deepspeed_deps; } \
      || fused_ema_log "could not install deepspeed: the ZeRO-3 tests will be skipped"
  fi
  # TRL's BEMACallback, the reference of fused_ema.Bema (tests/trl_reference.py and
  # benchmarks/bema.py): trl goes in without its dependencies (accelerate and transformers are
  # above; pip would resolve them again, with a torch of its own), then what importing
  # trl.trainer.callbacks needs, with pip's usual resolution: datasets, pandas, pyarrow (and
  # dill, multiprocess, xxhash; none of them needs torch).
  fused_ema_trl="trl==1.16.0"
  fused_ema_trl_deps="datasets==5.2.0 pandas>=2.1.1 pyarrow>=21.0.0"
  # shellcheck disable=SC2086
  if ! fused_ema_pinned $fused_ema_trl || ! python -c "import datasets, pandas, pyarrow" \
      >/dev/null 2>&1; then
    fused_ema_log "installing $fused_ema_trl without its dependencies, then datasets, pandas," \
      "pyarrow (torch left as is)"
    # shellcheck disable=SC2086
    { python -m pip install -q --no-deps $fused_ema_trl \
        && python -m pip install -q $fused_ema_trl_deps; } \
      || fused_ema_log "could not install trl: the comparisons with TRL's BEMACallback will" \
        "be skipped"
  fi
  # The documentation site's tools (pyproject's docs extra, the same pins): tests/test_docs.py
  # builds the site strictly, and fails in CI without them. None of them needs torch.
  fused_ema_docs_tools="mkdocs==1.6.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
    griffelib==2.4.1 pymdown-extensions==13.1.2"
  # shellcheck disable=SC2086
  if ! fused_ema_pinned $fused_ema_docs_tools; then
    fused_ema_log "installing the documentation tools (mkdocs, mkdocstrings-python)"
    # shellcheck disable=SC2086
    python -m pip install -q $fused_ema_docs_tools \
      || fused_ema_log "could not install the docs tools: tests/test_docs.py fails in CI"
  fi
  echo "$fused_ema_setup_stamp" >"$fused_ema_setup_stamp_file"
fi

# .ci/run installs the next leg's packages while a leg's tests run; its build waits for its turn.
if [ "${FUSED_EMA_SETUP_NO_BUILD:-0}" = 1 ]; then
  fused_ema_log "installed in $((SECONDS - fused_ema_setup_started))s, not built" \
    "(FUSED_EMA_SETUP_NO_BUILD=1)"
  return 0
fi

# The build stamp: the sources, the torch, the CPU/CUDA choice and the checkout it was built from
# (an editable install points at one checkout).
fused_ema_stamp() {
  (cd "$FUSED_EMA_ROOT" && find csrc setup.py pyproject.toml -type f -print0 | sort -z \
    | xargs -0 sha256sum; echo "$fused_ema_torch_version $FUSED_EMA_ROOT"
    echo "cpu=${FUSED_EMA_FORCE_CPU:-} cuda=${FUSED_EMA_FORCE_CUDA:-}") | sha256sum | cut -c1-16
}
fused_ema_stamp_file="$FUSED_EMA_VENV/.fused_ema_build"
if [ "$(cat "$fused_ema_stamp_file" 2>/dev/null)" != "$(fused_ema_stamp)" ] \
    || ! (cd /tmp && python -c "import fused_ema") >/dev/null 2>&1; then
  fused_ema_log "building fused_ema (pip install --no-build-isolation -e .)" \
    "${FUSED_EMA_FORCE_CPU:+with FUSED_EMA_FORCE_CPU=$FUSED_EMA_FORCE_CPU}"
  fused_ema_build_started=$SECONDS
  python -m pip install -q --no-build-isolation --no-deps -e "$FUSED_EMA_ROOT"
  FUSED_EMA_BUILD_S=$((SECONDS - fused_ema_build_started))
  fused_ema_stamp >"$fused_ema_stamp_file"
fi
FUSED_EMA_SETUP_S=$((SECONDS - fused_ema_setup_started))
fused_ema_log "ready in ${FUSED_EMA_SETUP_S}s (build ${FUSED_EMA_BUILD_S}s):" \
  "Python $fused_ema_python, $(cd /tmp && python -m fused_ema --short)"
