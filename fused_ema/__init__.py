"""fused_ema: fused, device-safe exponential moving averages of PyTorch model weights: ModelEma,
the fused ops (lerp_, lerp_stochastic_, lerp_many_ for K EMAs, bema_), post-hoc EMA (PostHocEma,
fused_ema.posthoc), BEMA (Bema) and build_info(). The guides and the API reference: docs/."""

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
