"""fused_ema: fused, device-safe exponential moving averages of PyTorch model weights.

fused_ema.lerp_(ema_tensors, src_tensors, weight)   # ema[i] += weight * (src[i] - ema[i])
fused_ema.lerp_stochastic_(ema, src, weight, seed=0, step=t)   # bf16/fp16 EMAs: stochastic rounding
fused_ema.lerp_many_([ema_a, ema_b], src, [w_a, w_b])   # K EMAs, each src read once
fused_ema.bema_(ema, theta0, out, src, (beta, w0, alpha))   # bias-corrected EMA, one pass
fused_ema.build_info()                              # what was compiled, and for what
fused_ema.PostHocEma(model, sigma_rels=(0.05, 0.10))   # post-hoc EMA (fused_ema.posthoc)
fused_ema.Bema(model, update_freq=400)   # BEMA, the bias-corrected EMA (TRL's BEMACallback)
"""

from ._ext.loader import _C  # noqa: F401  (must come before the ops that use it)
from ._version import __version__
from .bema import Bema
from .ema import LoadResult, ModelEma
from .errors import CheckpointError, PrecisionWarning, StructureMismatchError
from .ops import (
    SUPPORTED_DTYPE_PAIRS,
    bema_,
    build_info,
    cpu_isa,
    lerp_,
    lerp_many_,
    lerp_stochastic_,
    set_cpu_isa,
)
from .posthoc import PostHocEma

__all__ = [
    "Bema",
    "CheckpointError",
    "LoadResult",
    "ModelEma",
    "PostHocEma",
    "PrecisionWarning",
    "StructureMismatchError",
    "SUPPORTED_DTYPE_PAIRS",
    "__version__",
    "bema_",
    "build_info",
    "cpu_isa",
    "lerp_",
    "lerp_many_",
    "lerp_stochastic_",
    "set_cpu_isa",
]
