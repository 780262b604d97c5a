"""The CUDA device code compiles with plain nvcc for every target it supports, with both launch
layouts where the target allows 32 KB of parameters, and ptxas's register counts leave each
kernel at least 50% theoretical occupancy on sm_80 and sm_90. It includes no torch header, so
this runs wherever nvcc exists, GPU or not (the full CUDA build needs a CUDA torch). Only the glue
files compile against torch's headers; .ci/run checks the rest on the first leg of a run alone
(FUSED_EMA_SKIP_TORCH_FREE=1 on the later ones): same nvcc, same sources, same result."""

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import fused_ema

ROOT = Path(__file__).resolve().parents[1]
KERNEL_HEADER = ROOT / "csrc" / "cuda" / "multi_tensor_apply.cuh"
PAIRS = len(fused_ema.SUPPORTED_DTYPE_PAIRS)  # each one lerp kernel per launch layout
SMALL, LARGE = "Li120E", "Li1024E"  # the capacity in a plain lerp kernel's mangled name


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
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")
torch_free = pytest.mark.skipif(
    os.environ.get("FUSED_EMA_SKIP_TORCH_FREE") == "1",
    reason="includes no torch header: checked on this CI run's first leg",
)
CHECKED_ARCHS = ("60", "70", "75", "80", "90")


def nvcc_targets():
    if NVCC is None:
        return set()
    listing = subprocess.run([NVCC, "--list-gpu-code"], capture_output=True, text=True).stdout
    return {code[3:] for code in listing.split() if code.startswith("sm_")}


def require_target(arch):
    if arch not in nvcc_targets():
        pytest.skip(f"this nvcc cannot target sm_{arch} (CUDA 13 starts at sm_75)")


def archs_here():
    """The checked archs this nvcc targets, compiled together (see compile_kernels)."""
    return tuple(arch for arch in CHECKED_ARCHS if arch in nvcc_targets())


def block_threads():
    return int(re.search(r"kBlockThreads = (\d+);", KERNEL_HEADER.read_text()).group(1))


@functools.cache
def compile_kernels(archs, *extra):
    """Compiles tests/cuda/compile_check.cu for `archs` (once per argument list); returns ptxas's
    report per (arch, kernel): registers, bytes of stack frame and bytes spilled. nvcc compiles the
    archs in parallel (--threads 0), and ptxas names the arch of every entry it reports."""
    cmd = [NVCC, "-std=c++17", "-O3", "--threads", "0", f"-I{ROOT / 'csrc'}", *extra]
    for arch in archs:
        cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    cmd += ["-Xptxas", "-v,-warn-spills", "-Werror", "all-warnings"]
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp, "k.o")
        cmd += ["-c", str(ROOT / "tests" / "cuda" / "compile_check.cu"), "-o", str(obj)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        assert obj.stat().st_size > 0
    report = {}
    entry = props = None
    for line in result.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for 'sm_(\d+)'", line):
            entry = (m.group(2), m.group(1))
            report[entry] = {}
        elif m := re.search(r"Function properties for (\S+)", line):
            props = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+)", line):
            if entry and props == entry[1]:
                report[entry]["stack"] = int(m.group(1))
                report[entry]["spills"] = int(m.group(2)) + int(m.group(3))
        elif m := re.search(r"Used (\d+) registers", line):
            report[entry]["registers"] = int(m.group(1))
    return report


def lerp_op(name):
    """(tracks, stochastic) of a kernel of LerpOp<E, S, K, stochastic> by its mangled name."""
    m = re.search(r"6LerpOpI\w+?Li(\d+)ELb([01])EE", name)
    return (int(m.group(1)), m.group(2) == "1") if m else None


def lerp_kernels(report, arch):
    """lerp_'s plain kernels: one track, rounding to nearest."""
    return {
        name: info
        for (a, name), info in report.items()
        if a == arch and lerp_op(name) == (1, False)
    }


def all_kernels(report, arch):
    """The plain and the stochastic-rounding lerp kernels, lerp_'s and lerp_many_'s."""
    return {name: info for (a, name), info in report.items() if a == arch and lerp_op(name)}


def track_kernels(report, arch, tracks, stochastic):
    return [name for (a, name) in report if a == arch and lerp_op(name) == (tracks, stochastic)]


