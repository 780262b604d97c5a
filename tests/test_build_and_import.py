"""build_info() reports what was compiled; importing fused_ema without its compiled kernels
fails with an ImportError that says how to build, never with a silent fallback."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_ema

ROOT = Path(__file__).resolve().parents[1]


def test_build_info_reports_the_compiled_kernels():
    info = fused_ema.build_info()
    assert info["version"] == fused_ema.__version__
    assert info["torch_version"] == torch.__version__
    assert info["cpu_kernel"] is True
    assert info["cpu_isas_compiled"][0] == "default"
    assert set(info["cpu_isas_available"]) <= set(info["cpu_isas_compiled"])
    assert info["cpu_isa"] in info["cpu_isas_available"]
    assert info["cuda_kernel"] == bool(info["cuda_archs"])
    if torch.cuda.is_available():
        assert info["cuda_kernel"], "a GPU is visible but fused_ema was built without CUDA"
    # The build's own torch version must be the one running (ABI).
    assert torch.__version__.startswith(info["torch_version_built"])


def _minor_version(text: str) -> tuple:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def test_the_stated_floors_agree_and_hold_here():
    """pyproject.toml's torch and Python floors are the ones setup.py and the README state, and
    the running torch and Python meet them."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_floor = re.search(r'^dependencies = \["torch>=([\d.]+)"[],]', pyproject, re.M).group(1)
    python_floor = re.search(r'^requires-python = ">=([\d.]+)"$', pyproject, re.M).group(1)
    assert f"installed torch >= {torch_floor}." in (ROOT / "setup.py").read_text()
    readme = (ROOT / "README.md").read_text()
    assert f"(>= {torch_floor}, Python >= {python_floor};" in readme
    assert f"Python {python_floor}+ and a C++ compiler" in readme
    assert _minor_version(torch.__version__) >= _minor_version(torch_floor)
    assert sys.version_info[:2] >= _minor_version(python_floor)


def test_build_info_cpu_kernel_answers_through_the_dispatcher():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fused_ema::lerp_", "CPU")


# The pairs of the design brief, in the order SUPPORTED_DTYPE_PAIRS has always had, then the
# half-memory EMAs of a float32 model.
EXPECTED_PAIRS = (
    ("float32", "float32"),
    ("float32", "bfloat16"),
    ("float32", "float16"),
    ("bfloat16", "bfloat16"),
    ("float16", "float16"),
    ("float64", "float64"),
    ("bfloat16", "float32"),
    ("float16", "float32"),
)


def test_dtype_pairs_come_from_the_compiled_list():
    from fused_ema._ext.loader import _C

    assert _C.DTYPE_PAIRS == EXPECTED_PAIRS
    expected = tuple((getattr(torch, e), getattr(torch, s)) for e, s in EXPECTED_PAIRS)
    assert fused_ema.SUPPORTED_DTYPE_PAIRS == expected
    # The C++ error message lists the same pairs, from the same list.
    listed = ", ".join(f"({e}, {s})" for e, s in EXPECTED_PAIRS)
    bad = [torch.zeros(3, dtype=torch.float16)], [torch.zeros(3, dtype=torch.bfloat16)]
    with pytest.raises(ValueError) as info:
        fused_ema.lerp_(*bad, 0.5)
    assert f"supported (ema, src) pairs: {listed}" in str(info.value)


def test_import_without_compiled_kernels_says_how_to_build(tmp_path):
    # A copy of the package's Python files under another name, so that the installed (built)
    # fused_ema cannot be picked up instead; its imports are all relative.
    package = tmp_path / "fused_ema_unbuilt"
    shutil.copytree(
        ROOT / "fused_ema", package, ignore=shutil.ignore_patterns("_C*", "__pycache__")
    )
    assert not list(package.rglob("_C*"))
    result = subprocess.run(
        [sys.executable, "-c", "import fused_ema_unbuilt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "pip install --no-build-isolation" in result.stderr


@pytest.mark.parametrize("requested", ["default", "bogus"])
def test_the_cpu_path_can_be_chosen_by_environment_variable(requested):
    # FUSED_EMA_CPU_ISA picks the path at import; a path this machine lacks warns and the best
    # available one serves.
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import fused_ema\n"
        "info = fused_ema.build_info()\n"
        "print(fused_ema.cpu_isa(), info['cpu_isas_available'][-1])"
    )
    env = {**os.environ, "FUSED_EMA_CPU_ISA": requested}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    chosen, best = result.stdout.split()
    if requested == "default":
        assert chosen == "default" and "FUSED_EMA_CPU_ISA" not in result.stderr
    else:
        assert chosen == best
        assert (
            "RuntimeWarning: fused_ema: FUSED_EMA_CPU_ISA=bogus is not available" in result.stderr
        )


@pytest.mark.parametrize("patch", [False, True], ids=["another release", "another patch"])
def test_a_binary_loads_only_under_the_torch_release_it_was_built_for(patch):
    # torch's C++ API keeps its ABI within a release: 2.13.1 runs a binary built with 2.13.0, 2.15
    # must not (it could load and then fail anywhere).
    from fused_ema._ext.loader import _C

    major, minor = _C.TORCH_VERSION_BUILT.split(".")[:2]
    running = f"{major}.{minor}.99+cpu" if patch else f"{major}.{int(minor) + 2}.0+cpu"
    code = f"import torch; torch.__version__ = {running!r}; import fused_ema; print('loaded')"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if patch:
        assert result.returncode == 0, result.stderr
        assert "loaded" in result.stdout
    else:
        assert result.returncode != 0
        message = result.stderr.strip().splitlines()
        assert any(
            f"built for torch {_C.TORCH_VERSION_BUILT}, but torch {running}" in line
            for line in message
        ), result.stderr
        assert "pip install --no-build-isolation" in result.stderr


@pytest.mark.parametrize(
    ("args", "code"), [([], 0), (["--short"], 0), (["--help"], 0), (["--bogus"], 2), (["x"], 2)]
)
def test_the_command_line_prints_build_info_and_refuses_other_arguments(args, code, capsys):
    # Every argument but --short was ignored: --help and typos printed the JSON with status 0.
    from fused_ema.__main__ import main

    try:
        result = main(args)
    except SystemExit as stop:  # argparse's --help and usage errors
        result = stop.code
    out, err = capsys.readouterr()
    assert result == code, err
    if code == 2:
        assert out == "" and f"unrecognized arguments: {args[0]}" in err
    elif args == ["--help"]:
        assert out.startswith("usage: python -m fused_ema") and "--short" in out
    elif args == ["--short"]:
        assert out.startswith(f"fused_ema {fused_ema.__version__} (torch ") and "\n" not in out[:-1]
    else:
        assert json.loads(out) == json.loads(json.dumps(fused_ema.build_info()))
