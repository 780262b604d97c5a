"""BEMA's update on a real model: TRL's BEMACallback (trl 1.16.0) against fused_ema.Bema and a
torch._foreach_* baseline doing the same math, interleaved, medians. The model is a transformers
GPT-2 built from its config with random weights (nothing downloaded): GPT-2 small (124M float32
parameters on the CPU), or a tiny one with --scale small (the tests).

What is timed is the update itself, every contender with update_freq=1 so every step does the
work: TRL's `_update_bema_weights(step)` (what its on_step_end calls), `Bema.update(model,
step=step)`, and the foreach version. Between calls, outside the timed region, the model's
weights move a little, so every update averages new values. Before timing, each contender's
corrected weights theta' are compared with TRL's (or, without TRL, with the foreach version's)
over a few steps; one that differs by more than 1e-5 (relative to the weights' size) is reported
and not timed.

    python -m benchmarks.bema [--device cpu|cuda] [--scale gpt2|small] [--rounds 9] [--reps 3]
                              [--warmup 8] [--threads N] [--out benchmarks/out]

With --device cuda the model, TRL's running model (its `device` argument), Bema's tensors and
the foreach version's all live on the GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import fused_ema

from . import report
from .peers import PeerUnavailable, load_trl_bema_callback
from .timing import copy_bandwidth, interleaved, summary, synchronizer

# TRL's BEMACallback defaults but update_freq=1: every timed call does an update.
OPTIONS = dict(
    update_freq=1,
    ema_power=0.5,
    bias_power=0.2,
    lag=10,
    update_after=0,
    multiplier=1.0,
    min_ema_multiplier=0.0,
)
TRL, FUSED, FOREACH = "trl BEMACallback", "fused_ema.Bema", "torch._foreach_*"
FLOOR = "floor: bema_ on flat tensors"
# A BEMA step that stores theta' moves, per parameter, this many elements of the EMA's dtype:
# theta, the EMA and theta_0 read, the EMA and theta' written.
PASS_BYTES = 5
TARGET = 10.0  # fused_ema.Bema over TRL's update, GPT-2 small on the CPU
TOLERANCE = 1e-5  # max |theta' - reference| / max |reference|
CHECK_STEPS = 3


def build_model(scale: str) -> nn.Module:
    """GPT-2 from its config, random weights (seeded), float32, CPU, eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if scale == "gpt2":
        config = GPT2Config()  # GPT-2 small: 12 layers, 768 wide, 50257 tokens
    elif scale == "small":
        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64,
            bos_token_id=511, eos_token_id=511,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown scale {scale!r} (gpt2 or small)")
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def bema_missing() -> str | None:
    """Why fused_ema.Bema cannot be used here, or None."""
    if not hasattr(fused_ema, "Bema"):
        return "pending: fused_ema.Bema is not in this build of fused_ema yet"
    return None


def beta_alpha(step: int) -> tuple[float, float]:
    """TRL's _ema_beta and _bema_alpha for OPTIONS."""
    o = OPTIONS
    base = o["lag"] + o["multiplier"] * step
    return max(base ** -o["ema_power"], o["min_ema_multiplier"]), base ** -o["bias_power"]


class Contender:
    """One way of doing BEMA's update: `start()` takes theta_0 (step update_after), `update()`
    does the next step's work, `corrected()` is theta' as a list in named_parameters order."""

    checked = True  # whether check() holds its theta' to the reference's

    def __init__(self, model: nn.Module):
        self.model = model
        self.step = OPTIONS["update_after"]

    def update(self) -> None:
        self.step += 1
        self._update(self.step)


class TrlContender(Contender):
    def __init__(self, model: nn.Module, folder: Path, device: str):
        super().__init__(model)
        from transformers import TrainerControl, TrainerState, TrainingArguments

        cls = load_trl_bema_callback()
        self.callback = cls(**OPTIONS, device=device)
        self.args = TrainingArguments(output_dir=str(folder / "trl"), report_to=[])
        self.state, self.control = TrainerState(), TrainerControl()
        self.callback.on_train_begin(self.args, self.state, self.control, model=model)

    def start(self) -> None:
        self.state.global_step = self.step
        self.callback.on_step_end(self.args, self.state, self.control, model=self.model)

    @torch.no_grad()  # as on_step_end, which calls it
    def _update(self, step: int) -> None:
        self.callback._update_bema_weights(step)

    def corrected(self) -> list[torch.Tensor]:
        return list(self.callback.running_model.parameters())


