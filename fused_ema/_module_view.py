"""ema.module for a model that cannot be copied (FSDP2 refuses deepcopy; some models hold locks or
handles): a module that runs the model itself, in eval mode, with the EMA weights swapped in for
the duration of each call, so the model's own structure (sharding included) does the work."""

from __future__ import annotations

import weakref

from torch import nn


class SwappedModelView(nn.Module):
    def __init__(self, ema, model: nn.Module):
        super().__init__()
        # Plain attributes, not submodules: the view has no weights of its own to expose.
        object.__setattr__(self, "_ema", ema)
        object.__setattr__(self, "_model_ref", weakref.ref(model))
        self.train(False)

    def _model(self) -> nn.Module:
        model = self._model_ref()
        if model is None:
            raise RuntimeError(
                "ema.module runs the model with the EMA swapped in, and the model "
                "no longer exists; call ema.resync(model) with the current one"
            )
        return model

    def forward(self, *args, **kwargs):
        model = self._model()
        modes = [(m, m.training) for m in model.modules()]
        model.train(self.training)
        try:
            with self._ema.swapped(model):
                return model(*args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training

    def state_dict(self, *args, **kwargs):
        return dict(self._ema.state_dict()["weights"])

    def extra_repr(self) -> str:
        return f"runs {type(self._model()).__name__} with the EMA weights swapped in"
