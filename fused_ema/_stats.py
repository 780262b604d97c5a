"""ema.stats(): the health of an average (reads device tensors: not for the hot loop)."""

from __future__ import annotations

import math

from ._dtensor import local, sharding
from ._grad import grad_enabled, set_grad_enabled
from ._model_walk import named_tensors
from .ops import lerp_


def ema_stats(entries, step: int, decay: float, configured_decay: float, model=None) -> dict:
    averaged = [e for e in entries if e.average]
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
    stats["untracked"] = sum(1 for n in current if n not in by_name)
    weight = 1.0 - (decay or configured_decay)
    diff2 = ref2 = 0.0
    unchanged = total = 0
    grad = grad_enabled()  # restored whatever happens (see _grad.py)
    try:
        set_grad_enabled(False)
        for e in averaged:
            m = current.get(e.name)
            if m is None or m.tensor.shape != e.ema.shape or sharding(m.tensor) != sharding(e.ema):
                continue
            ema = local(e.ema)
            src = local(m.tensor).detach().to(ema.device)
            diff2 += float((ema.double() - src.double()).square().sum())
            ref2 += float(src.double().square().sum())
            moved = ema.clone()
            lerp_([moved], [src.to(ema.dtype)], weight)
            unchanged += int((moved == ema).sum())
            total += ema.numel()
        stats["model_nan"] = sum(
            int(local(t.tensor).isnan().sum())
            for t in current.values()
            if t.tensor.is_floating_point()
        )
    finally:
        set_grad_enabled(grad)
    stats["relative_distance"] = math.sqrt(diff2 / ref2) if ref2 > 0 else 0.0
    stats["unchanged_fraction"] = unchanged / total if total else 0.0
    return stats
