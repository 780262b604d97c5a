"""Post-hoc EMA (EDM2, Karras et al. 2024): snapshots of power-function EMAs saved during training
(PostHocEma), and the EMA of any sigma_rel synthesized from them afterwards:
fused_ema.posthoc.synthesize(snapshot_dir, sigma_rel=0.05), or the command
python -m fused_ema.posthoc SNAPSHOT_DIR --sigma-rel 0.05 --out ema.safetensors [--plot fit.png]."""

from .migrate import list_ema_pytorch_snapshots
from .profiles import (
    GAMMA_MIN,
    SIGMA_REL_MAX,
    gamma_to_sigma_rel,
    least_squares_coefficients,
    power_beta,
    power_profile,
    profile_inner_products,
    sigma_rel_to_gamma,
)
from .snapshots import (
    FORMAT,
    SnapshotError,
    SnapshotInfo,
    clean_temporary_files,
    list_snapshots,
    next_index,
    save_snapshot,
    snapshot_metadata,
    snapshot_path,
    snapshot_tensors,
    write_snapshot,
)
from .synthesis import Synthesis, solve_coefficients, synthesize
from .training import PostHocEma

__all__ = [
    "FORMAT",
    "GAMMA_MIN",
    "PostHocEma",
    "SIGMA_REL_MAX",
    "SnapshotError",
    "SnapshotInfo",
    "Synthesis",
    "clean_temporary_files",
    "gamma_to_sigma_rel",
    "least_squares_coefficients",
    "list_ema_pytorch_snapshots",
    "list_snapshots",
    "next_index",
    "power_beta",
    "power_profile",
    "profile_inner_products",
    "save_snapshot",
    "sigma_rel_to_gamma",
    "snapshot_metadata",
    "snapshot_path",
    "snapshot_tensors",
    "solve_coefficients",
    "synthesize",
    "write_snapshot",
]
