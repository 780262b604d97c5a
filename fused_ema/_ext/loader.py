"""Loads the compiled extension fused_ema._C, which registers the torch.ops.fused_ema operators.
A missing or stale build raises an ImportError that says how to build; there is no silent
pure-PyTorch stand-in."""

import torch  # noqa: F401  (loads libtorch before the extension that links against it)

try:
    from .. import _C
except ImportError as err:
    raise ImportError(
        f"fused_ema's compiled kernels (fused_ema._C) could not be loaded: {err}\n"
        "Build them against the torch you have installed, from the fused_ema source tree:\n"
        "    pip install --no-build-isolation -e .\n"
        "(--no-build-isolation makes the build use this torch instead of downloading another; "
        "a _C built for another torch version must be rebuilt the same way.)"
    ) from err

__all__ = ["_C"]
