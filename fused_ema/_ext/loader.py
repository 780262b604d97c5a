"""Loads the compiled extension fused_ema._C, which registers the torch.ops.fused_ema operators.
A missing build, or one made for another torch release, raises an ImportError that says how to
build; there is no silent pure-PyTorch stand-in."""

import os
import warnings

import torch  # (loads libtorch before the extension that links against it)

REBUILD = (
    "Build them against the torch you have installed, from the fused_ema source tree:\n"
    "    pip install --no-build-isolation -e .\n"
    "(--no-build-isolation makes the build use this torch instead of downloading another.)"
)


def release(version: str) -> tuple:
    """(major, minor) of a torch version string: "2.13.0+cpu" -> (2, 13)."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def check_built_for(built: str, running: str) -> None:
    """The binary uses torch's C++ API, whose ABI holds within a release (2.13.x), not across."""
    if release(built) != release(running):
        raise ImportError(
            f"fused_ema's compiled kernels were built for torch {built}, but torch {running} is "
            f"installed; a binary works only with the torch release it was built for.\n{REBUILD}"
        )


try:
    from .. import _C
except ImportError as err:
    raise ImportError(
        f"fused_ema's compiled kernels (fused_ema._C) could not be loaded: {err}\n{REBUILD}"
    ) from err

check_built_for(_C.TORCH_VERSION_BUILT, torch.__version__)


def apply_isa_request(requested: str | None) -> None:
    """FUSED_EMA_CPU_ISA chooses the CPU path at import; one this machine lacks warns, and the
    best available serves."""
    if not requested:
        return
    try:
        _C.set_cpu_isa(requested)
    except ValueError:
        warnings.warn(
            f"fused_ema: FUSED_EMA_CPU_ISA={requested} is not available here (available: "
            f"{', '.join(_C.available_cpu_isas())}); using {_C.cpu_isa()}",
            RuntimeWarning,
            stacklevel=2,
        )


apply_isa_request(os.environ.get("FUSED_EMA_CPU_ISA"))

__all__ = ["_C"]
