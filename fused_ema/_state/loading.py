"""Loading into an EMA: a parsed checkpoint (checkpoint.py) checked against the EMA's tensors,
names, schedule and partition, and converted to its devices and dtypes (prepare_load), so that
applying it cannot fail on bad data; LoadResult, what load_state_dict returns."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .._dist import zero3
from .._dist.dtensor import is_dtensor, local
from .._model.name_filters import check_name_patterns
from .._update.schedule import MAX_STEP, options_from_state
from ..checkpoint import parse_checkpoint
from ..errors import CheckpointError
from ..ops import storage_shortfall


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
