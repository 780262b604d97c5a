"""Builds fused_ema._C against the torch that is already installed.

    pip install --no-build-isolation .        # or -e . ; never lets pip fetch another torch

The CPU kernel is always built; the CUDA kernel when torch is a CUDA build and nvcc is found.
FUSED_EMA_FORCE_CPU=1 skips CUDA; FUSED_EMA_FORCE_CUDA=1 insists on it and builds for
TORCH_CUDA_ARCH_LIST, else for the visible GPUs, else for 8.0;9.0.
"""

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_clib import build_clib

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
    "csrc/fused_op.cpp",
    "csrc/fused_op_kernels.cpp",
    "csrc/finish_all.cpp",
    "csrc/grad_mode.cpp",
    "csrc/lerp_plan.cpp",
    "csrc/prepared_handles.cpp",
    "csrc/prepared_update.cpp",
    "csrc/python_walk.cpp",
    "csrc/python_walk_cache.cpp",
    "csrc/schedule.cpp",
    "csrc/swap_values.cpp",
    "csrc/cpu/cpu_isa.cpp",
    "csrc/cpu/fused_cpu.cpp",
    "csrc/cpu/lerp_span_default.cpp",
    "csrc/testing/testing_ops.cpp",
]
HEADERS = sorted(
    str(p.relative_to(Path(__file__).parent)) for p in (Path(__file__).parent / "csrc").rglob("*.h")
)
CUDA_SOURCES = ["csrc/cuda/fused_cuda.cu", "csrc/cuda/schedule_cuda.cu"]
CXX_FLAGS = ["-O3"]  # torch's BuildExtension adds the -std its headers need
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# The static libraries below are compiled by setuptools, not BuildExtension: name the standard.
LIBRARY_STD = "-std=c++20" if TORCH_VERSION >= (2, 12) else "-std=c++17"

# GCC 12's own AVX-512 intrinsics warn (their _mm512_undefined_* placeholders, GCC bug 105593).
QUIET_INTRINSICS = ["-Wno-maybe-uninitialized"]

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
    """build_clib entries for the x86 span kernels; elsewhere (or without binutils, see
    PrivateIsaLibraries) they compile to empty tables and the baseline kernels serve."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if not (shutil.which("nm") and shutil.which("objcopy")):
        print("fused_ema: nm/objcopy not found: building the baseline CPU kernels only")
        return []
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [
        (
            f"fused_ema_span_{isa}",
            {
                "sources": [f"csrc/cpu/lerp_span_{isa}.cpp"],
                # build_clib recompiles only what is older than these: every header of csrc/,
                # or an edited kernel header would leave a stale ISA library beside a new _C.
                "obj_deps": {"": HEADERS},
                "include_dirs": include_paths(),
                "cflags": [*CXX_FLAGS, LIBRARY_STD, "-fPIC", abi, *flags, *QUIET_INTRINSICS],
            },
        )
        for isa, flags in ISA_FLAGS.items()
    ]


class PrivateIsaLibraries(build_clib):
    """Inline and template code that an ISA library instantiates (its own, c10's, the standard
    library's) is compiled with that ISA's -m flags; left as weak global symbols, the linker may
    bind baseline code to those copies, which then runs AVX-512 instructions on a CPU without
    them. So each library keeps its weak symbols local, and drops its COMDAT groups, which would
    otherwise let the linker discard its private copies."""

    def build_libraries(self, libraries):
        super().build_libraries(libraries)
        for name, _ in libraries:
            archive = Path(self.build_clib) / self.compiler.library_filename(name)
            listing = subprocess.run(
                ["nm", "--defined-only", "-g", "-P", str(archive)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            weak = {
                fields[0]
                for fields in map(str.split, listing.splitlines())
                if len(fields) >= 2 and fields[1] in ("W", "V", "u")
            }
            names = archive.with_suffix(".private-symbols")
            names.write_text("".join(f"{symbol}\n" for symbol in sorted(weak)))
            # objcopy fails on an empty symbol list: an archive built earlier and already
            # localized (build_clib leaves an up-to-date one as it is) has no weak symbols left.
            localize = [f"--localize-symbols={names}"] if weak else []
            subprocess.run(
                ["objcopy", *localize, "--remove-section=.group", str(archive)],
                check=True,
            )


def gcc_major(compiler: str) -> int:
    try:
        out = subprocess.run([compiler, "-dumpversion"], capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip().split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def choose_compiler() -> None:
    """The system g++ (the one on PATH) where Python was built with a compiler of its own, named
    by absolute path in sysconfig's CXX. setuptools builds with that compiler and Python's link
    flags: on a CUDA image whose Python names /opt/gcc/bin/g++ (and links with
    -Bsymbolic-functions), the extension bound its own instantiations of libstdc++ templates and
    crashed formatting every error message; the system g++ matches the libstdc++ loaded at run
    time. A compiler Python names by name (distributions, conda) is the toolchain set up for it
    and stays; so does a system g++ too old for torch's headers (before GCC 10), and CXX if set."""
    if "CXX" in os.environ or not sys.platform.startswith("linux"):
        return
    configured = (sysconfig.get_config_var("CXX") or "").split()
    system_cxx, system_cc = shutil.which("g++"), shutil.which("gcc")
    if not configured or not os.path.isabs(configured[0]) or not system_cxx or not system_cc:
        return
    if os.path.realpath(configured[0]) == os.path.realpath(system_cxx):
        return
    if gcc_major(system_cxx) < 10:
        return
    print(
        f"fused_ema: compiling with the system {system_cxx}, not Python's {configured[0]} "
        "(set CXX to choose)"
    )
    os.environ.update(CC=system_cc, CXX=system_cxx, LDSHARED=f"{system_cxx} -shared")


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
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo", "-DUSE_CUDA"]},
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


choose_compiler()
LIBRARIES = isa_libraries()
setup(
    libraries=LIBRARIES,
    ext_modules=[extension(LIBRARIES)],
    cmdclass={
        "build_ext": BuildExtension.with_options(use_ninja=True),
        "build_clib": PrivateIsaLibraries,
    },
)
