# Sourced by tests/run.sh, benchmarks/run.sh and .ci/run: makes .venv (once) with torch, the test
# and benchmark dependencies and fused_ema built in place, then activates it. Rebuilds only when
# csrc/, setup.py or pyproject.toml changed. Override: FUSED_EMA_VENV (where), PYTHON (which
# interpreter), FUSED_EMA_TORCH (the torch requirement, default torch==2.13.0: a CPU build here).
set -euo pipefail
FUSED_EMA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FUSED_EMA_VENV=${FUSED_EMA_VENV:-$FUSED_EMA_ROOT/.venv}

fused_ema_log() { printf '[fused_ema setup] %s\n' "$*" >&2; }

if [ ! -x "$FUSED_EMA_VENV/bin/python" ]; then
  fused_ema_log "creating $FUSED_EMA_VENV"
  "${PYTHON:-python3}" -m venv "$FUSED_EMA_VENV"
fi
# shellcheck disable=SC1091
source "$FUSED_EMA_VENV/bin/activate"

if ! python -c "import torch" >/dev/null 2>&1; then
  fused_ema_log "installing ${FUSED_EMA_TORCH:-torch==2.13.0}"
  python -m pip install -q "${FUSED_EMA_TORCH:-torch==2.13.0}"
fi

# Tools and libraries that never pull in another torch (the EMA peers are pure Python and are
# installed without their dependencies, so pip never resolves or replaces torch).
fused_ema_requirements="setuptools>=64 wheel ninja pytest hypothesis numpy matplotlib tqdm"
if ! python -c "import ninja, pytest, hypothesis, numpy, matplotlib, tqdm" >/dev/null 2>&1; then
  fused_ema_log "installing build, test and benchmark tools"
  # shellcheck disable=SC2086
  python -m pip install -q $fused_ema_requirements
fi
if ! python -c "import ema_pytorch, torch_ema" >/dev/null 2>&1; then
  fused_ema_log "installing the EMA libraries compared against (ema-pytorch, torch-ema)"
  python -m pip install -q --no-deps ema-pytorch torch-ema \
    || fused_ema_log "could not install ema-pytorch/torch-ema: those comparisons will be skipped"
fi
# timm is compared through one file, timm/utils/model_ema.py, loaded on its own (benchmarks/peers.py):
# importing the timm package would import torchvision, which has no CPU build for every torch.
fused_ema_timm=1.0.31
if [ "$(python -c 'import importlib.metadata as m; print(m.version("timm"))' 2>/dev/null)" \
    != "$fused_ema_timm" ]; then
  fused_ema_log "installing timm==$fused_ema_timm without its dependencies (ModelEmaV3 is compared)"
  python -m pip install -q --no-deps "timm==$fused_ema_timm" \
    || fused_ema_log "could not install timm==$fused_ema_timm: the timm comparisons will be skipped"
fi
# The framework integrations are tested with the real frameworks (diffusers: the migration tests).
# They go in without their dependencies, which would pull another torch, then their pure-Python
# dependencies with pip's usual resolution (none of those needs torch, so torch stays as it is).
fused_ema_frameworks="lightning==2.6.6 pytorch-lightning==2.6.6 lightning-utilities==0.15.3
  torchmetrics==1.9.0 transformers==5.23.0 accelerate==1.15.0 diffusers==0.42.1"
fused_ema_framework_deps="huggingface-hub>=1.32.0,<3.0 tokenizers>=0.23.1,<0.24.0
  regex>=2025.10.22 safetensors>=0.8.0 typer pyyaml psutil requests importlib-metadata"
if ! python -c "
import importlib.metadata as m, sys
want = dict(r.split('==') for r in sys.argv[1:])
assert all(m.version(name) == version for name, version in want.items())
import huggingface_hub, tokenizers, safetensors, regex, typer, yaml, psutil, requests
" $fused_ema_frameworks >/dev/null 2>&1; then
  fused_ema_log "installing lightning, transformers, accelerate and diffusers (torch left as it is)"
  # shellcheck disable=SC2086
  { python -m pip install -q --no-deps $fused_ema_frameworks \
      && python -m pip install -q $fused_ema_framework_deps; } \
    || fused_ema_log "could not install lightning/transformers/accelerate/diffusers:" \
      "those tests will be skipped"
fi

fused_ema_stamp() {
  (cd "$FUSED_EMA_ROOT" && find csrc setup.py pyproject.toml -type f -print0 | sort -z \
    | xargs -0 sha256sum; python -c "import torch; print(torch.__version__)") | sha256sum | cut -c1-16
}
fused_ema_stamp_file="$FUSED_EMA_VENV/.fused_ema_build"
if [ "$(cat "$fused_ema_stamp_file" 2>/dev/null)" != "$(fused_ema_stamp)" ] \
    || ! (cd /tmp && python -c "import fused_ema") >/dev/null 2>&1; then
  fused_ema_log "building fused_ema (pip install --no-build-isolation -e .)"
  python -m pip install -q --no-build-isolation --no-deps -e "$FUSED_EMA_ROOT"
  fused_ema_stamp >"$fused_ema_stamp_file"
fi
fused_ema_log "ready: $(cd /tmp && python -m fused_ema --short)"
