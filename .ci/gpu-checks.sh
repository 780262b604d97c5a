#!/usr/bin/env bash
# The GPU run plan, for a machine with a GPU, a CUDA build of torch and no network (the lent H100/
# H200: Python 3.12, torch 2.11+cu130, nvcc 13): one call of at most 9 minutes. Phases run in
# order within BUDGET seconds in all (default 510); a failing phase is logged and the next one
# still runs, a phase gets what is left of the budget and those past it are skipped; every log and
# result goes to OUT_DIR.
#   bash .ci/gpu-checks.sh OUT_DIR [PHASE...]
# Phases: build, cuda-tests, profile, bench, sanitize (compute-sanitizer, ncu): the default, in
# this order; tests (the whole suite) only when named.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu-checks.sh OUT_DIR [phases...]}
shift
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(build cuda-tests profile bench sanitize)
deadline=$(($(date +%s) + ${BUDGET:-510}))
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

note() { printf '%s\n' "$*" | tee -a "$summary"; }

if ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  note "no GPU visible to $py: nothing to do"
  exit 1
fi
# Headers a bare toolkit may lack (cusparse.h, ...) come with torch's nvidia packages.
include=$("$py" -c "import sysconfig, torch; print(sysconfig.get_paths()['purelib'] + \
'/nvidia/cu' + torch.version.cuda.split('.')[0] + '/include')")
if [ -d "$include" ]; then
  export CPATH="$include${CPATH:+:$CPATH}"
fi
nvcc_dir=$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")
export CUDA_HOME=${CUDA_HOME:-$(dirname "$nvcc_dir")} PATH="$nvcc_dir:$PATH"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

built() { "$py" -c "import fused_ema, sys; sys.exit(not fused_ema.build_info()['cuda_kernel'])" \
  2>/dev/null; }

phase_build() {
  # TORCH_CUDA_ARCH_LIST unset: setup.py builds for the visible GPUs only.
  # setup.py picks a compiler whose libstdc++ matches the one loaded at run time (the image's
  # Python names its own newer GCC) and says so in its "fused_ema:" lines.
  FUSED_EMA_FORCE_CUDA=1 "$py" -m pip install -v --no-build-isolation --no-deps -e . \
    >"$out/pip-build.log" 2>&1 || { tail -n 40 "$out/pip-build.log"; return 1; }
  grep -o "fused_ema: .*" "$out/pip-build.log"
  "$py" -m fused_ema | tee "$out/build_info.json"
  built
}

pytest_flags="-q -p no:cacheprovider -rfE"
if "$py" -c "import pytest_timeout" 2>/dev/null; then
  pytest_flags+=" --timeout 300"
fi

# Test processes of their own (pytest-xdist, where installed): a crash fails one test, not the run.
workers() {
  if "$py" -c "import xdist" 2>/dev/null; then
    echo "-n $(($(nproc) > $1 ? $1 : $(nproc))) --dist loadfile"
  fi
}

phase_cuda_tests() {
  # Every test that names CUDA (the test_cuda_* files and the cuda cases of the others).
  "$py" -m pytest tests $pytest_flags $(workers 8) -k "cuda or gpu" --junitxml="$out/tests_cuda.xml"
}

phase_tests() {
  "$py" -m pytest tests $pytest_flags $(workers 8) --junitxml="$out/tests_all.xml"
}

phase_sanitize() {
  local status=0 tool
  # A small workload (every dtype pair, both layouts, ragged misaligned lists, device weights,
  # stochastic rounding, lerp_many_, bema_, the schedule op), each checked against the CPU kernel.
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
      "$py" .ci/gpu_workload.py --small || status=1
  done
  # Theoretical and achieved occupancy of the lerp kernels, on tensors that fill the GPU.
  if command -v ncu >/dev/null; then
    ncu --clock-control none --kernel-name regex:"multi_t(ensor|rack)_kernel" --launch-count 16 \
      --section Occupancy --section SpeedOfLight --section LaunchStats --csv --page details \
      "$py" .ci/gpu_workload.py --large >"$out/ncu.csv" || status=1
    "$py" .ci/ncu_summary.py "$out/ncu.csv" || status=1
  else
    echo "ncu not found: occupancy not measured"
  fi
  return $status
}

phase_bench() {
  local status=0
  "$py" -m benchmarks.bench --devices cuda --full --out "$out" || status=1
  "$py" -m benchmarks.scaling --device cuda --out "$out" || status=1
  "$py" -m benchmarks.training_loop --device cuda --out "$out" || status=1
  # lerp_many_ / PostHocEma and bema_ / Bema on the GPU (ema-pytorch and TRL are not on the lent
  # machine: their columns say n/a; the foreach baseline and K lerp_ calls are timed).
  "$py" -m benchmarks.posthoc --device cuda --out "$out" || status=1
  "$py" -m benchmarks.bema --device cuda --out "$out" || status=1
  return $status
}

phase_profile() {
  "$py" -m benchmarks.profile_update --device cuda --out "$out"
}

export -f phase_build phase_cuda_tests phase_tests phase_sanitize phase_bench phase_profile built \
  workers
export py out pytest_flags
for phase in "${phases[@]}"; do
  if [ "$phase" != build ] && ! built; then
    note "fused_ema has no CUDA kernel here: building first"
    phase_build >"$out/build.log" 2>&1
  fi
  started=$(date +%s)
  left=$((deadline - started))
  if [ "$left" -lt 10 ]; then
    note "$(printf '%-10s %-7s %5ss' "$phase" SKIPPED 0) (the budget is spent)"
    continue
  fi
  echo "=== $phase"
  limit=${PHASE_TIMEOUT:-540}
  timeout "$((left < limit ? left : limit))" bash -c "phase_${phase//-/_}" >"$out/$phase.log" 2>&1
  status=$?
  tail -n 25 "$out/$phase.log"
  verdict=$([ $status -eq 0 ] && echo ok || { [ $status -eq 124 ] && echo TIMEOUT || echo FAILED; })
  note "$(printf '%-10s %-7s %5ss' "$phase" "$verdict" "$(($(date +%s) - started))")"
done
echo "=== summary ($out)"
cat "$summary"
