"""EMA checkpoint formats: fused_ema's own and those of the EMA libraries people migrate from (each
format and what it is recognised by: docs/checkpoints.md), parsed into one shape, so a switch to
fused_ema keeps the average a run has built up. Reading files: _files.py; checking a parsed
checkpoint against an EMA: _state/loading.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._files import PRETRAINED
from ._model.walk import checkpoint_prefix_levels
from ._update.schedule import whole_number
from .ops import storage_shortfall

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
    filters: dict | None = None  # the name filters a fused_ema checkpoint was saved with
    partition: object = None  # the ZeRO-3 rank and world size whose partitions it holds


def _as_step(value, key: str, problems: list[str]) -> int | None:
    """A step count from a checkpoint: a whole number in [0, MAX_STEP] (a one-element tensor
    or a number), else a problem and None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta or value.layout != torch.strided:
            problems.append(
                f"'{key}' should hold one number, got a {value.layout} tensor of shape "
                f"{list(value.shape)}{' on meta' if value.is_meta else ''}"
            )
            return None
        if storage_shortfall(value) is not None:  # reading it would crash the process
            problems.append(f"'{key}' is a tensor whose memory was freed")
            return None
        value = value.item()
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) == 0:
        value = value.item()  # a numpy scalar (what a checkpoint's step may have been saved as)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        return whole_number(key, value, 0)
    except ValueError as err:
        problems.append(str(err))
        return None


def _by_name(state: Mapping, drop_prefix: str = "", known=None) -> dict[str, object]:
    """A model state dict's tensors by name, without the prefixes every key carries (module.,
    _orig_mod.) except those whose removal matches fewer of the EMA's `known` names (a model
    whose one child is called `module`), and without torch's `_extra_state` entries (a
    module's own state, not a tensor an EMA averages)."""
    items = {
        k[len(drop_prefix) :]: v
        for k, v in state.items()
        if _starts(k, drop_prefix) and not _is_extra_state(k)
    }
    levels = checkpoint_prefix_levels(items)
    names = levels[-1]  # every shared prefix gone, unless fewer removed match more names
    if known is not None:
        for level in reversed(levels[:-1]):
            if sum(n in known for n in level.values()) > sum(n in known for n in names.values()):
                names = level
    # A key that is no name (an int...) stays as it is, to be reported as not in the EMA.
    others = {} if drop_prefix else {k: v for k, v in state.items() if not isinstance(k, str)}
    return {names[k]: v for k, v in items.items()} | others


def _is_extra_state(key) -> bool:
    """A module's get_extra_state() entry of a model state dict."""
    return isinstance(key, str) and key.rpartition(".")[2] == "_extra_state"


def _starts(key, prefix: str) -> bool:
    return isinstance(key, str) and key.startswith(prefix)


def is_value(value, expected) -> bool:
    """value == expected, for a value read from a checkpoint (a tensor or an array compares
    elementwise: one that is not a single element is not equal)."""
    try:
        return bool(value == expected)
    except (RuntimeError, TypeError, ValueError):
        return False


def _is_own(value) -> bool:
    return isinstance(value, Mapping) and is_value(value.get("format"), FORMAT)


def own_state(state):
    """fused_ema's own state dict when a training checkpoint holds it beside others (the
    getting-started layout: "ema" beside "state_dict" and "state_dict_ema"), else `state`."""
    if isinstance(state, Mapping) and not _is_own(state):
        inner = [v for v in state.values() if _is_own(v)]
        if len(inner) == 1:
            return inner[0]
    return state


