"""How multi_tensor_apply packs tensors into launches, checked on the host with nvcc and no GPU
(tests/cuda/packing_check.cu): both metadata layouts fit their parameter limits, every tensor
lands in one launch and every element in exactly one block, heads and tails included."""

import subprocess

import pytest
from test_cuda_compile import NVCC, ROOT

SMALL_PARAM_BYTES = 4096
LARGE_PARAM_BYTES = 32764


@pytest.fixture(scope="module")
def packing_check(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    exe = tmp_path_factory.mktemp("packing") / "packing_check"
    cmd = [
        NVCC,
        "-std=c++17",
        "-O2",
        f"-I{ROOT / 'csrc'}",
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-Werror",
        "all-warnings",
        str(ROOT / "tests" / "cuda" / "packing_check.cu"),
        "-o",
        str(exe),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    return run


def test_launch_metadata_fits_the_parameter_limits(packing_check):
    sizes = dict(line.split() for line in packing_check.stdout.splitlines() if " " in line)
    op = int(sizes["op"])
    assert int(sizes["small_meta"]) + op <= SMALL_PARAM_BYTES, sizes
    assert int(sizes["large_meta"]) + op <= LARGE_PARAM_BYTES, sizes


def test_every_element_is_updated_by_exactly_one_block(packing_check):
    assert packing_check.returncode == 0, packing_check.stderr[-4000:]
    assert packing_check.stdout.splitlines()[-1] == "ok"
