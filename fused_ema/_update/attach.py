"""ema.attach(optimizer): one EMA update per real optimizer step, through the optimizer's step
post-hook (gradient accumulation steps it once per N micro-batches; a GradScaler skips step() on
inf/NaN gradients, or sets found_inf for a fused optimizer, which the hook reads). The hook holds
the EMA and the model weakly: it never keeps them alive, and does nothing once the EMA is gone."""

from __future__ import annotations

import weakref

import torch


class StepHook:
    """The post-hook registered on the optimizer."""

    def __init__(self, ema, model, non_blocking: bool):
        self._ema = weakref.ref(ema)
        self._model = weakref.ref(model) if model is not None else None
        self.non_blocking = non_blocking
        self.handle = None

    def registered(self) -> bool:
        """Whether the optimizer still holds this hook: a removed one stays alive as long as a
        traceback of an error it raised does (an `except` block that removes and re-attaches)."""
        hooks_ref = getattr(self.handle, "hooks_dict_ref", None)
        if hooks_ref is None:  # another optimizer's own handle: alive means registered
            return True
        hooks = hooks_ref()
        return hooks is not None and hooks.get(getattr(self.handle, "id", None)) is self

    def __call__(self, optimizer, args, kwargs) -> None:
        ema = self._ema()
        # A GradScaler sets found_inf (inf/NaN gradients) on optimizers that skip steps by
        # themselves (torch's fused ones) for the duration of step(); reading it costs one sync,
        # as the scaler's own check does.
        found_inf = getattr(optimizer, "found_inf", None)
        if ema is None or self.handle is None:  # gone, or its attach() was interrupted
            return
        if isinstance(found_inf, torch.Tensor) and bool(found_inf):
            return
        model = self._model() if self._model is not None else ema._binding.model_ref()
        if model is None:
            raise RuntimeError(
                "fused_ema: ema.attach(optimizer): the model this EMA follows no longer exists; "
                "remove the handle, or attach again with attach(optimizer, model)"
            )
        ema.update(model, non_blocking=self.non_blocking)


def attach(ema, optimizer, model, non_blocking: bool, live: weakref.WeakSet):
    """Registers the hook; `live` holds the EMA's hooks weakly (a removed hook drops out)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        # A wrapper (accelerate's AcceleratedOptimizer, not initialised as an Optimizer): its
        # step() steps the wrapped one on real steps only (not while accumulating gradients).
        optimizer = inner
    register = getattr(optimizer, "register_step_post_hook", None)
    if register is None:
        raise TypeError(
            f"ema.attach() takes a torch.optim.Optimizer (with register_step_post_hook), got "
            f"{type(optimizer).__name__}"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"ema.attach(optimizer, model): model must be an nn.Module, got {model!r}")
    if not isinstance(non_blocking, bool):
        raise TypeError(f"non_blocking must be True or False, got {non_blocking!r}")
    if any(hook.registered() for hook in list(live)):
        raise RuntimeError(
            "this EMA is already attached to an optimizer: it would update twice per training "
            "step. Call .remove() on the handle the first attach() returned, then attach again."
        )
    hook = StepHook(ema, model, non_blocking)
    try:
        hook.handle = register(hook)  # the hook acts once it holds its handle
        live.add(hook)
        return hook.handle
    except BaseException:  # interrupted: no hook left acting that the caller has no handle of
        if hook.handle is not None:
            hook.handle.remove()
            hook.handle = None
        raise
