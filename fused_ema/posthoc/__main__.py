"""`python -m fused_ema.posthoc SNAPSHOT_DIR --sigma-rel 0.05 --out ema.safetensors`: synthesizes
the EMA of one sigma_rel (or --gamma) at a snapshot step from a folder of snapshots (fused_ema's, or
ema-pytorch's with --tracked-sigma-rels) and writes it atomically as safetensors; --plot draws the
target averaging profile against the reconstructed one. Bad input: exit status 2 and one line."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from .._files import atomic_write
from .snapshots import EMA_PYTORCH_NAME, NAME, SnapshotError
from .synthesis import Synthesis, solve_coefficients, synthesize

DTYPES = {name: getattr(torch, name) for name in ("float32", "float64", "float16", "bfloat16")}
CHOSEN = ("sigma_rel", "gamma", "step", "tracked_sigma_rels", "tracked_gammas")  # as the library's


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fused_ema.posthoc",
        description="Synthesize a post-hoc EMA of any sigma_rel from power-function EMA snapshots.",
    )
    p.add_argument("snapshot_dir", type=Path, help="folder of snapshots (or ema-pytorch's .pt)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--sigma-rel", type=float, help="relative width of the EMA to synthesize")
    target.add_argument("--gamma", type=float, help="or its power-function exponent")
    p.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    p.add_argument("--step", type=int, help="a snapshot step (default: the last)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="of the floating-point tensors")
    p.add_argument("--plot", type=Path, help="a PNG of the target and reconstructed profiles")
    tracked = p.add_mutually_exclusive_group()
    tracked.add_argument(
        "--tracked-sigma-rels", type=_floats, help="ema-pytorch folders: its sigma_rels, a,b,..."
    )
    tracked.add_argument("--tracked-gammas", type=_floats, help="or its gammas")
    return p


def plot_profiles(plan: Synthesis, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau = torch.linspace(0, plan.step, 2001, dtype=torch.float64)
    target, reconstructed = plan.profiles(tau)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(tau, target, label=f"target: sigma_rel {plan.sigma_rel:.4g}", lw=2)
    ax.plot(tau, reconstructed, "--", label=f"from {len(plan.snapshots)} snapshots", lw=1.5)
    steps = sorted({s.step for s in plan.snapshots})
    ax.plot(steps, [0.0] * len(steps), "|", color="gray", ms=8, label="snapshot steps")
    ax.set(
        xlabel="update",
        ylabel="weight per update",
        title=f"post-hoc EMA at step {plan.step}: gamma {plan.gamma:.4g}, "
        f"profile fit error {plan.fit_error:.2e}",
    )
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def check_plot_format(path: Path) -> None:
    """Before any work: a --plot that matplotlib cannot draw fails after the synthesis (its
    progress bar) otherwise."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix and path.suffix[1:].lower() not in formats:
        raise ValueError(
            f"--plot {path}: matplotlib cannot write {path.suffix!r} files (it writes "
            f"{', '.join(sorted(formats))})"
        )


def _is_snapshot(path: Path, snapshot_dir: Path) -> bool:
    """Whether writing `path` would replace a snapshot file (fused_ema's or ema-pytorch's)."""
    in_folder = path.resolve().parent == snapshot_dir.resolve()
    return in_folder and bool(NAME.match(path.name) or EMA_PYTORCH_NAME.match(path.name))


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        for option, path in (("--out", args.out), ("--plot", args.plot)):
            if path is not None and not path.parent.is_dir():
                raise FileNotFoundError(f"no folder {path.parent} to write {option} into")
            if path is not None and path.is_dir():
                raise IsADirectoryError(f"{option} {path} is a folder, not a file")
            if path is not None and (path.is_symlink() or (path.exists() and not path.is_file())):
                # written atomically, by a rename: it would replace the link or device itself
                raise ValueError(f"{option} {path} exists and is not a regular file")
        if args.plot is not None:
            check_plot_format(args.plot)
        for option, path in (("--out", args.out), ("--plot", args.plot)):
            if path is not None and _is_snapshot(path, args.snapshot_dir):
                raise ValueError(f"{option} {path} is a snapshot of the folder: it would be lost")
        plan = solve_coefficients(args.snapshot_dir, **{n: getattr(args, n) for n in CHOSEN})
        state = synthesize(  # the plan's snapshots: the folder is listed once (a run may add more)
            plan.snapshots,
            gamma=plan.gamma,
            step=plan.step,
            dtype=DTYPES.get(args.dtype),
            progress=importlib.util.find_spec("tqdm") is not None,
        )
        if args.plot is not None:  # first: a plot it cannot draw (a bad suffix) writes no --out
            plot_profiles(plan, args.plot)
        metadata = {k: repr(getattr(plan, k)) for k in ("sigma_rel", "gamma", "step", "fit_error")}
        atomic_write(args.out, lambda tmp: save_file(state, tmp, metadata=metadata))
    except (SnapshotError, ValueError, TypeError, OSError) as err:
        message = " ".join(str(err).split())
        print(f"python -m fused_ema.posthoc: error: {message}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: sigma_rel {plan.sigma_rel:.6g} (gamma {plan.gamma:.6g}) at step "
        f"{plan.step} from {len(plan.snapshots)} snapshots, profile fit error {plan.fit_error:.3g}"
        + (f"; profiles in {args.plot}" if args.plot is not None else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