def occupancy(registers, threads):
    """Theoretical occupancy on sm_80/sm_90: 65,536 registers (allocated per warp in units of
    256), 2,048 threads and 32 blocks per SM."""
    per_warp = -(-registers * 32 // 256) * 256
    warps = -(-threads // 32)
    blocks = min(65536 // per_warp // warps, 2048 // threads, 32)
    return blocks * threads / 2048


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        return {name: name for name in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    return dict(zip(names, out.stdout.splitlines()))


@needs_nvcc
@torch_free
@pytest.mark.parametrize("arch", CHECKED_ARCHS)
def test_cuda_kernels_compile(arch):
    require_target(arch)
    kernels = lerp_kernels(compile_kernels(archs_here()), arch)
    small = [name for name in kernels if SMALL in name]
    large = [name for name in kernels if LARGE in name]
    assert len(small) == PAIRS, sorted(kernels)
    # Before Volta the 32 KB layout is not compiled at all (its parameters would not fit).
    assert len(large) == (PAIRS if int(arch) >= 70 else 0), sorted(kernels)
    assert all(info.get("spills", 0) == 0 for info in kernels.values()), kernels


@needs_nvcc
@torch_free
def test_an_arch_list_with_pascal_compiles_only_the_small_layout():
    """TORCH_CUDA_ARCH_LIST="6.0;8.0": one host launcher serves both, so it packs for 4 KB."""
    require_target("60")
    report = compile_kernels(("60", "80"))
    names = [name for (_, name) in report if "LerpOp" in name]
    assert names and not [name for name in names if LARGE in name]


@needs_nvcc
@torch_free
def test_the_pre_volta_build_compiles():
    """What an arch list with a 6.x target builds (no 32 KB layout, no __grid_constant__),
    checked for sm_80 with any nvcc: the metadata is still read in place, not copied to a stack."""
    kernels = lerp_kernels(compile_kernels(("80",), "-DFUSED_EMA_PRE_VOLTA_BUILD=1"), "80")
    assert len(kernels) == PAIRS and all(SMALL in name for name in kernels), sorted(kernels)
    assert all(info["stack"] == 0 for info in kernels.values()), kernels


@needs_nvcc
@torch_free
@pytest.mark.parametrize("arch", ["80", "90"])
def test_kernels_reach_half_occupancy_without_spills(arch):
    require_target(arch)
    report = compile_kernels(archs_here())
    kernels = all_kernels(report, arch)
    assert len(lerp_kernels(report, arch)) == 2 * PAIRS, sorted(kernels)
    # Stochastic rounding's kernels for the four pairs with 16-bit EMAs, lerp_'s (one track) and
    # lerp_many_'s (kMaxTracks = 8 a launch); lerp_many_'s plain ones for every pair; both layouts.
    assert len(track_kernels(report, arch, 1, True)) == 2 * 4
    assert len(track_kernels(report, arch, 8, False)) == 2 * PAIRS
    assert len(track_kernels(report, arch, 8, True)) == 2 * 4
    assert len(kernels) == 2 * PAIRS + 2 * 4 + 2 * PAIRS + 2 * 4, sorted(kernels)
    threads = block_threads()
    names = demangle(list(kernels))
    table = {
        names[name]: (
            info["registers"],
            info.get("spills", 0),
            occupancy(info["registers"], threads),
        )
        for name, info in kernels.items()
    }
    summary = "\n".join(
        f"{r:3d} regs {s:4d} B spilled {o:.0%}  {n}" for n, (r, s, o) in table.items()
    )
    print(f"sm_{arch}, {threads} threads a block:\n{summary}")
    assert all(spills == 0 and occ >= 0.5 for _, spills, occ in table.values()), summary


def bema_kernels(report, arch):
    return {name: info for (a, name), info in report.items() if a == arch and "BemaOp" in name}


@needs_nvcc
@torch_free
@pytest.mark.parametrize("arch", CHECKED_ARCHS)
def test_bema_kernels_compile(arch):
    """bema_'s kernel (multi_tensor_kernel with BemaOp): every dtype pair, in both layouts from
    Volta on, without spills."""
    require_target(arch)
    kernels = bema_kernels(compile_kernels(archs_here()), arch)
    assert len(kernels) == PAIRS * (2 if int(arch) >= 70 else 1), sorted(kernels)
    assert all(info.get("spills", 0) == 0 for info in kernels.values()), kernels


@needs_nvcc
@torch_free
@pytest.mark.parametrize("arch", ["80", "90"])
def test_bema_kernels_reach_half_occupancy(arch):
    require_target(arch)
    kernels = bema_kernels(compile_kernels(archs_here()), arch)
    assert len(kernels) == 2 * PAIRS, sorted(kernels)
    threads = block_threads()
    table = {
        name: (info["registers"], info.get("spills", 0), occupancy(info["registers"], threads))
        for name, info in demangle_items(kernels)
    }
    summary = "\n".join(
        f"{r:3d} regs {s:4d} B spilled {o:.0%}  {n}" for n, (r, s, o) in table.items()
    )
    print(f"sm_{arch}, {threads} threads a block:\n{summary}")
    assert all(spills == 0 and occ >= 0.5 for _, spills, occ in table.values()), summary


def demangle_items(kernels):
    names = demangle(list(kernels))
    return [(names[name], info) for name, info in kernels.items()]


GLUE_SOURCES = ("fused_cuda.cu", "schedule_cuda.cu")


@functools.cache
def compile_glue():
    """Compiles the glue files against the installed torch headers, side by side (each nvcc call
    is one host compile); returns source -> (return code, stderr). The glue reaches torch's CUDA
    side through the stable C shim only, so a CPU wheel's headers serve as well."""
    import torch
    from torch.utils.cpp_extension import include_paths

    with tempfile.TemporaryDirectory(prefix="fused-ema-glue-") as tmp_name:
        tmp = Path(tmp_name)
        version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
        cmd = [
            NVCC,
            "-std=c++20" if version >= (2, 12) else "-std=c++17",
            "-O1",
            f"-I{ROOT / 'csrc'}",
            *(f"-I{p}" for p in include_paths()),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-D__CUDA_NO_HALF_OPERATORS__",
            "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-D__CUDA_NO_HALF2_OPERATORS__",
            "--expt-relaxed-constexpr",
            "-DUSE_CUDA",  # as setup.py: the stable shim's CUDA functions (cuda/torch_cuda.h)
            "-gencode",
            "arch=compute_90,code=sm_90",
            "-Xcompiler",
            "-fPIC",
        ]
        running = {
            source: subprocess.Popen(
                [*cmd, "-c", str(ROOT / "csrc" / "cuda" / source), "-o", str(tmp / f"{source}.o")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source in GLUE_SOURCES
        }
        try:
            results = {}
            for source, process in running.items():
                stderr = process.communicate(timeout=600)[1]
                results[source] = (process.returncode, stderr)
            return results
        finally:
            for process in running.values():
                process.kill()  # a no-op for those that finished; stops the other on a timeout
                process.wait()


@needs_nvcc
@pytest.mark.parametrize("source", GLUE_SOURCES)
def test_cuda_torch_glue_compiles(source):
    """The files that join the kernels to torch compile against the installed torch headers."""
    returncode, stderr = compile_glue()[source]
    assert returncode == 0, stderr[-4000:]


@needs_nvcc
@torch_free
def test_the_stochastic_rounding_benchmark_compiles_and_ops_set_their_blocks_per_sm(tmp_path):
    """benchmarks/cuda/sr_variants.cu (run on a GPU only) builds against today's kernels, and an
    op's kMinBlocksPerSM reaches __launch_bounds__: one resident block lets ptxas go past the
    64 registers that the default two blocks of 512 threads cap it at."""
    require_target("90")
    cmd = [NVCC, "-std=c++17", "-O3", f"-I{ROOT / 'csrc'}"]
    cmd += ["-gencode", "arch=compute_90,code=sm_90"]
    cmd += ["-Xptxas", "-v", "-c", str(ROOT / "benchmarks" / "cuda" / "sr_variants.cu")]
    result = subprocess.run(
        cmd + ["-o", str(tmp_path / "sr.o")], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    registers, entry = {}, None
    for line in result.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            entry = m.group(1)
        elif (m := re.search(r"Used (\d+) registers", line)) and entry:
            registers[entry] = int(m.group(1))
    names = demangle(list(registers))
    one_block = [r for e, r in registers.items() if re.search(r"Variant<.*, \d, 1>", names[e])]
    two_blocks = [r for e, r in registers.items() if re.search(r"Variant<.*, \d, 2>", names[e])]
    assert one_block and two_blocks, sorted(names.values())
    assert max(two_blocks) <= 64 < max(one_block), (one_block, two_blocks)