def parse_checkpoint(state, known=None) -> ParsedCheckpoint:
    """Recognises the format of `state` and extracts weights, step and schedule from it; `known`,
    the EMA's names, when given, decides between a model state dict's names with and without a
    prefix that every key carries."""
    if not isinstance(state, Mapping):  # (own_state() unwrapped a training checkpoint's own)
        return ParsedCheckpoint(
            "unknown", problems=[f"expected a dict (a state_dict), got {type(state).__name__}"]
        )
    keys, problems = set(state), []

    def parsed(kind: str, weights=None, step=None, key: str = "", **extra) -> ParsedCheckpoint:
        """A checkpoint of format `kind`, its step read from its entry `key`."""
        return ParsedCheckpoint(
            kind, weights, step=_as_step(step, key, problems), problems=problems, **extra
        )

    if _is_own(state):
        version = state.get("format_version")
        if not is_value(version, FORMAT_VERSION):
            problems.append(
                f"fused_ema checkpoint format_version {version!r} is not "
                f"{FORMAT_VERSION}, the one this version reads"
            )
        weights = state.get("weights")
        if not isinstance(weights, Mapping):
            problems.append("'weights' is missing or not a dict")
            weights = {}
        step, schedule, filters = state.get("step"), state.get("schedule"), state.get("filters")
        return parsed(
            "fused_ema",
            dict(weights),
            step,
            "step",
            schedule=schedule,
            filters=filters,
            partition=state.get("zero3_partition"),
        )
    own = [k for k, v in state.items() if _is_own(v)]
    if len(own) > 1:
        problems.append(
            f"it holds {len(own)} fused_ema state dicts ({', '.join(map(repr, own))}): pass the "
            "one to load"
        )
        return parsed("unknown")
    if isinstance(state.get(PRETRAINED), Mapping):  # read_source's reading of a folder
        folder = state[PRETRAINED]
        step = folder.get("config", {}).get("optimization_step")
        weights = _by_name(folder["weights"], known=known)
        return parsed("diffusers save_pretrained", weights, step, "optimization_step")
    if isinstance(state.get("averaging_state"), Mapping) and isinstance(
        state.get("state_dict"), Mapping
    ):
        n = state["averaging_state"].get("n_averaged")
        weights = _by_name(state["state_dict"], known=known)
        return parsed("Lightning WeightAveraging", weights, n, "averaging_state.n_averaged")
    for key in ("state_dict_ema", "model_ema"):
        if isinstance(state.get(key), Mapping):
            return parsed("timm checkpoint", _by_name(state[key], known=known))
    if "shadow_params" in keys:
        shadow = state["shadow_params"]
        if not isinstance(shadow, (list, tuple)):
            problems.append(
                f"'shadow_params' should be a list of tensors, got {type(shadow).__name__}"
            )
        key = "optimization_step" if "optimization_step" in keys else "num_updates"
        kind = "torch_ema" if key == "num_updates" else "diffusers EMAModel"
        positional = list(shadow) if not problems else None
        return parsed(kind, None, state.get(key), key, positional=positional)
    if "n_averaged" in keys and any(_starts(k, "module.") for k in keys):
        return parsed(
            "AveragedModel", _by_name(state, "module.", known), state["n_averaged"], "n_averaged"
        )
    if {"initted", "step"} <= keys and any(_starts(k, "ema_model.") for k in keys):
        return parsed("ema-pytorch", _by_name(state, "ema_model.", known), state["step"], "step")
    # A model state dict: tensors by name, torch's `_extra_state` aside (an entry that is no
    # tensor is reported by its name; a nested dict is some other format's).
    entries = [v for k, v in state.items() if not _is_extra_state(k)]
    if any(isinstance(v, torch.Tensor) for v in entries) and not any(
        isinstance(v, Mapping) for v in entries
    ):
        return parsed("state dict", _by_name(state, known=known))
    sample = ", ".join(sorted(map(str, keys))[:8]) or "no keys"
    problems.append(
        f"not an EMA checkpoint fused_ema knows (found {sample}); expected fused_ema's "
        "state_dict, a model state dict, or one of timm, AveragedModel, ema-pytorch, diffusers "
        "EMAModel, torch_ema"
    )
    return parsed("unknown")
