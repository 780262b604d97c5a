"""Reading EMA checkpoints: fused_ema's own format and those of the EMA libraries people migrate
from (each format and what it is recognised by: docs/checkpoints.md), so a switch to fused_ema
keeps the average a run has built up. atomic_write is the crash-safe write of every file fused_ema
writes (snapshots, the posthoc command's output, ema.pt)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._dist import zero3
from ._dist.dtensor import is_dtensor, local
from ._model.name_filters import check_name_patterns
from ._model.walk import checkpoint_prefix_levels
from ._update.schedule import MAX_STEP, options_from_state, whole_number
from .errors import CheckpointError
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


PRETRAINED = "fused_ema: save_pretrained folder"  # read_source's wrapping of a folder
# The weights of a save_pretrained folder (diffusers, transformers), preferred first.
_WEIGHT_FILES = (
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.bin",
    "pytorch_model.bin",
)


def read_source(state, source: str) -> tuple[object, str]:
    """A load_state_dict argument: a checkpoint as it is, or a path: a file read onto the CPU (the
    EMA maps tensors to its own devices later), a directory as a save_pretrained folder (diffusers
    EMAModel.save_pretrained); with the name of where it came from, for errors. A file that
    cannot be read is a CheckpointError."""
    if not isinstance(state, (str, os.PathLike)):
        return state, source
    path = os.fspath(state)
    source = f"checkpoint file {path!r}"
    try:
        if os.path.isdir(path):
            return {PRETRAINED: read_pretrained_folder(path)}, source
        return _read_weights(path), source
    except Exception as err:
        raise CheckpointError([f"could not read it: {type(err).__name__}: {err}"], source) from err


def _read_weights(path: str) -> dict:
    """A safetensors file, or torch.load (weights only) of any other."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    # timm's training checkpoints hold its argparse.Namespace of arguments (as timm's own loader
    # allows): a plain attribute bag, no code.
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def read_pretrained_folder(path) -> dict:
    """config.json (where diffusers keeps the EMA's optimization_step) and the weights of a
    save_pretrained folder, whole or sharded (an *.index.json naming the shards)."""
    files = sorted(os.listdir(path))
    config = {}
    if "config.json" in files:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("config.json does not hold a JSON object")
    for name in _WEIGHT_FILES:
        if f"{name}.index.json" in files:
            with open(os.path.join(path, f"{name}.index.json")) as f:
                index = json.load(f)
            files_of = index.get("weight_map") if isinstance(index, dict) else None
            shards = list(files_of.values()) if isinstance(files_of, dict) else []
            if not shards or not all(
                isinstance(s, str) and os.path.basename(s) == s for s in shards
            ):
                raise ValueError(
                    f"{name}.index.json: its 'weight_map' should map names to shard files of the "
                    f"folder, got {files_of!r:.200}"
                )
            shards = sorted(set(shards))
        elif name in files:
            shards = [name]
        else:
            continue
        parts = [_read_weights(os.path.join(path, shard)) for shard in shards]
        return {"config": config, "weights": {k: v for part in parts for k, v in part.items()}}
    raise FileNotFoundError(
        f"no weights in the folder: expected one of {', '.join(_WEIGHT_FILES)} (or its "
        f"sharded .index.json), found {', '.join(files) or 'nothing'}"
    )


