"""ModelEma's constructor arguments, reconciled and checked before anything is built: timm
ModelEmaV3's spellings (use_warmup=, exclude_buffers=) folded into fused_ema's (warmup=,
buffers=), then each option validated in turn. Returns what the parts are made from."""

from __future__ import annotations

import torch

from .._dist.shard import resolve
from .._ext.op_meta import SUPPORTED_DTYPE_PAIRS
from .._model.name_filters import name_filters
from .._model.tracking import EntryPolicy
from .._update.schedule import DEFAULT_WARMUP, check_options, check_rounding

BUFFER_MODES = ("average", "copy", "ignore")
MISMATCH_MODES = ("error", "resync")
# What an EMA tensor can be: the fused kernels average these (a source of another dtype is staged
# into the EMA's); float8 and other floating dtypes would make every update fail.
EMA_DTYPES = tuple(dict.fromkeys(e for e, s in SUPPORTED_DTYPE_PAIRS if e == s))


def check_ema_dtype(dtype, what: str) -> None:
    if dtype not in EMA_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in EMA_DTYPES)
        raise ValueError(
            f"{what} must be a floating dtype the fused kernels average ({names}), got {dtype!r}"
        )


def _timm_defaults(warmup_gamma, warmup_power) -> bool:
    pairs = zip((warmup_gamma, warmup_power), DEFAULT_WARMUP)
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and v == d for v, d in pairs)


def resolve_options(warmup, buffers, schedule, rounding, policy, on_mismatch: str) -> tuple:
    """ModelEma's arguments, grouped by what they configure, checked: (the Schedule's options,
    the rounding setting, the EntryPolicy). Raises the first problem found, naming the argument.

    warmup: (warmup, use_warmup, warmup_gamma, warmup_power), fused_ema's and timm V3's spellings
    buffers: (buffers, exclude_buffers), likewise
    schedule: (decay, min_decay, update_after_step, update_every, update_every_decay)
    rounding: (stochastic_rounding, stochastic_rounding_seed)
    policy: (device, dtype, names, shard), names being copy_names, ignore_names and
        ema-pytorch's two spellings
    """
    warmup, use_warmup, warmup_gamma, warmup_power = warmup
    buffers, exclude_buffers = buffers
    decay, min_decay, update_after_step, update_every, update_every_decay = schedule
    device, dtype, names, shard = policy
    if use_warmup is not None:
        if not isinstance(use_warmup, bool):  # "no" or a tensor would be taken by its truth
            raise ValueError(f"use_warmup must be True, False or None, got {use_warmup!r}")
        if warmup is not False:
            raise ValueError(
                f"give either warmup={warmup!r} or timm's use_warmup={use_warmup!r}, not both"
            )
        warmup = (warmup_gamma, warmup_power) if use_warmup else False
    elif (
        warmup is not False
        and warmup is not None
        and not _timm_defaults(warmup_gamma, warmup_power)
    ):
        # warmup=True or a ramp of its own would drop them silently
        raise ValueError(
            f"warmup_gamma={warmup_gamma!r} and warmup_power={warmup_power!r} go with timm's "
            f"use_warmup=True; with warmup={warmup!r}, give warmup=(gamma, power) instead"
        )
    if exclude_buffers is not None and not isinstance(exclude_buffers, bool):
        raise ValueError(f"exclude_buffers must be True, False or None, got {exclude_buffers!r}")
    if exclude_buffers:
        if buffers == "ignore":
            raise ValueError(
                "exclude_buffers=True copies buffers, buffers='ignore' leaves them out: "
                "give one of them"
            )
        buffers = "copy"
    if buffers not in BUFFER_MODES:
        raise ValueError(f"buffers must be one of {BUFFER_MODES}, got {buffers!r}")
    if on_mismatch not in MISMATCH_MODES:
        raise ValueError(f"on_mismatch must be one of {MISMATCH_MODES}, got {on_mismatch!r}")
    if dtype is not None:
        check_ema_dtype(dtype, "dtype (None or a torch.dtype)")
    options = check_options(
        decay, min_decay, warmup, update_after_step, update_every, update_every_decay
    )
    checked_rounding = check_rounding(*rounding)
    filters = name_filters(*names)
    try:
        where = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError) as err:  # torch's own message does not name the argument
        why = f" ({' '.join(str(err).split())})" if isinstance(device, str) else ""
        raise ValueError(
            f"device must be None, a torch.device or a device string such as 'cpu' or 'cuda:1', "
            f"got {device!r}{why}"
        ) from None
    if where is not None and where.type == "meta":
        raise ValueError("device='meta' would drop the average: the EMA holds values")
    entry_policy = EntryPolicy(where, dtype, buffers, *filters, resolve(shard))
    return options, checked_rounding, entry_policy
