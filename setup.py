"""Builds fused_ema._C against the torch that is already installed.

    pip install --no-build-isolation .        # or -e . ; never lets pip fetch another torch

The CPU kernel is always built; the CUDA kernel when torch is a CUDA build and nvcc is found.
FUSED_EMA_FORCE_CPU=1 skips CUDA; FUSED_EMA_FORCE_CUDA=1 insists on it and builds for
TORCH_CUDA_ARCH_LIST, else for the visible GPUs, else for 8.0;9.0.
"""

import os
import platform
import sys
from pathlib import Path

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import (
        CUDA_HOME,
        BuildExtension,
        CppExtension,
        CUDAExtension,
        include_paths,
    )
except ImportError:
    sys.exit(
        "fused_ema builds against an installed torch >= 2.11. Install torch first, then run "
        "`pip install --no-build-isolation .` (build isolation would download another torch)."
    )

DEFAULT_CUDA_ARCHS = "8.0;9.0"
CPU_SOURCES = [
    "csrc/fused_ema.cpp",
    "csrc/lerp_op.cpp",
    "csrc/lerp_plan.cpp",
    "csrc/python_fast_path.cpp",
    "csrc/python_walk.cpp",
    "csrc/python_walk_check.cpp",
    "csrc/python_walk_cache.cpp",
    "csrc/schedule.cpp",
    "csrc/stochastic_round_testing.cpp",
    "csrc/cpu/cpu_isa.cpp",
    "csrc/cpu/lerp_cpu.cpp",
    "csrc/cpu/lerp_span_default.cpp",
]
CUDA_SOURCES = ["csrc/cuda/lerp_cuda.cu", "csrc/cuda/schedule_cuda.cu"]
CXX_FLAGS = ["-O3"]  # torch's BuildExtension adds the -std its headers need
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# The static libraries below are compiled by setuptools, not BuildExtension: name the standard.
LIBRARY_STD = "-std=c++20" if TORCH_VERSION >= (2, 12) else "-std=c++17"
# ATen's vector headers warn under GCC 12 with AVX flags (CUDA unroll pragmas, intrinsics' own
# uninitialised placeholders); the warnings are theirs, not fused_ema's.
QUIET_TORCH_HEADERS = ["-Wno-unknown-pragmas", "-Wno-maybe-uninitialized"]

# Span kernels per x86 instruction set. Each needs its own -m flags, which one extension cannot
# give single files, so each becomes a static library linked into _C; the CPU is checked at run
# time (csrc/cpu/cpu_isa.cpp), so the wheel stays portable (no -march=native). The extension's
# objects come first at link time, so where an inline function exists in several objects the
# linker keeps the baseline copy.
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def choose_variant() -> tuple[str, str]:
    force_cpu = env_flag("FUSED_EMA_FORCE_CPU")
    force_cuda = env_flag("FUSED_EMA_FORCE_CUDA")
    if force_cpu and force_cuda:
        sys.exit("fused_ema: set FUSED_EMA_FORCE_CPU or FUSED_EMA_FORCE_CUDA, not both")
    if force_cpu:
        return "cpu", "FUSED_EMA_FORCE_CPU=1"
    cuda_torch = torch.version.cuda is not None
    nvcc = CUDA_HOME is not None and Path(CUDA_HOME, "bin", "nvcc").exists()
    if force_cuda:
        if not cuda_torch:
            sys.exit(f"fused_ema: FUSED_EMA_FORCE_CUDA=1 but torch {torch.__version__} is CPU-only")
        if not nvcc:
            sys.exit("fused_ema: FUSED_EMA_FORCE_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return "cuda", "FUSED_EMA_FORCE_CUDA=1"
    if cuda_torch and nvcc:
        return "cuda", f"torch {torch.__version__} is a CUDA build and nvcc is in {CUDA_HOME}"
    why = "torch is a CPU-only build" if not cuda_torch else "nvcc was not found"
    return "cpu", f"{why}; CPU kernel only"


def cuda_arch_list() -> str:
    """The archs to build for; torch's build helpers read TORCH_CUDA_ARCH_LIST."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not archs:
        if torch.cuda.is_available():
            caps = {torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())}
            archs = ";".join(f"{major}.{minor}" for major, minor in sorted(caps))
        else:
            archs = DEFAULT_CUDA_ARCHS
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return archs


def isa_libraries() -> list:
    """build_clib entries for the x86 span kernels; elsewhere they compile to empty tables."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [
        (
            f"fused_ema_span_{isa}",
            {
                "sources": [f"csrc/cpu/lerp_span_{isa}.cpp"],
                "include_dirs": include_paths(),
                "cflags": [*CXX_FLAGS, LIBRARY_STD, "-fPIC", abi, *flags, *QUIET_TORCH_HEADERS],
            },
        )
        for isa, flags in ISA_FLAGS.items()
    ]


def openmp_flags() -> list:
    """at::parallel_for is inline OpenMP code in torch's OpenMP builds: without -fopenmp it would
    silently run on one thread. The libgomp torch ships is already loaded, so it is the one used."""
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        return ["-fopenmp"]
    return []


def extension(libraries: list):
    variant, reason = choose_variant()
    cxx_flags = CXX_FLAGS + openmp_flags()
    link_flags = openmp_flags()
    sources = list(CPU_SOURCES)
    if not libraries:
        sources += [f"csrc/cpu/lerp_span_{isa}.cpp" for isa in ISA_FLAGS]
    if variant == "cuda":
        archs = cuda_arch_list()
        print(f"fused_ema: building the CUDA + CPU variant for archs {archs} ({reason})")
        return CUDAExtension(
            "fused_ema._C",
            sources + CUDA_SOURCES,
            define_macros=[("FUSED_EMA_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=link_flags,
        )
    print(f"fused_ema: building the CPU variant ({reason})")
    return CppExtension(
        "fused_ema._C",
        sources,
        define_macros=[("FUSED_EMA_WITH_CUDA", "0")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


LIBRARIES = isa_libraries()
setup(
    libraries=LIBRARIES,
    ext_modules=[extension(LIBRARIES)],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