def atomic_write(path, write) -> None:
    """`write(temporary)` to a temporary file beside `path` (".{name}.tmp-..."), fsync'd, then
    os.replace'd onto `path` and the folder fsync'd: `path` is either absent, its old self, or
    complete. On an exception the temporary file is removed."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(str(temporary))
        _fsync(temporary, os.O_RDWR)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # (Windows cannot open a folder to sync it)
        _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- loading into an EMA


class LoadResult(tuple):
    """What load_state_dict matched; with strict=False the unmatched parts are listed here. It
    unpacks as torch's result does, ``missing, unexpected = ema.load_state_dict(...)``, and also
    names the `format` it recognised and the `mismatched_keys` (wrong shape, dtype or values)."""

    def __new__(cls, format: str, missing_keys: list, unexpected_keys: list, mismatched_keys: list):
        result = super().__new__(cls, (missing_keys, unexpected_keys))
        result.format, result.mismatched_keys = format, mismatched_keys
        return result

    missing_keys = property(lambda self: self[0])
    unexpected_keys = property(lambda self: self[1])

    def __getnewargs__(self):  # pickle and copy
        return self.format, *self, self.mismatched_keys

    def __eq__(self, other):
        if not isinstance(other, LoadResult):
            return tuple.__eq__(self, other)
        return (*self, self.format, self.mismatched_keys) == (
            *other,
            other.format,
            other.mismatched_keys,
        )

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None

    def __repr__(self) -> str:
        return (
            f"LoadResult(format={self.format!r}, missing_keys={self[0]!r}, "
            f"unexpected_keys={self[1]!r}, mismatched_keys={self.mismatched_keys!r})"
        )


@dataclass
class PreparedLoad:
    """A checkpoint checked against an EMA and converted to its devices and dtypes: applying it
    cannot fail on bad data, so a failed load changes nothing."""

    values: list  # (entry, tensor ready to copy into it)
    step: int | None
    options: dict | None
    result: LoadResult
    problems: list[str]  # one per mismatched key (those strict=False leaves out)


def tensor_problem(name: str, tensor, ema: torch.Tensor) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"{name}: expected a tensor, got {type(tensor).__name__}"
    if tensor.is_meta:
        return f"{name}: a meta tensor holds no values"
    if ema.is_meta:  # loaded "into" it, the values would be dropped without a word
        return (
            f"{name}: this EMA's tensor is on meta (made from a meta-device model) and can hold no "
            "values; call ema.resync(model) once the model is materialised, then load"
        )
    if tensor.layout != torch.strided or tensor.is_nested:
        kind = "nested" if tensor.is_nested else str(tensor.layout)
        return f"{name}: a {kind} tensor; the EMA holds dense (strided) tensors"
    if tensor.is_quantized:
        return f"{name}: a quantized tensor cannot be stored in the EMA's {ema.dtype}"
    if tuple(tensor.shape) != tuple(ema.shape):
        return f"{name}: shape {list(tensor.shape)} does not match the EMA's {list(ema.shape)}"
    kind = (tensor.is_floating_point(), tensor.is_complex())
    if kind != (ema.is_floating_point(), ema.is_complex()):
        return f"{name}: dtype {tensor.dtype} cannot be stored in the EMA's {ema.dtype}"
    return _storage_problem(name, local(tensor)) or _range_problem(name, local(tensor), ema)


def _storage_problem(name: str, tensor: torch.Tensor) -> str | None:
    """A tensor whose storage is smaller than its elements reach (freed by resize_(0), as FSDP
    and ZeRO-3 do to a parameter outside its gather): reading it would crash the process."""
    short = storage_shortfall(tensor)
    if short is None:
        return None
    return (
        f"{name}: its storage holds {short[0]} of the {short[1]} bytes its elements need (freed? "
        "FSDP and ZeRO-3 free a parameter's storage outside its gather)"
    )


def _range_problem(name: str, tensor: torch.Tensor, ema: torch.Tensor) -> str | None:
    """Values that the EMA's dtype cannot hold: integers the copy would wrap, finite floats it
    would make infinite (float32 past 65504 into a float16 EMA; a complex one's parts alike)."""
    if tensor.dtype == ema.dtype or tensor.numel() == 0:
        return None
    if ema.is_floating_point() or ema.is_complex():
        part = ema.dtype.to_real()  # a complex number's real and imaginary parts
        if torch.finfo(part).max >= torch.finfo(tensor.dtype.to_real()).max:
            return None
        values = tensor.detach()
        values = torch.view_as_real(values) if values.is_complex() else values
        overflow = torch.isinf(values.to(part)) & torch.isfinite(values)
        if not overflow.any():
            return None
        most = values[overflow].abs().max().item()
        return (
            f"{name}: values up to {most:g} in magnitude do not fit the EMA's {ema.dtype} (largest "
            f"{torch.finfo(part).max:g}{' a part' if ema.is_complex() else ''}): they would "
            "become infinite"
        )
    if ema.dtype == torch.bool:
        low, high = 0, 1
    else:
        low, high = torch.iinfo(ema.dtype).min, torch.iinfo(ema.dtype).max
    values = tensor.detach()
    unsigned = values.dtype in (torch.uint16, torch.uint32, torch.uint64)
    if unsigned:  # no min/max of their own
        values = values.long()
    least, most = int(values.min().item()), int(values.max().item())
    if unsigned and least < 0:  # a uint64 past 2**63 - 1 reads negative as an int64
        return f"{name}: values past {2**63 - 1} do not fit the EMA's {ema.dtype}: they would wrap"
    if low <= least and most <= high:
        return None
    return (
        f"{name}: values in [{least}, {most}] do not fit the EMA's {ema.dtype} (range [{low}, "
        f"{high}]): the copy would wrap them"
    )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, NaN equal to NaN: a tied weight that went NaN is still one tensor."""
    floating = a.is_floating_point()
    return torch.equal(a, b) or (floating and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _converted(entry, tensor: torch.Tensor) -> torch.Tensor:
    if is_dtensor(entry.ema) or is_dtensor(tensor):
        return tensor  # resharded while it is copied in (see _dist/dtensor.py copy_into)
    return tensor.detach().to(device=local(entry.ema).device, dtype=entry.ema.dtype)


def filter_problems(
    saved, policy, remedy: str = "strict=False loads the tensors the two share"
) -> list[str]:
    """A fused_ema checkpoint saved with other name filters than this EMA's (a list of one
    problem, ending in `remedy` when there is one)."""
    if saved is None:
        return []
    mine = policy.filters()
    try:
        if not isinstance(saved, Mapping) or set(saved) != set(mine):
            raise ValueError(f"expected copy_names and ignore_names, got {saved!r}")
        saved = {k: list(check_name_patterns(k, saved[k])) for k in mine}
    except ValueError as err:
        return [f"filters: {err}"]
    if all(set(saved[k]) == set(mine[k]) for k in mine):
        return []
    return [
        f"saved with copy_names={list(saved['copy_names'])}, "
        f"ignore_names={list(saved['ignore_names'])}; this EMA has "
        f"copy_names={mine['copy_names']}, ignore_names={mine['ignore_names']}"
        + (f" ({remedy})" if remedy else "")
    ]


def _partition_problems(saved, here: dict | None) -> list[str]:
    """Why a checkpoint of the ZeRO-3 partitions of `saved` ({"rank", "world"}, or None: not one)
    cannot load as slices into an EMA holding those of `here` (None: it loads none): each rank's
    partitions load back on that rank only, though their shapes may match another's."""
    if saved is None:
        return []
    fields = isinstance(saved, Mapping) and set(saved) == {"rank", "world"}
    if not fields or not all(type(v) is int for v in saved.values()):
        return [f"'zero3_partition' should be {{'rank': int, 'world': int}}, got {saved!r}"]
    if here is None or saved == here:
        return []
    return [
        f"it holds the ZeRO-3 partitions of rank {saved['rank']} of {saved['world']}, and this "
        f"is rank {here['rank']} of {here['world']}: a checkpoint saved per rank loads at the "
        "same world size and rank, a whole one (full_state_dict()) at any"
    ]


