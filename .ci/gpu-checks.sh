#!/usr/bin/env bash
# The GPU checks, for a machine with a GPU and a CUDA build of torch (e.g. the lent device's image,
# which has no network): build with CUDA, run the whole test suite, then the GPU benchmarks.
# The test log and the results go to benchmarks/results/, named by GPU and date.
#   bash .ci/gpu-checks.sh [tests|bench|all] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${2:-benchmarks/results}
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'"
# Headers a bare toolkit may lack (cusparse.h, ...) come with torch's nvidia packages.
include=$(python3 -c "import sysconfig, torch; print(sysconfig.get_paths()['purelib'] + \
'/nvidia/cu' + torch.version.cuda.split('.')[0] + '/include')")
if [ -d "$include" ]; then
  export CPATH="$include${CPATH:+:$CPATH}"
fi
if ! python3 -c "import fused_ema, sys; sys.exit(not fused_ema.build_info()['cuda_kernel'])"; then
  FUSED_EMA_FORCE_CUDA=1 python3 -m pip install -q --no-build-isolation --no-deps -e .
fi
tag=$(python3 -c "import datetime, re, torch; print(re.sub('[^a-z0-9]+', '-', \
torch.cuda.get_device_name().lower()).strip('-') + '_' + datetime.date.today().isoformat())")
mkdir -p "$out"
if [ "$what" != bench ]; then
  { python3 -m fused_ema; python3 -m pytest tests -q -p no:cacheprovider; } 2>&1 \
    | tee "$out/tests_${tag}.log"
fi
if [ "$what" != tests ]; then
  python3 -m benchmarks.bench --devices cuda --full --out "$out"
  python3 -m benchmarks.scaling --device cuda --out "$out"
  python3 -m benchmarks.training_loop --device cuda --out "$out"
fi
