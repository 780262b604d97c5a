"""ModelEma's schedule options that reproduce a peer's own: diffusers' get_decay (both its warmups,
min_decay, update_after_step), torch_ema's num_updates ramp and ema-pytorch's plain update_every,
each against the real package (skipped, saying why, where it is missing)."""

import random

import pytest
import torch

import fused_ema
from benchmarks import peers as peer_access
from ema_helpers import small_mlp, train_step
from peers import peer


def decays(ema, model, steps):
    """current_decay after each of `steps` updates counted by the EMA."""
    out = []
    for _ in range(steps):
        ema.update(model)
        out.append(ema.current_decay)
    return out


DIFFUSERS_SETTINGS = [
    dict(decay=0.9999, min_decay=0.0, update_after_step=0, use_ema_warmup=False),
    dict(decay=0.995, min_decay=0.3, update_after_step=7, use_ema_warmup=False),
    dict(decay=0.5, min_decay=0.0, update_after_step=2, use_ema_warmup=False),
    dict(decay=0.999, min_decay=0.0, update_after_step=0, use_ema_warmup=True),
    dict(
        decay=0.99,
        min_decay=0.2,
        update_after_step=5,
        use_ema_warmup=True,
        inv_gamma=2.5,
        power=0.75,
    ),
]


@pytest.mark.parametrize("settings", DIFFUSERS_SETTINGS, ids=lambda s: str(sorted(s.items())))
def test_diffusers_get_decay_bit_for_bit(settings):
    training_utils = peer(peer_access.load_diffusers)
    model = small_mlp()
    theirs = training_utils.EMAModel(model.parameters(), **settings)
    warmup = "diffusers"
    if settings["use_ema_warmup"]:
        warmup = (settings.get("inv_gamma", 1.0), settings.get("power", 2 / 3))
    ours = fused_ema.ModelEma(
        model,
        settings["decay"],
        warmup=warmup,
        min_decay=settings["min_decay"],
        update_after_step=settings["update_after_step"],
    )
    got = decays(ours, model, 300)
    expected = [theirs.get_decay(step) for step in range(1, 301)]
    assert got == expected


@pytest.mark.parametrize("decay", [0.999, 0.9, 0.2])
def test_torch_ema_decay_bit_for_bit(decay):
    torch_ema = peer(peer_access.load_torch_ema)
    # torch_ema keeps its decay inside update(): read it back from a one-element average whose
    # parameter moves from 0 to 1, exactly representable steps.
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    theirs = torch_ema.ExponentialMovingAverage([param], decay=decay)
    model = small_mlp(torch.float64)
    ours = fused_ema.ModelEma(model, decay, warmup="torch_ema")
    for step in range(1, 200):
        theirs.shadow_params[0].zero_()
        with torch.no_grad():
            param.fill_(1.0)
        theirs.update()
        ours.update(model)
        assert ours.step == theirs.num_updates == step
        # shadow = 0 - (0 - 1) * (1 - d) = 1 - d: the weight torch_ema used, rounded once
        assert 1.0 - ours.current_decay == float(theirs.shadow_params[0])


def test_torch_ema_first_update_averages_from_construction():
    torch_ema = peer(peer_access.load_torch_ema)
    torch.manual_seed(3)
    model = small_mlp(torch.float64)
    theirs = torch_ema.ExponentialMovingAverage(model.parameters(), decay=0.99)
    ours = fused_ema.ModelEma(model, 0.99, warmup="torch_ema", buffers="ignore")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    theirs.update()
    ours.update(model)
    weights = ours.state_dict()["weights"]
    names = [n for n, _ in model.named_parameters()]
    for name, shadow in zip(names, theirs.shadow_params):
        torch.testing.assert_close(weights[name], shadow, rtol=1e-15, atol=1e-15)
    assert not torch.equal(weights["0.weight"], model[0].weight)  # 2/11 of the way, not a copy