def prepare_load(
    table,
    state,
    strict: bool,
    source: str,
    policy,
    step: int | None,
    options: dict,
    param_names: list[str] | None = None,
) -> PreparedLoad:
    """Checks `state` against the EMA's entries and converts its tensors; raises one
    CheckpointError listing every problem, before anything of the EMA changes. Keys that the
    EMA's ignore_names (`policy`) leave out are skipped. `options` are the EMA's current schedule
    options. The EMA continues from `step` (validated) when given, else the checkpoint's, else
    (timm's checkpoints and plain state dicts store none) update_after_step + 1, the step of the
    copy that starts an average: the next update averages, as the peer would have.
    `param_names`: the bound model's parameters in order, those ignore_names leaves out included
    (what torch_ema and diffusers hold in order), when it is known."""
    parsed = parse_checkpoint(state, table.by_name)
    fatal = list(parsed.problems)  # nothing can be loaded while any of these stands
    weights = parsed.weights or {}
    if parsed.positional is not None:  # the model's parameters, in order
        params = param_names or [e.name for e in table.entries if e.kind == "param"]
        weights = dict(zip(params, parsed.positional))
        if len(parsed.positional) != len(params):
            fatal.append(
                f"it holds {len(parsed.positional)} parameters in order but the model has "
                f"{len(params)}"
                if param_names or not policy.ignore
                else f"it holds {len(parsed.positional)} parameters in order, and the EMA follows "
                f"{len(params)} (ignore_names leaves some out): their positions in the model are "
                "known once the EMA follows it again (a copy or unpickled EMA: ema.update(model) "
                "or ema.resync(model) first)"
            )
            weights = {}
    if policy.ignore:
        weights = {k: v for k, v in weights.items() if not policy.ignore_filter(k)}
    new_options = None
    if parsed.schedule is not None:
        try:
            new_options = options_from_state(parsed.schedule)
        except (TypeError, ValueError) as err:
            fatal.append(f"schedule: {err}")
    pairs, problems, mismatched, covered = [], [], [], {}
    sliced = False  # whether it gives a ZeRO-3 partitioned entry a slice (not its whole shape)
    for name, tensor in weights.items():
        entry = table.by_name.get(name)
        if entry is None:
            continue
        bound = entry.bound()
        partitioned = bound is not None and zero3.is_zero3(bound)
        if (
            partitioned
            and isinstance(tensor, torch.Tensor)
            and tensor.shape == bound.ds_shape != entry.ema.shape  # the EMA holds a slice
        ):
            tensor = zero3.take_partition(tensor, bound)  # a whole (unsharded) checkpoint's value
        elif partitioned and isinstance(tensor, torch.Tensor) and tensor.shape != bound.ds_shape:
            sliced = True
        problem = tensor_problem(name, tensor, entry.ema)
        if problem and partitioned:
            problem += (
                f" (this rank's ZeRO-3 partition of a parameter of shape {list(bound.ds_shape)}: "
                "a checkpoint saved per rank loads at the same world size and rank, a whole one "
                "(full_state_dict()) at any)"
            )
        first_name, first, first_fit = covered.setdefault(id(entry), (name, tensor, not problem))
        # A tied weight's other names hold the first's values (unless that one is reported); shards
        # of one tie are not compared: each rank holds only its own.
        tied = not problem and first_fit and first is not tensor
        if tied and not (is_dtensor(tensor) or is_dtensor(first)):
            if tensor.dtype != first.dtype:
                problem = (
                    f"{name}: tied to {first_name} in this EMA, but the two have different dtypes "
                    f"({tensor.dtype}, {first.dtype})"
                )
            elif not _same_values(tensor.to(first.device), first):
                problem = (
                    f"{name}: tied to {first_name} in this EMA, but the two hold different values"
                )
        if problem:
            problems.append(problem)
            mismatched.append(name)
        elif first_name == name or not first_fit:  # the first name of the tie that fits
            covered[id(entry)] = (name, tensor, True)
            pairs.append((entry, tensor))
    fatal += _partition_problems(parsed.partition, zero3.holder(table.entries) if sliced else None)
    missing = [e.name for e in table.entries if id(e) not in covered]
    unexpected = [k for k in weights if k not in table.by_name]
    listed = fatal + problems
    if strict:
        listed += filter_problems(parsed.filters, policy)
        if parsed.format == "fused_ema" and step is None and state.get("step") is None:
            # fused_ema always saves its step: without it the EMA would silently restart.
            listed.append(
                "'step' is missing (fused_ema saves it; strict=False loads without it, as started, "
                "or pass step=N)"
            )
        listed += [f"missing from the checkpoint: {k}" for k in missing]
        listed += [f"not in this EMA: {k}" for k in unexpected]
    if fatal or (strict and listed):
        raise CheckpointError(listed, source)
    try:
        values = [(entry, _converted(entry, tensor)) for entry, tensor in pairs]
    except Exception as err:  # out of memory, a device that is not there...
        raise CheckpointError(
            [f"could not move its tensors to the EMA's devices: {type(err).__name__}: {err}"],
            source,
        ) from err
    if not strict and not values and table.entries:
        # Nothing loads: the EMA keeps its step and schedule too (a step given here is still
        # taken), so that it never holds the weights of one run at the step of another.
        result = LoadResult(parsed.format, missing, unexpected, mismatched)
        return PreparedLoad([], step, None, result, problems)
    options = new_options or options
    if step is None:
        step = parsed.step
    if step is None:
        step = min(options["update_after_step"] + 1, MAX_STEP)
        if options["warmup"] is not None:
            warnings.warn(
                f"fused_ema: this {parsed.format} stores no step, so the EMA loads at step {step} "
                "(started): with warmup on, the next update uses the warmup's first decay. Pass "
                "load_state_dict(..., step=N) or update(model, step=N) with the run's step count.",
                UserWarning,
                stacklevel=4,  # the caller of load_state_dict
            )
    result = LoadResult(parsed.format, missing, unexpected, mismatched)
    return PreparedLoad(values, step, new_options, result, problems)
