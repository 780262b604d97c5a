"""The EMA implementations compared, each behind the same small interface: build from the model,
`prime()` (the first update, a copy for most), `step()` (one constant-decay update) and `ema()`
(name -> EMA tensor, for the correctness check that precedes timing).

Each is configured the way its users would to get a constant-decay EMA kept in the scenario's
EMA dtype and device; where a library cannot do that, it fails here the way it fails for them.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import importlib.util

import torch
from torch import nn

import fused_ema


class Contender:
    name = ""
    package = ""  # an optional import; missing means "not installed"

    def __init__(self, model: nn.Module, decay: float, ema_dtype: torch.dtype, ema_device):
        self.model, self.decay = model, decay
        self.ema_dtype, self.ema_device = ema_dtype, ema_device

    @classmethod
    def available(cls) -> bool:
        return not cls.package or importlib.util.find_spec(cls.package) is not None

    @classmethod
    def applies(cls, model: nn.Module, ema_dtype: torch.dtype) -> str | None:
        """Why this contender does not apply to a scenario, or None."""
        return None

    def prepare(self) -> None:
        """Runs, untimed, before every timed step."""

    def prime(self) -> None:
        self.step()

    def step(self) -> None:
        raise NotImplementedError

    def ema(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class _Lists(Contender):
    """EMA tensors kept as plain lists, one per distinct parameter."""

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        params = dict(model.named_parameters())
        self.names = list(params)
        self.src = [p.detach() for p in params.values()]
        device = ema_device or self.src[0].device
        self.ema_list = [s.to(device=device, dtype=ema_dtype, copy=True) for s in self.src]
        self.same = all(
            s.dtype == ema_dtype and s.device == e.device for s, e in zip(self.src, self.ema_list)
        )

    def ema(self):
        return dict(zip(self.names, self.ema_list))


class FusedOp(_Lists):
    name = "fused_ema.lerp_"

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        self.staging = None
        if any(s.device != e.device for s, e in zip(self.src, self.ema_list)):
            pin = self.ema_list[0].device.type == "cpu"
            self.staging = [
                torch.empty(s.shape, dtype=s.dtype, device=e.device, pin_memory=pin)
                for s, e in zip(self.src, self.ema_list)
            ]

    def step(self):
        src = self.src
        if self.staging is not None:
            for buffer, s in zip(self.staging, self.src):
                buffer.copy_(s, non_blocking=True)
            torch.cuda.synchronize()
            src = self.staging
        fused_ema.lerp_(self.ema_list, src, 1.0 - self.decay)


def _malloc_trim():
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


_MALLOC_TRIM = _malloc_trim()


def _release_freed_memory() -> None:
    """glibc hands large freed blocks back to the OS when they sit at the top of the heap, as an
    EMA's upcast temporaries usually do: the next step's copies then fault in fresh pages. Other
    contenders' allocations, interleaved by the benchmark, can pin the heap and hide that cost at
    random; trimming before each step makes the common case the measured one."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class ForeachLerp(_Lists):
    """What foreach needs for mixed dtypes: an upcast copy of the model, fresh every step."""

    name = "torch._foreach_lerp_"

    def step(self):
        src = self.src
        if not self.same:  # the upcast (or cross-device) copy foreach needs
            src = [s.to(device=e.device, dtype=e.dtype) for s, e in zip(self.src, self.ema_list)]
        torch._foreach_lerp_(self.ema_list, src, 1.0 - self.decay)

    def prepare(self):
        if not self.same and self.ema_list[0].device.type == "cpu":
            _release_freed_memory()


class ForeachLerpReusedUpcast(_Lists):
    """The best an upcast can do: copies into buffers kept from step to step (18 bytes a
    parameter against the fused kernel's 10, and no allocation)."""

    name = "upcast bufs + foreach"

    @classmethod
    def applies(cls, model, ema_dtype):
        if all(p.dtype == ema_dtype for p in model.parameters()):
            return "n/a: no upcast needed"
        return None

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        self.buffers = [torch.empty_like(e) for e in self.ema_list]

    def step(self):
        torch._foreach_copy_(self.buffers, self.src)
        torch._foreach_lerp_(self.ema_list, self.buffers, 1.0 - self.decay)


class LerpLoop(_Lists):
    name = "per-tensor lerp_"

    def step(self):
        weight = 1.0 - self.decay
        for e, s in zip(self.ema_list, self.src):
            e.lerp_(s.to(device=e.device, dtype=e.dtype), weight)


class ModelEmaUpdate(Contender):
    name = "fused_ema.ModelEma"

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        self.averager = fused_ema.ModelEma(model, decay, device=ema_device, dtype=ema_dtype)

    def step(self):
        self.averager.update(self.model)

    def ema(self):
        weights = self.averager.state_dict()["weights"]
        return {n: weights[n] for n, _ in self.model.named_parameters()}


class AveragedModelEma(Contender):
    name = "AveragedModel+ema_fn"

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.averaged = AveragedModel(
            model, device=ema_device, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False
        )
        self.averaged.module.to(ema_dtype)

    def step(self):
        self.averaged.update_parameters(self.model)

    def ema(self):
        return dict(self.averaged.module.named_parameters())


class EmaPytorch(Contender):
    name = "ema-pytorch"
    package = "ema_pytorch"

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        from ema_pytorch import EMA

        ema_model = copy.deepcopy(model).to(dtype=ema_dtype)
        if ema_device is not None:
            ema_model.to(ema_device)
        # min_value = beta: a constant decay after the first (copy) update
        self.averager = EMA(
            model,
            ema_model=ema_model,
            beta=decay,
            min_value=decay,
            update_after_step=0,
            update_every=1,
            include_online_model=False,
            coerce_dtype=True,
            allow_different_devices=ema_device is not None,
        )

    def step(self):
        self.averager.update()

    def ema(self):
        return dict(self.averager.ema_model.named_parameters())


class TorchEma(Contender):
    name = "torch_ema"
    package = "torch_ema"

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        from torch_ema import ExponentialMovingAverage

        self.names = [n for n, _ in model.named_parameters()]
        self.averager = ExponentialMovingAverage(model.parameters(), decay, use_num_updates=False)
        self.averager.to(device=ema_device, dtype=ema_dtype)

    def step(self):
        self.averager.update()

    def ema(self):
        return dict(zip(self.names, self.averager.shadow_params))


class TimmModelEmaV3(Contender):
    name = "timm ModelEmaV3"
    package = "timm"

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        from timm.utils import ModelEmaV3

        self.averager = ModelEmaV3(model, decay=decay, device=ema_device)
        self.averager.module.to(ema_dtype)

    def step(self):
        self.averager.update(self.model)  # no step: timm's constant-decay path

    def ema(self):
        return dict(self.averager.module.named_parameters())


ALL = [
    FusedOp,
    ModelEmaUpdate,
    ForeachLerp,
    ForeachLerpReusedUpcast,
    LerpLoop,
    AveragedModelEma,
    EmaPytorch,
    TorchEma,
    TimmModelEmaV3,
]
BASELINE = ForeachLerp.name
