"""The CUDA device code compiles with plain nvcc for sm_80 and sm_90. It includes no torch header,
so this runs wherever nvcc exists, GPU or not (the full CUDA build needs a CUDA torch)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import fused_ema

ROOT = Path(__file__).resolve().parents[1]


def find_nvcc():
    for candidate in (
        os.environ.get("NVCC"),
        shutil.which("nvcc"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
    ):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


NVCC = find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_kernels_compile(arch, tmp_path):
    out = tmp_path / f"kernels_sm{arch}.o"
    cmd = [
        NVCC,
        "-std=c++17",
        "-O3",
        f"-I{ROOT / 'csrc'}",
        "-gencode",
        f"arch=compute_{arch},code=sm_{arch}",
        "-Xptxas",
        "-warn-spills",
        "-Werror",
        "all-warnings",
        "-c",
        str(ROOT / "tests" / "cuda" / "compile_check.cu"),
        "-o",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0
    # Every dtype pair's kernel is in the object (cuobjdump lists the compiled functions).
    cuobjdump = Path(NVCC).with_name("cuobjdump")
    if cuobjdump.exists():
        listing = subprocess.run(
            [str(cuobjdump), "-lelf", "-symbols", str(out)], capture_output=True, text=True
        ).stdout
        # Every dtype pair's kernel, and lerp_stochastic_'s for the 16-bit EMAs.
        assert listing.count("multi_tensor_kernel") >= len(fused_ema.SUPPORTED_DTYPE_PAIRS) + 4


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("source", ["lerp_cuda.cu", "schedule_cuda.cu"])
def test_cuda_torch_glue_compiles(source, tmp_path):
    """The files that join the kernels to torch compile against the installed torch headers. A
    CPU wheel lacks one generated CUDA header (c10/cuda/impl/cuda_cmake_macros.h); it is stood in
    for here, so the check runs on CPU-only machines too."""
    import torch
    from torch.utils.cpp_extension import include_paths

    stub = tmp_path / "stub"
    macros = stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    cmd = [
        NVCC,
        "-std=c++20" if version >= (2, 12) else "-std=c++17",
        "-O1",
        f"-I{ROOT / 'csrc'}",
        *(f"-I{p}" for p in include_paths()),
        f"-I{stub}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr",
        "-gencode",
        "arch=compute_90,code=sm_90",
        "-Xcompiler",
        "-fPIC",
        "-c",
        str(ROOT / "csrc" / "cuda" / source),
        "-o",
        str(tmp_path / "glue.o"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
