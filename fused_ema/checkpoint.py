"""Reading EMA checkpoints: fused_ema's own format and those of the EMA libraries people migrate
from, so a switch to fused_ema keeps the average a run has built up.

| format          | recognised by                             | weights              | step        |
|-----------------|-------------------------------------------|----------------------|-------------|
| fused_ema       | format == "fused_ema.ModelEma"            | weights              | step        |
| timm checkpoint | a state_dict_ema (or model_ema) entry     | by name              | not stored  |
| AveragedModel   | n_averaged + module.*                     | module.*             | n_averaged  |
| ema-pytorch     | initted + step + ema_model.*              | ema_model.*          | step        |
| diffusers       | shadow_params + optimization_step         | parameters, in order | optim. step |
| torch_ema       | shadow_params + num_updates               | parameters, in order | num_updates |
| state dict      | every value a tensor (timm ModelEma/V2/V3)| by name              | not stored  |

Names lose a ``module.`` / ``_orig_mod.`` prefix that every key carries (DDP, torch.compile).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._tracking import strip_checkpoint_prefixes

FORMAT = "fused_ema.ModelEma"
FORMAT_VERSION = 1


@dataclass
class ParsedCheckpoint:
    format: str
    weights: dict[str, torch.Tensor] | None = None  # by name
    positional: list[torch.Tensor] | None = None  # the model's parameters, in order
    step: int | None = None
    schedule: dict | None = None
    problems: list[str] = field(default_factory=list)


def _as_step(value, key: str, problems: list[str]) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            problems.append(
                f"'{key}' should hold one number, got a tensor of shape {list(value.shape)}"
            )
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        problems.append(f"'{key}' should be a whole number of steps, got {value!r}")
        return None
    if value < 0:
        problems.append(f"'{key}' should not be negative, got {value!r}")
        return None
    return int(value)


def _by_name(state: Mapping, drop_prefix: str = "") -> dict[str, object]:
    items = {k[len(drop_prefix) :]: v for k, v in state.items() if k.startswith(drop_prefix)}
    names = strip_checkpoint_prefixes(items)
    return {names[k]: v for k, v in items.items()}


def parse_checkpoint(state) -> ParsedCheckpoint:
    """Recognises the format of `state` and extracts weights, step and schedule from it."""
    if not isinstance(state, Mapping):
        return ParsedCheckpoint(
            "unknown", problems=[f"expected a dict (a state_dict), got {type(state).__name__}"]
        )
    keys = set(state)
    problems: list[str] = []
    if state.get("format") == FORMAT:
        version = state.get("format_version")
        if version != FORMAT_VERSION:
            problems.append(
                f"fused_ema checkpoint format_version {version!r} is not "
                f"{FORMAT_VERSION}, the one this version reads"
            )
        weights = state.get("weights")
        if not isinstance(weights, Mapping):
            problems.append("'weights' is missing or not a dict")
            weights = {}
        return ParsedCheckpoint(
            "fused_ema",
            dict(weights),
            step=_as_step(state.get("step"), "step", problems),
            schedule=state.get("schedule"),
            problems=problems,
        )
    for key in ("state_dict_ema", "model_ema"):
        if isinstance(state.get(key), Mapping):
            return ParsedCheckpoint("timm checkpoint", _by_name(state[key]))
    if "shadow_params" in keys:
        shadow = state["shadow_params"]
        if not isinstance(shadow, (list, tuple)):
            return ParsedCheckpoint(
                "shadow_params",
                problems=[
                    f"'shadow_params' should be a list of tensors, got {type(shadow).__name__}"
                ],
            )
        if "optimization_step" in keys:
            step = _as_step(state["optimization_step"], "optimization_step", problems)
            return ParsedCheckpoint(
                "diffusers EMAModel", positional=list(shadow), step=step, problems=problems
            )
        step = _as_step(state.get("num_updates"), "num_updates", problems)
        return ParsedCheckpoint("torch_ema", positional=list(shadow), step=step, problems=problems)
    if "n_averaged" in keys and any(k.startswith("module.") for k in keys):
        step = _as_step(state["n_averaged"], "n_averaged", problems)
        return ParsedCheckpoint(
            "AveragedModel", _by_name(state, "module."), step=step, problems=problems
        )
    if {"initted", "step"} <= keys and any(k.startswith("ema_model.") for k in keys):
        step = _as_step(state["step"], "step", problems)
        return ParsedCheckpoint(
            "ema-pytorch", _by_name(state, "ema_model."), step=step, problems=problems
        )
    if keys and all(isinstance(v, torch.Tensor) for v in state.values()):
        return ParsedCheckpoint("state dict", _by_name(state))
    sample = ", ".join(sorted(map(str, keys))[:8]) or "no keys"
    return ParsedCheckpoint(
        "unknown",
        problems=[
            f"not an EMA checkpoint fused_ema knows (found {sample}); expected fused_ema's "
            "state_dict, a model state dict, or one of timm, AveragedModel, ema-pytorch, diffusers "
            "EMAModel, torch_ema"
        ],
    )


def read_file(path) -> object:
    """torch.load onto the CPU (weights only); the EMA maps tensors to its own devices later."""
    return torch.load(path, map_location="cpu", weights_only=True)