@pytest.mark.parametrize("every, after", [(3, 0), (4, 6), (10, 100)])
def test_ema_pytorch_plain_update_every(every, after):
    ema_pytorch = peer(peer_access.load_ema_pytorch)
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = dict(update_after_step=after, inv_gamma=1.5, power=0.7)
    theirs = ema_pytorch.EMA(
        model, beta=0.99, update_every=every, min_value=0.05, include_online_model=False, **options
    )
    ours = fused_ema.ModelEma(
        model,
        0.99,
        warmup=(1.5, 0.7),
        min_decay=0.05,
        update_after_step=after,
        update_every=every,
        update_every_decay="plain",
    )
    g = torch.Generator().manual_seed(seed)
    for _ in range(150):
        train_step(model, optimizer, g)
        theirs.update()
        ours.update(model)
    assert ours.step == int(theirs.step)
    weights = ours.state_dict()["weights"]
    for name, expected in theirs.ema_model.state_dict().items():
        if expected.is_floating_point():  # ema-pytorch leaves integer buffers alone
            # ema-pytorch rounds its decay to float32
            torch.testing.assert_close(weights[name], expected, rtol=2e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("version", ["ModelEmaV2", "ModelEma"])
def test_timm_v2_from_construction_with_step_one(version):
    # timm's ModelEma/ModelEmaV2 average from their first update on (docs/migrating.md): with
    # ema.step = 1 so does ModelEma, whose first update otherwise copies the model.
    timm = peer(peer_access.load_timm_model_ema)
    torch.manual_seed(random.randrange(2**31))
    model = small_mlp(torch.float64)
    theirs = getattr(timm, version)(model, decay=0.9)
    ours = fused_ema.ModelEma(model, 0.9)
    copying = fused_ema.ModelEma(model, 0.9)
    ours.step = 1
    for _ in range(60):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        theirs.update(model)
        ours.update(model)
        copying.update(model)
    inner = theirs.ema if version == "ModelEma" else theirs.module
    weights = ours.state_dict()["weights"]
    for name, expected in inner.state_dict().items():
        if expected.is_floating_point():
            torch.testing.assert_close(weights[name], expected, rtol=1e-12, atol=1e-12, msg=name)
    # d ** 59 of the first step's difference: still visible in float64
    assert not torch.allclose(copying.state_dict()["weights"]["0.weight"], inner[0].weight)


def test_torch_ema_without_num_updates_with_step_one():
    # use_num_updates=False: a constant decay from the first update on, which averages too
    # (docs/migrating.md: warmup=False, then ema.step = 1).
    torch_ema = peer(peer_access.load_torch_ema)
    torch.manual_seed(random.randrange(2**31))
    model = small_mlp(torch.float64)
    theirs = torch_ema.ExponentialMovingAverage(model.parameters(), 0.9, use_num_updates=False)
    ours = fused_ema.ModelEma(model, 0.9, warmup=False, buffers="ignore")
    ours.step = 1
    for _ in range(40):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        theirs.update()
        ours.update(model)
    weights = ours.state_dict()["weights"]
    names = [n for n, _ in model.named_parameters()]
    for name, shadow in zip(names, theirs.shadow_params):
        torch.testing.assert_close(weights[name], shadow, rtol=1e-12, atol=1e-12, msg=name)


def test_compensated_update_every_differs_from_plain():
    # The default keeps the average of updating every step: decay ** k per update.
    model = small_mlp()
    plain = fused_ema.ModelEma(model, 0.9, update_every=4, update_every_decay="plain")
    compensated = fused_ema.ModelEma(model, 0.9, update_every=4)
    for ema in (plain, compensated):
        for _ in range(5):
            ema.update(model)
    assert plain.current_decay == compensated.current_decay == 0.9
    assert plain._schedule.out[0].item() == pytest.approx(1 - 0.9)
    assert compensated._schedule.out[0].item() == pytest.approx(1 - 0.9**4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(warmup="diffuser"), "warmup must be False, True, .*'torch_ema'"),
        (dict(warmup=(0.0, 1.0)), "gamma and power must be positive"),
        (dict(update_every_decay="power"), "update_every_decay must be one of"),
        (dict(update_every_decay=None), "update_every_decay must be one of"),
        # float() took these: a bool, a string, a tensor, bytes and a dict's keys as numbers
        (dict(warmup=(True, 0.5)), "warmup gamma and power must be numbers"),
        (dict(warmup=("2", "0.5")), "warmup gamma and power must be numbers"),
        (dict(use_warmup=True, warmup_gamma=torch.tensor(2.0)), "gamma and power must be numbers"),
        (dict(use_warmup=True, warmup_power=True), "gamma and power must be numbers"),
        (dict(warmup=torch.tensor([1.0, 0.5])), "warmup must be False, True"),
        (dict(warmup=b"ab"), "warmup must be False, True"),
        (dict(warmup={1.0: 0, 2.0: 0}), "warmup must be False, True"),
        # taken by its truth value before
        (dict(use_warmup="no"), "use_warmup must be True, False or None, got 'no'"),
        (dict(use_warmup=1), "use_warmup must be True, False or None"),
        (dict(use_warmup=torch.tensor(False)), "use_warmup must be True, False or None"),
        (dict(exclude_buffers="no"), "exclude_buffers must be True, False or None, got 'no'"),
        (dict(exclude_buffers=torch.tensor(True)), "exclude_buffers must be True, False or None"),
        # warmup=True used (1, 2/3) whatever timm's warmup_gamma / warmup_power said
        (dict(warmup=True, warmup_gamma=10.0), r"warmup_gamma=10.0 .* use_warmup=True"),
        (dict(warmup="diffusers", warmup_power=0.5), "give warmup=\\(gamma, power\\)"),
        (dict(warmup=(2.0, 0.5), warmup_gamma=2.0), "warmup_gamma=2.0 and warmup_power="),
    ],
)
def test_bad_schedule_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fused_ema.ModelEma(small_mlp(), 0.9, **kwargs)


@pytest.mark.parametrize("warmup", ["diffusers", "torch_ema", (2.0, 0.5), None])
@pytest.mark.parametrize("every_decay", ["compensated", "plain"])
def test_new_options_survive_a_checkpoint(warmup, every_decay):
    model = small_mlp()
    saved = fused_ema.ModelEma(
        model, 0.95, warmup=warmup, update_every=2, update_every_decay=every_decay
    )
    for _ in range(7):
        saved.update(model)
    loaded = fused_ema.ModelEma(model, 0.5)
    loaded.load_state_dict(saved.state_dict())
    assert loaded.schedule == saved.schedule
    for _ in range(5):
        saved.update(model)
        loaded.update(model)
        assert loaded.current_decay == saved.current_decay
        assert torch.equal(loaded._schedule.out, saved._schedule.out)