class FusedContender(Contender):
    def __init__(self, model: nn.Module, device: str):
        super().__init__(model)
        self.bema = fused_ema.Bema(model, **OPTIONS, device=device)

    def start(self) -> None:
        self.bema.update(self.model, step=self.step)

    def _update(self, step: int) -> None:
        self.bema.update(self.model, step=step)

    def corrected(self) -> list[torch.Tensor]:
        return list(self.bema.module.parameters())


class ForeachContender(Contender):
    """The same math in four passes of torch's multi-tensor ops: ema.lerp_(theta, beta), then
    theta' = ema + alpha * theta - alpha * theta_0 written in place."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.theta = [p.detach() for p in model.parameters() if p.requires_grad]
        self.theta0 = [t.clone() for t in self.theta]
        self.ema = [t.clone() for t in self.theta]
        self.out = [t.clone() for t in self.theta]

    @torch.no_grad()
    def start(self) -> None:
        torch._foreach_copy_(self.theta0, self.theta)
        torch._foreach_copy_(self.ema, self.theta)

    @torch.no_grad()
    def _update(self, step: int) -> None:
        beta, alpha = beta_alpha(step)
        torch._foreach_lerp_(self.ema, self.theta, beta)
        torch._foreach_copy_(self.out, self.ema)
        torch._foreach_add_(self.out, self.theta, alpha=alpha)
        torch._foreach_add_(self.out, self.theta0, alpha=-alpha)

    def corrected(self) -> list[torch.Tensor]:
        return self.out


class FloorContender(Contender):
    """The memory traffic of a BEMA step alone: bema_ over one flat tensor per list, as many
    elements as the model has parameters, its own data (not the model's; not checked)."""

    checked = False

    def __init__(self, model: nn.Module):
        super().__init__(model)
        params = [p for p in model.parameters() if p.requires_grad]
        numel, like = sum(p.numel() for p in params), params[0]
        g = torch.Generator().manual_seed(2)
        self.lists = [
            [torch.randn(numel, generator=g, dtype=like.dtype).to(like.device)] for _ in range(4)
        ]

    def start(self) -> None:
        pass

    def _update(self, step: int) -> None:
        beta, alpha = beta_alpha(step)
        ema, theta0, out, src = self.lists
        fused_ema.bema_(ema, theta0, out, src, (beta, 0.0, alpha))

    def corrected(self) -> None:
        return None


class Perturber:
    """Moves the model's weights by a fixed small random step, its sign alternating, so each
    update sees new values and the weights stay near where they started."""

    def __init__(self, model: nn.Module, size: float = 1e-3):
        g = torch.Generator().manual_seed(1)
        self.params = [p.detach() for p in model.parameters() if p.requires_grad]
        self.delta = [(size * torch.randn(p.shape, generator=g)).to(p.device) for p in self.params]
        self.sign = 1.0

    @torch.no_grad()
    def __call__(self) -> None:
        torch._foreach_add_(self.params, self.delta, alpha=self.sign)
        self.sign = -self.sign


def max_relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return float("inf")
        scale = w.abs().max().item() or 1.0
        worst = max(worst, (g.float() - w.float()).abs().max().item() / scale)
    return worst


def build_contenders(model: nn.Module, folder: Path, foreach: bool, device: str):
    made, unavailable = {}, {}
    try:
        made[TRL] = TrlContender(model, folder, device)
    except PeerUnavailable as err:
        unavailable[TRL] = f"n/a: {err}"
    why = bema_missing()
    if why:
        unavailable[FUSED] = f"n/a: {why}"
    else:
        made[FUSED] = FusedContender(model, device)
    if foreach:
        made[FOREACH] = ForeachContender(model)
    made[FLOOR] = FloorContender(model)
    return made, unavailable


def check(made: dict, perturb: Callable[[], None]) -> dict[str, float]:
    """Every contender's largest relative error against the reference (TRL's when there, else
    the foreach version's) after each of CHECK_STEPS updates: the worst of them."""
    for contender in made.values():
        contender.start()
    reference = TRL if TRL in made else FOREACH if FOREACH in made else None
    errors = {name: 0.0 for name, c in made.items() if c.checked and name != reference}
    for _ in range(CHECK_STEPS):
        perturb()
        for contender in made.values():
            contender.update()
        if reference is None:
            continue
        want = made[reference].corrected()
        for name in errors:
            errors[name] = max(errors[name], max_relative_error(made[name].corrected(), want))
    return errors


def measure(
    scale: str, rounds: int, reps: int, warmup: int, foreach: bool, folder: Path, device: str
) -> dict:
    model = build_model(scale).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    perturb = Perturber(model)
    made, unavailable = build_contenders(model, folder, foreach, device)
    errors = check(made, perturb)
    record = {
        "model": f"GPT-2 ({scale})",
        "config": {k: getattr(model.config, k) for k in ("n_layer", "n_embd", "n_head")}
        | {"vocab_size": model.config.vocab_size},
        "parameters": sum(p.numel() for p in params),
        "tensors": len(params),
        "dtype": str(params[0].dtype),
        "bytes_per_param": PASS_BYTES * params[0].element_size(),
        "options": OPTIONS,
        "warmup_updates": warmup,
        "reference": TRL if TRL in made else FOREACH if FOREACH in made else None,
        "max_rel_error": errors,
        "tolerance": TOLERANCE,
        "contenders": {},
    }
    for name, why in unavailable.items():
        record["contenders"][name] = {"status": why}
    timed = {}
    for name, contender in made.items():
        error = errors.get(name, 0.0)
        if error > TOLERANCE:
            record["contenders"][name] = {
                "status": f"wrong: theta' off by {error:.2e} relative (tolerance {TOLERANCE})"
            }
        else:
            timed[name] = contender.update
    # Untimed updates on moving weights first: on this shared machine the first updates after
    # the copies are made can run many times slower than the later ones.
    for _ in range(warmup):
        for contender in made.values():
            perturb()
            contender.update()
    steps_before = {name: made[name].step for name in timed}
    with torch.no_grad(), tqdm(total=rounds, desc="bema", leave=False) as bar:
        samples = interleaved(
            timed,
            rounds,
            reps,
            synchronizer(device),
            bar.update,
            budget_s=2.0,
            prepare={name: perturb for name in timed},
        )
    for name, times in samples.items():
        record["contenders"][name] = {"status": "ok"} | summary(times)
        record["contenders"][name]["steps"] = [steps_before[name] + 1, made[name].step]
    ok = {n: c for n, c in record["contenders"].items() if c["status"] == "ok"}
    if TRL in ok:
        base = ok[TRL]["median_ms"]
        for c in ok.values():
            c["vs_trl"] = base / c["median_ms"]
    if TRL in ok and FUSED in ok:
        record["trl_over_fused"] = ok[TRL]["median_ms"] / ok[FUSED]["median_ms"]
        record["trl_over_fused_min"] = ok[TRL]["min_ms"] / ok[FUSED]["min_ms"]
    record["floor"] = floor(record, device)
    return record


def floor(record: dict, device: str) -> dict:
    """What the floor row and the machine's copy bandwidth say about the target: the pass's
    bytes, the rate each contender moved them at, and the time (and rate) the target needs."""
    pass_bytes = record["bytes_per_param"] * record["parameters"]
    out = {"pass_bytes": pass_bytes, "copy_gb_s": copy_bandwidth(device)}
    for c in record["contenders"].values():
        if c["status"] == "ok":
            c["gb_s"] = pass_bytes / c["median_ms"] / 1e6
    trl = record["contenders"].get(TRL, {})
    if trl.get("status") == "ok":
        out["target_ms"] = trl["median_ms"] / TARGET
        out["target_gb_s"] = pass_bytes / out["target_ms"] / 1e6
    return out


def markdown(record: dict) -> str:
    m, r = record["machine"], record["result"]
    where = m.get("gpu") or f"{m['cpu']} ({m['threads']} threads)"
    lines = [
        f"# BEMA update, {r['model']} ({r['parameters'] / 1e6:.1f}M {r['dtype']} parameters in "
        f"{r['tensors']} tensors), {where}, torch {m['torch']}, "
        f"Python {m['python']}, {m['date']}",
        "",
        "One BEMA update (update_freq=1, TRL's other defaults; the model, the EMA, theta_0 and "
        f"theta' on the {record['device'].upper()}), ms per update over {record['rounds']} "
        "interleaved rounds after "
        f"{r['warmup_updates']} untimed updates each, the weights moved between updates outside "
        "the timed region. Versions: "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items())
        + ".",
        "",
        "| contender | median ms | p25-p75 ms | min ms | samples | speed-up vs TRL "
        f"| GB/s at {r['bytes_per_param']} B/param |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in r["contenders"].items():
        if c["status"] != "ok":
            lines.append(f"| {name} | {c['status']} | | | | | |")
            continue
        vs = f"{c['vs_trl']:.2f}x" if "vs_trl" in c else "n/a"
        rate = f"{c['gb_s']:.1f}" if "gb_s" in c else ""
        lines.append(
            f"| {name} | {c['median_ms']:.1f} | {c['p25_ms']:.1f}-{c['p75_ms']:.1f} "
            f"| {c['min_ms']:.1f} | {c['samples']} | {vs} | {rate} |"
        )
    lines.append("")
    if "trl_over_fused" in r:
        lines.append(
            f"TRL / fused_ema.Bema: {r['trl_over_fused']:.2f}x by medians, "
            f"{r['trl_over_fused_min']:.2f}x by minima (target >= {TARGET:.0f}x)."
        )
    else:
        lines.append("TRL / fused_ema.Bema: n/a (one of the two was not timed, see above).")
    f = r["floor"]
    need = (
        f" The target needs {f['target_ms']:.1f} ms, {f['target_gb_s']:.1f} GB/s."
        if "target_ms" in f
        else ""
    )
    lines.append(
        f"Floor: a BEMA step that stores theta' moves {f['pass_bytes'] / 1e9:.2f} GB "
        f"({r['bytes_per_param']} bytes a parameter); the floor row moves them with no "
        f"per-tensor work; a plain copy here runs at {f['copy_gb_s']:.1f} GB/s (bytes read + "
        f"written).{need}"
    )
    errors = ", ".join(f"{n} {e:.2e}" for n, e in r["max_rel_error"].items()) or "none"
    lines.append(
        f"Agreement before timing ({CHECK_STEPS} updates, reference {r['reference']}): max "
        f"|theta' - reference| / max |reference| per tensor: {errors} (tolerance {TOLERANCE})."
    )
    return "\n".join(lines) + "\n"


def versions() -> dict:
    import importlib.metadata as metadata

    out = {}
    for package in ("transformers", "trl"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    out["fused_ema"] = fused_ema.build_info()["version"]
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every contender's tensors)")
    parser.add_argument("--scale", choices=("gpt2", "small"), default="gpt2")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=3, help="calls per contender per round")
    parser.add_argument("--warmup", type=int, default=8, help="untimed updates first, each")
    parser.add_argument("--no-foreach", action="store_true", help="leave out the foreach baseline")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = {
        "machine": report.machine([args.device]),
        "device": args.device,
        "versions": versions(),
        "rounds": args.rounds,
        "reps": args.reps,
    }
    with tempfile.TemporaryDirectory() as tmp:
        record["result"] = measure(
            args.scale,
            args.rounds,
            args.reps,
            args.warmup,
            not args.no_foreach,
            Path(tmp),
            args.device,
        )
    text = markdown(record)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bema_{report.slug(record['machine'])}" + ("" if args.scale == "gpt2" else "_small")
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    print(f"wrote {args.out / stem}.json and .md")
    return record


if __name__ == "__main__":
    main()
