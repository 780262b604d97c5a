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
import inspect

import torch
from torch import nn

import fused_ema

from . import peers


class Contender:
    name = ""
    package = ""  # an optional import; missing means "not installed"
    checked = True  # its update is checked against the float64 reference before it is timed
    stochastic_rounding = False  # rounds a 16-bit EMA stochastically (and is checked for it)
    note = ""  # appended to a failed check: what the library is known to do here

    def __init__(self, model: nn.Module, decay: float, ema_dtype: torch.dtype, ema_device):
        self.model, self.decay = model, decay
        self.ema_dtype, self.ema_device = ema_dtype, ema_device

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this contender cannot run at all here (a library not installed, an API not yet
        written), or None."""
        if cls.package and importlib.util.find_spec(cls.package) is None:
            return f"skipped: {cls.package} not installed"
        return None

    @classmethod
    def available(cls) -> bool:
        return cls.unavailable() is None

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


class FlatFloor(Contender):
    """The floor: fused_ema.lerp_ over one flat tensor with as many elements as the model has
    parameters (the model's dtype, the EMA's dtype and device): an update's bytes with no
    per-tensor work. Its data is its own (it averages no model tensor), so it is not checked."""

    name = "flat floor (lerp_, 1 tensor)"
    checked = False

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        params = list(model.parameters())
        device = ema_device or params[0].device
        g = torch.Generator().manual_seed(0)
        numel = sum(p.numel() for p in params)
        self.src = (torch.randn(numel, generator=g) * 0.02).to(device, params[0].dtype)
        self.flat = (torch.randn(numel, generator=g) * 0.02).to(device, ema_dtype)

    def step(self):
        fused_ema.lerp_([self.flat], [self.src], 1.0 - self.decay)


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
        options = {}
        if "stochastic_rounding" in inspect.signature(fused_ema.ModelEma).parameters:
            options = {"stochastic_rounding": self.stochastic_rounding}
            if self.stochastic_rounding:
                options["stochastic_rounding_seed"] = 0
        self.averager = fused_ema.ModelEma(
            model, decay, device=ema_device, dtype=ema_dtype, **options
        )

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
    """The installed timm's real ModelEmaV3, loaded from timm/utils/model_ema.py alone
    (benchmarks/peers.py: `import timm` would import torchvision). Configured as its users
    would: dtype= for the EMA dtype (an fp32 EMA of a bf16 model takes its mul_ + add_ path),
    stochastic rounding off except in the stochastic contender below. timm pairs state_dict
    entries by position, so a tied weight (listed twice) is averaged twice a step: the
    correctness check reports that for the tied-embedding LM."""

    name = "timm ModelEmaV3"

    @classmethod
    def unavailable(cls):
        reason = peers.timm_missing(stochastic_rounding=cls.stochastic_rounding)
        return f"skipped: {reason}" if reason else None

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        model_ema = peers.load_timm_model_ema()
        keywords = inspect.signature(model_ema.ModelEmaV3).parameters
        options = {"dtype": ema_dtype, "stochastic_rounding": self.stochastic_rounding}
        options = {k: v for k, v in options.items() if k in keywords}
        self.averager = model_ema.ModelEmaV3(model, decay=decay, device=ema_device, **options)
        pointers = [v.data_ptr() for v in model.state_dict().values()]
        if len(set(pointers)) < len(pointers):
            self.note = "timm lerps a tied weight once per state_dict name: twice a step"
        if "dtype" not in options:  # timm before 1.0.31
            self.averager.module.to(ema_dtype)

    def step(self):
        self.averager.update(self.model)  # no step: timm's constant-decay path

    def ema(self):
        return dict(self.averager.module.named_parameters())


def _not_16_bit(ema_dtype) -> str | None:
    if ema_dtype not in (torch.bfloat16, torch.float16):
        return "n/a: stochastic rounding is for bf16/fp16 EMAs"
    return None


class TimmModelEmaV3Stochastic(TimmModelEmaV3):
    """timm 1.0.31's default for a bf16 EMA: `_lerp_stochastic_round_bf16_` (float32 update,
    random low bits from torch.randint, truncation), in chunks of 4M elements."""

    name = "timm ModelEmaV3 SR"
    stochastic_rounding = True

    @classmethod
    def applies(cls, model, ema_dtype):
        return None if ema_dtype == torch.bfloat16 else "n/a: timm rounds only bf16 stochastically"


class FusedStochastic(_Lists):
    """The planned fused op: lerp in float32, stochastic rounding to the EMA dtype with random
    bits hashed from (seed, step, element index, tensor key)."""

    name = "fused_ema.lerp_stochastic_"
    stochastic_rounding = True

    @classmethod
    def unavailable(cls):
        reason = peers.fused_stochastic_missing()
        return f"skipped: {reason}" if reason else None

    @classmethod
    def applies(cls, model, ema_dtype):
        return _not_16_bit(ema_dtype)

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, ema_dtype, ema_device)
        self.t = 0

    def step(self):
        self.t += 1
        fused_ema.lerp_stochastic_(self.ema_list, self.src, 1.0 - self.decay, seed=0, step=self.t)


class ModelEmaStochastic(ModelEmaUpdate):
    """ModelEma(model, decay, dtype=torch.bfloat16, stochastic_rounding=True,
    stochastic_rounding_seed=0), once ModelEma has those keywords."""

    name = "fused_ema.ModelEma SR"
    stochastic_rounding = True

    @classmethod
    def unavailable(cls):
        reason = peers.model_ema_stochastic_missing()
        return f"skipped: {reason}" if reason else None

    @classmethod
    def applies(cls, model, ema_dtype):
        return _not_16_bit(ema_dtype)


ALL = [
    FusedOp,
    ModelEmaUpdate,
    FlatFloor,
    ForeachLerp,
    ForeachLerpReusedUpcast,
    LerpLoop,
    AveragedModelEma,
    EmaPytorch,
    TorchEma,
    TimmModelEmaV3,
    FusedStochastic,
    ModelEmaStochastic,
    TimmModelEmaV3Stochastic,
]
BASELINE = ForeachLerp.name
