"""ema.stats(): the health of an average (reads device tensors: not for the hot loop)."""

from __future__ import annotations

import math

from .._dist.dtensor import local, sharding
from .._ext.grad import without_grad
from .._model.walk import named_tensors
from ..ops import SUPPORTED_DTYPE_PAIRS, lerp_, refuse_freed


def ema_stats(
    entries, step: int, decay: float, configured_decay: float, model=None, every: int = 1
) -> dict:
    """`every`: the power of the per-step decay an averaging update applies (update_every=k,
    compensated: decay ** k, the weight unchanged_fraction is measured with)."""
    averaged = [e for e in entries if e.average]
    refuse_freed([(e.name, e.ema) for e in entries], "the EMA's")  # read below
    stats = {
        "step": step,
        "decay": decay,
        "window": math.inf if decay >= 1.0 else 1.0 / (1.0 - decay),
        "tracked": len(entries),
        "averaged": len(averaged),
        "copied": len(entries) - len(averaged),
        "ema_nan": sum(int(local(e.ema).isnan().sum()) for e in averaged),
        "ema_inf": sum(int(local(e.ema).isinf().sum()) for e in averaged),
    }
    if model is None:
        return stats
    by_name = {n for e in entries for n in e.names}
    current = {n: t for t in named_tensors(model, True) for n in t.names}
    refuse_freed([(n, t.tensor) for n, t in current.items()], "the model's")
    stats["untracked"] = sum(1 for n in current if n not in by_name)
    weight = 1.0 - (decay or configured_decay) ** every
    diff2, ref2, unchanged, total = without_grad(_compared, averaged, current, weight)
    stats["model_nan"] = sum(
        int(local(t.tensor).isnan().sum()) for t in current.values() if t.tensor.is_floating_point()
    )
    stats["relative_distance"] = _relative(diff2, ref2)
    stats["unchanged_fraction"] = unchanged / total if total else 0.0
    return stats


def _relative(diff2: float, ref2: float) -> float:
    """sqrt(diff2 / ref2): NaN where a NaN or infinity made either NaN (never masked as 0), 0 for
    an EMA equal to an all-zero model and inf for one that is not."""
    if math.isnan(diff2) or math.isnan(ref2) or math.isinf(ref2):
        return math.nan
    if ref2 == 0:
        return 0.0 if diff2 == 0 else math.inf
    return math.sqrt(diff2 / ref2)


def _compared(averaged, current: dict, weight: float) -> tuple:
    """The squared distance of the EMA to the model, the model's squared norm, and how many
    averaged elements one more update would leave unchanged, of how many."""
    diff2 = ref2 = 0.0
    unchanged = total = 0
    for e in averaged:
        m = current.get(e.name)
        if m is None or m.tensor.shape != e.ema.shape or sharding(m.tensor) != sharding(e.ema):
            continue
        ema = local(e.ema)
        src = local(m.tensor).detach().to(ema.device)
        diff2 += float((ema.double() - src.double()).square().sum())
        ref2 += float(src.double().square().sum())
        moved = ema.clone()
        if (ema.dtype, src.dtype) not in SUPPORTED_DTYPE_PAIRS:  # as the update stages it
            src = src.to(ema.dtype)
        lerp_([moved], [src], weight)
        unchanged += int((moved == ema).sum())
        total += ema.numel()
    return diff2, ref2, unchanged, total
