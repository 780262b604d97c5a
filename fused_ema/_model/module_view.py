"""ema.module: an eval-mode nn.Module evaluating the EMA weights. A copy of the model's structure
whose tensors are the EMA's own (its non-persistent buffers the model's, where on its device), or,
for a model deepcopy refuses (FSDP2, locks, handles), a view that runs the model with the EMA
swapped in per call. Both hold the EMA weakly, so `del ema` frees it at once."""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from .._ext.grad import outside_inference_mode
from .tracking import average_dtype, unbound


class EmaForwardCheck:
    """Forward pre-hook of ema.module: waits for a non_blocking update in flight, and refuses to
    run while swapped() has put the model's weights into the EMA tensors."""

    def __init__(self, ema):
        self._ema = weakref.ref(ema)

    def __call__(self, module, args):
        ema = self._ema()
        if ema is not None:
            ema._updater.ready(
                error="ema.module(...) inside `with ema.swapped(model)`: the EMA tensors hold the "
                "model's weights until the block ends; inside it, call the model itself"
            )

    def __getstate__(self):
        return {"_ema": unbound}  # a pickled copy of the module no longer belongs to an EMA


@outside_inference_mode  # its copies are written by BatchNorm (ema.train()) and ema.to()
def build_module(ema, entries, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The model's module tree with the EMA tensors standing in for its own (a deepcopy whose
    memo already holds them), in the EMA's mode (eval unless ema.train()), without gradients.
    A non-persistent buffer (a rotary or mask cache: derived, never averaged) is the model's own
    tensor where the EMA keeps the model's tensors of its device on that device, else one copy
    on the device the EMA moved them to (a CPU EMA of a CUDA model). A tensor the EMA leaves out
    (ignore_names, buffers="ignore") is a copy on that device too, a floating one in the dtype
    the EMA averages it in (`dtype`, the EMA's dtype=), so that the module runs."""
    memo, devices = {}, {}
    for entry in entries:
        source = entry.bound()
        if source is not None:
            memo[id(source)] = entry.ema
            devices.setdefault(source.device, entry.ema.device)
    for owner in model.modules():
        derived = owner._non_persistent_buffers_set
        for store in (owner._parameters, owner._buffers):
            for name, t in store.items():
                if t is None or id(t) in memo:
                    continue
                device = devices.get(t.device, t.device)
                if store is owner._buffers and name in derived:  # the model's own, or one copy
                    same = device == t.device
                    memo[id(t)] = (
                        t if same else t.detach().to(device).requires_grad_(t.requires_grad)
                    )
                    continue
                to = average_dtype(t, dtype) if t.is_floating_point() else t.dtype
                if not t.is_meta and (device, to) != (t.device, t.dtype):
                    moved = t.detach().to(device=device, dtype=to)
                    param = isinstance(t, nn.Parameter)
                    memo[id(t)] = nn.Parameter(moved, t.requires_grad) if param else moved
    try:
        module = copy.deepcopy(model, memo).train(ema.training).requires_grad_(False)
    except Exception:  # FSDP2, or something else deepcopy cannot copy
        return SwappedModelView(ema, model)
    module.register_forward_pre_hook(EmaForwardCheck(ema))
    return module


class SwappedModelView(nn.Module):
    def __init__(self, ema, model: nn.Module):
        super().__init__()
        # Plain attributes, not submodules: the view has no weights of its own to expose.
        object.__setattr__(self, "_ema_ref", weakref.ref(ema))
        object.__setattr__(self, "_model_ref", weakref.ref(model))
        self.train(ema.training)

    def _ema(self):
        ema = self._ema_ref()
        if ema is None:
            raise RuntimeError("the ModelEma this view belongs to no longer exists")
        return ema

    def forward(self, *args, **kwargs):
        model = self._model_ref()
        if model is None:
            raise RuntimeError(
                "ema.module runs the model with the EMA swapped in, and the model "
                "no longer exists; call ema.resync(model) with the current one"
            )
        ema = self._ema()
        modes = [(m, m.training) for m in model.modules()]
        model.train(self.training)
        try:
            with ema.swapped(model):
                return model(*args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training

    def state_dict(self, *args, **kwargs):
        return dict(self._ema().state_dict()["weights"])

    def __getstate__(self):
        raise TypeError(
            "ema.module of a model that cannot be copied (FSDP2) runs the live model with the EMA "
            "swapped in and cannot be pickled; save ema.state_dict() or ema.full_state_dict()"
        )

    def extra_repr(self) -> str:
        model = self._model_ref()
        name = type(model).__name__ if model is not None else "a model that no longer exists"
        return f"runs {name} with the EMA weights swapped in"
