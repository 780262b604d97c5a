"""ModelEma equals the EMA libraries it replaces, over 200 training steps with their schedules:
an independent implementation of timm ModelEmaV3's documented update (bit for bit), torch's own
AveragedModel with get_ema_multi_avg_fn (bit for bit) and the installed ema-pytorch (which rounds
its decay to float32, hence a float32 tolerance)."""

import copy

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fused_ema
from ema_helpers import TiedNet, small_mlp, train_step

STEPS = 200


class TimmModelEmaV3Reference:
    """timm.utils.model_ema.ModelEmaV3, rewritten from its documented behaviour: a deepcopy,
    get_decay(step) with optional warmup, lerp of floating state entries paired by position,
    copy of the others. Decays in Python float64, as timm does."""

    def __init__(
        self,
        model,
        decay,
        min_decay=0.0,
        update_after_step=0,
        use_warmup=False,
        warmup_gamma=1.0,
        warmup_power=2 / 3,
    ):
        self.module = copy.deepcopy(model).eval()
        self.decay, self.min_decay = decay, min_decay
        self.update_after_step, self.use_warmup = update_after_step, use_warmup
        self.warmup_gamma, self.warmup_power = warmup_gamma, warmup_power

    def get_decay(self, step):
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            return max(min(decay, self.decay), self.min_decay)
        return self.decay

    @torch.no_grad()
    def update(self, model, step):
        decay = self.get_decay(step)
        ema_lerp, model_lerp = [], []
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_lerp.append(ema_v)
                model_lerp.append(model_v)
            else:
                ema_v.copy_(model_v)
        torch._foreach_lerp_(ema_lerp, model_lerp, weight=1.0 - decay)


def assert_same_state(ema: fused_ema.ModelEma, reference_state: dict, exact=True, rtol=0.0):
    ours = ema.state_dict()["weights"]
    assert set(reference_state) <= set(ours) | {"cache"}
    for name, expected in reference_state.items():
        got = ours[name]
        if exact or not expected.is_floating_point():
            assert torch.equal(got, expected.to(got.dtype)), name
        else:
            torch.testing.assert_close(
                got, expected.to(got.dtype), rtol=rtol, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize(
    "settings",
    [
        dict(decay=0.999, use_warmup=True, update_after_step=0),
        dict(
            decay=0.99,
            use_warmup=True,
            warmup_gamma=2.0,
            warmup_power=0.75,
            min_decay=0.2,
            update_after_step=7,
        ),
        dict(decay=0.95, use_warmup=False, update_after_step=3),
    ],
    ids=["warmup", "warmup-delayed", "constant"],
)
def test_equals_timm_model_ema_v3(settings):
    torch.manual_seed(0)
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = TimmModelEmaV3Reference(model, **settings)
    # timm's own keyword spellings work unchanged
    ema = fused_ema.ModelEma(model, **settings)
    g = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):  # timm's train.py passes the 1-based update count
        train_step(model, optimizer, g)
        reference.update(model, step)
        ema.update(model, step=step)
    assert ema.step == STEPS
    assert ema.current_decay == reference.get_decay(STEPS)
    assert_same_state(ema, reference.module.state_dict())


def test_equals_averaged_model_with_ema_multi_avg_fn():
    torch.manual_seed(2)
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.98), use_buffers=False)
    ema = fused_ema.ModelEma(model, decay=0.98, buffers="copy")  # AveragedModel copies buffers
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        train_step(model, optimizer, g)
        averaged.update_parameters(model)
        ema.update(model)
    state = {k[len("module.") :]: v for k, v in averaged.state_dict().items() if k != "n_averaged"}
    assert_same_state(ema, state)
    assert ema.step == int(averaged.n_averaged)


def test_equals_ema_pytorch():
    ema_pytorch = pytest.importorskip("ema_pytorch")
    torch.manual_seed(4)
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    theirs = ema_pytorch.EMA(
        model,
        beta=0.995,
        update_after_step=5,
        update_every=1,
        inv_gamma=1.0,
        power=2 / 3,
        min_value=0.1,
        include_online_model=False,
    )
    ours = fused_ema.ModelEma(
        model, decay=0.995, warmup=(1.0, 2 / 3), min_decay=0.1, update_after_step=5
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        train_step(model, optimizer, g)
        theirs.update()
        ours.update(model)
    assert ours.step == int(theirs.step)
    # ema-pytorch leaves integer buffers alone after its first copy; compare what it averages.
    state = {k: v for k, v in theirs.ema_model.state_dict().items() if v.is_floating_point()}
    assert_same_state(ours, state, exact=False, rtol=2e-6)


def test_tied_weights_are_averaged_once():
    # timm pairs state_dict entries by position, so a tied weight (listed under two names) is
    # lerped twice per step there. ModelEma averages each distinct tensor once.
    torch.manual_seed(6)
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, decay=0.9)
    reference = model.embed.weight.detach().double().clone()
    g = torch.Generator().manual_seed(7)
    for step in range(1, 30):
        train_step(model, optimizer, g)
        ema.update(model)
        weight = 1.0 if step == 1 else 0.1
        reference += weight * (model.embed.weight.detach().double() - reference)
    weights = ema.state_dict()["weights"]
    assert weights["embed.weight"] is not None and "head.weight" in weights
    assert weights["head.weight"].data_ptr() == weights["embed.weight"].data_ptr()
    torch.testing.assert_close(weights["embed.weight"].double(), reference, rtol=1e-6, atol=1e-7)
