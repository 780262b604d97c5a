#!/usr/bin/env bash
# The real CUDA build without a GPU: a venv of its own with a CUDA build of torch (about 5.5 GB
# with its nvidia-* packages), fused_ema compiled for TORCH_CUDA_ARCH_LIST with the local nvcc,
# then the test suite against that build (the GPU tests skip). Not part of .ci/run: too large.
#   bash .ci/cuda-build.sh [pytest args]
# Override: FUSED_EMA_CUDA_VENV (default .venv-cuda), FUSED_EMA_CUDA_TORCH (torch==2.14.1, a CUDA
# 13.0 build), CUDA_HOME (the toolkit whose nvcc matches torch's CUDA), TORCH_CUDA_ARCH_LIST
# (8.0;9.0), MAX_JOBS (2), FUSED_EMA_CUDA_LOG (where the log goes).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${FUSED_EMA_CUDA_VENV:-$root/.venv-cuda}
torch_req=${FUSED_EMA_CUDA_TORCH:-torch==2.14.1}
log=${FUSED_EMA_CUDA_LOG:-$venv/cuda-build.log}
started=$(date +%s)
say() { printf '[cuda-build %4ss] %s\n' "$(($(date +%s) - started))" "$*"; }

mkdir -p "$(dirname "$log")"
exec > >(tee "$log") 2>&1
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"

if ! "$py" -c "import torch, sys; sys.exit(torch.version.cuda is None)" >/dev/null 2>&1; then
  say "installing $torch_req (a CUDA build of torch with its nvidia-* packages)"
  "$py" -m pip install -q "$torch_req"
fi
if ! "$py" -c "import ninja, pytest, hypothesis, numpy, matplotlib, tqdm, safetensors" \
  >/dev/null 2>&1; then
  say "installing build and test tools, and safetensors (fused_ema is installed with --no-deps)"
  "$py" -m pip install -q "setuptools>=64" wheel ninja pytest hypothesis numpy matplotlib tqdm \
    safetensors
fi
if ! "$py" -c "import ema_pytorch, torch_ema" >/dev/null 2>&1; then
  "$py" -m pip install -q --no-deps ema-pytorch torch-ema \
    || say "could not install ema-pytorch/torch-ema: those comparisons will be skipped"
fi
torch_cuda=$("$py" -c "import torch; print(torch.version.cuda)")
say "torch $("$py" -c "import torch; print(torch.__version__)") (CUDA $torch_cuda)"

# A toolkit whose nvcc has torch's CUDA major version (/usr/local/bin/nvcc may be a wrapper).
nvcc_release() { "$1/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p'; }
if [ -z "${CUDA_HOME:-}" ]; then
  for candidate in /usr/local/cuda /usr/local/cuda-"${torch_cuda%%.*}"* /opt/cuda; do
    if [ "$(nvcc_release "$candidate" | cut -d. -f1)" = "${torch_cuda%%.*}" ]; then
      CUDA_HOME=$candidate
      break
    fi
  done
fi
if [ -z "${CUDA_HOME:-}" ] || [ -z "$(nvcc_release "$CUDA_HOME")" ]; then
  say "no CUDA ${torch_cuda%%.*} toolkit with nvcc found: set CUDA_HOME"
  exit 1
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
say "nvcc $(nvcc_release "$CUDA_HOME") in $CUDA_HOME"

# torch's CUDA headers include library headers (cusparse.h, ...) that a bare toolkit may lack;
# torch's nvidia-* packages ship them.
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
include="$site/nvidia/cu${torch_cuda%%.*}/include"
if [ -d "$include" ]; then
  export CPATH="$include${CPATH:+:$CPATH}"
fi

# Built from a copy in the venv, so that its build/ never mixes with the CPU build's; files
# newer than their copy are refreshed, so ninja recompiles only what changed.
src="$venv/src"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' file; do if [ -e "$file" ]; then printf '%s\0' "$file"; fi; done \
  | xargs -0 cp -a -u --parents -t "$src"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0} MAX_JOBS=${MAX_JOBS:-2}
say "building for archs $TORCH_CUDA_ARCH_LIST with $MAX_JOBS jobs"
build_started=$(date +%s)
FUSED_EMA_FORCE_CUDA=1 "$py" -m pip install -q --no-build-isolation --no-deps --force-reinstall "$src"
build_s=$(($(date +%s) - build_started))
say "built in ${build_s}s"

# The installed package, not the source tree: the cwd stays off sys.path and the repository
# (benchmarks/, for the tests) comes after site-packages.
echo "$root" >"$site/fused_ema_repo.pth"
export PYTHONSAFEPATH=1
info=$(cd /tmp && "$py" -m fused_ema)
echo "$info"
(cd /tmp && "$py" - <<'EOF'
import fused_ema, sys
info = fused_ema.build_info()
sys.exit(None if info["cuda_kernel"] else "fused_ema was built without its CUDA kernel")
EOF
)
say "python -m fused_ema: cuda_kernel true, archs $(cd /tmp && "$py" -c \
  "import fused_ema; print(','.join(fused_ema.build_info()['cuda_archs']))")"

set +e
"$py" -m pytest tests -q -p no:cacheprovider "$@"
status=$?
set -e
say "build ${build_s}s; tests exited $status; log: $log"
exit $status
