"""fused_ema::ema_schedule_, the op behind ModelEma's step counter: its weight and decay against a
float64 Python transcription of the schedule over many steps and random configs, step limits,
config validation naming each field, tensor checks, and opcheck."""

import math
import random

import pytest
import torch

import fused_ema  # noqa: F401  (registers the ops)
from fused_ema._ext.loader import _C

op = torch.ops.fused_ema.ema_schedule_
MAX_STEP = 2**53
FIELDS = (
    "decay",
    "min_decay",
    "warmup_gamma",
    "warmup_power",
    "update_after_step",
    "update_every",
    "warmup_kind",
    "update_every_decay",
    "lag",
    "multiplier",
    "ema_power",
    "bias_power",
)
NONE, POWER, DIFFUSERS, TORCH_EMA, POWER_FUNCTION = 0, 1, 2, 3, 4  # warmup_kind
BEMA_EMA, BEMA_THETA0, BEMA_ALPHA = 5, 6, 7
NO_BEMA = (0.0, 0.0, 0.0, 0.0)  # lag, multiplier, ema_power, bias_power of the other kinds


def padded(config):
    """An 8-field config of the kinds before BEMA, with BEMA's four fields (0) appended."""
    return tuple(config) + NO_BEMA if len(config) == 8 else tuple(config)


def bema_reference(config, step):
    """(weight, decay) of one of BEMA's tracks, from TRL's BEMACallback (trl/trainer/callbacks.py):
    the reset at step == update_after, then beta and alpha of the trainer's step t every
    update_freq steps."""
    _, min_mult, _, _, after, every, kind, _, lag, mult, ema_power, bias_power = config
    u = step - int(after)
    if u < 0:
        return 0.0, 1.0
    if u == 0:
        return (0.0 if kind == BEMA_ALPHA else 1.0), 0.0
    beta = max((lag + mult * step) ** -ema_power, min_mult)
    if u % int(every) != 0 or kind == BEMA_THETA0:
        return 0.0, 1.0 - beta
    if kind == BEMA_EMA:
        return beta, 1.0 - beta
    return max((lag + mult * step) ** -bias_power, 5e-324), 1.0 - beta


def reference(config, step):
    """(weight, decay) of `step`, written from the README's description of the schedule."""
    config = padded(config)
    if step < 0 or step > MAX_STEP:
        return 0.0, 0.0
    if config[6] >= BEMA_EMA:
        return bema_reference(config, step)
    decay, min_decay, gamma, power, after, every, kind, plain = config[:8]
    averaged = step - int(after) - (0 if kind == TORCH_EMA else 1)
    if averaged <= 0:
        d = 0.0
    elif kind == POWER:
        d = max(min_decay, min(decay, 1.0 - (1.0 + averaged / gamma) ** -power))
    elif kind in (DIFFUSERS, TORCH_EMA):
        d = max(min_decay, min(decay, (1.0 + averaged) / (10.0 + averaged)))
    elif kind == POWER_FUNCTION:  # EDM2: t = averaged + 1 updates, the first of them the copy
        t = averaged + 1
        d = max(min_decay, min(decay, (1.0 - 1.0 / t) ** (gamma + 1.0)))
    else:
        d = decay
    if (step - 1) % int(every) != 0:
        return 0.0, d
    return 1.0 - (d if plain else d ** int(every)), d


def tensors(device, step=0, config=(0.999, 0.0, 0.0, 1.0, 0, 1, 0, 0)):
    return (
        torch.tensor(step, dtype=torch.int64, device=device),
        torch.zeros(2, dtype=torch.float64, device=device),
        torch.tensor(padded(config), dtype=torch.float64, device=device),
    )


def random_config(rng):
    if rng.random() < 0.3:
        return random_bema_config(rng)
    decay = rng.choice([0.0, 1.0, 0.5, 0.9, 0.999, 0.9999, rng.random()])
    min_decay = rng.choice([0.0, decay * rng.random(), decay])
    kind = rng.choice([NONE, POWER, DIFFUSERS, TORCH_EMA, POWER_FUNCTION])
    if kind == POWER:
        gamma, power = rng.choice([(1.0, 0.75), (rng.uniform(0.1, 50), 2 / 3)])
    elif kind == POWER_FUNCTION:
        gamma, power = rng.choice([6.94, 16.97, -0.3, rng.uniform(-0.99, 40)]), 1.0
    else:  # ignored by the other kinds, whatever they hold
        gamma, power = rng.choice([(0.0, 1.0), (-1.0, 0.0), (3.0, 0.5)])
    return (
        decay,
        min_decay,
        gamma,
        power,
        float(rng.choice([0, 0, 1, 3, rng.randrange(20)])),
        float(rng.choice([1, 1, 2, 3, rng.randrange(1, 9)])),
        float(kind),
        float(rng.choice([0, 1])),
    )


def random_bema_config(rng):
    return (
        1.0,
        rng.choice([0.0, 0.0, rng.uniform(0.0, 0.2)]),
        0.0,
        1.0,
        float(rng.choice([0, 0, 1, 3, rng.randrange(20)])),
        float(rng.choice([1, 1, 2, 3, 400, rng.randrange(1, 9)])),
        float(rng.choice([BEMA_EMA, BEMA_THETA0, BEMA_ALPHA])),
        0.0,
        float(rng.choice([10, 0, 1, rng.uniform(0, 50)])),
        float(rng.choice([1.0, 0.5, rng.uniform(0.01, 4)])),
        float(rng.choice([0.5, 0.0, rng.uniform(0, 2)])),
        float(rng.choice([0.2, 0.0, 8.0, rng.uniform(0, 2)])),
    )


def assert_out(out, expected, context):
    got = tuple(out.cpu().tolist())
    for g, e in zip(got, expected):
        assert math.isclose(g, e, rel_tol=1e-13, abs_tol=1e-15), f"{context}: {got} != {expected}"


def test_formula_over_steps_and_configs(device):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(40):
        config = random_config(rng)
        step, out, cfg = tensors(device, config=config)
        for value in list(range(0, 60)) + [rng.randrange(60, 10**6) for _ in range(20)]:
            step.fill_(value)
            op(step, out, cfg, False)
            assert int(step) == value
            assert_out(out, reference(config, value), f"seed {seed}, config {config}, step {value}")


def test_advance_increments_then_schedules(device):
    config = (0.99, 0.1, 2.0, 0.75, 2.0, 3.0, POWER, 0)
    step, out, cfg = tensors(device, step=-1, config=config)
    weights = []
    for expected_step in range(0, 40):
        op(step, out, cfg, True)
        assert int(step) == expected_step
        assert_out(out, reference(config, expected_step), f"step {expected_step}")
        weights.append(float(out[0]))
    # every third step from step 1 updates; before update_after_step + 2 it copies (weight 1)
    assert [k for k, w in enumerate(weights) if w != 0] == list(range(1, 40, 3))
    assert weights[1] == 1.0 and weights[4] < 1.0


@pytest.mark.parametrize("value", [-1, -2, -(2**40), MAX_STEP + 1, 2**62, 2**63 - 1])
def test_steps_out_of_range_do_nothing(device, value):
    step, out, cfg = tensors(device, step=value, config=(0.5, 0.0, 0.0, 1.0, 0, 1, 0, 0))
    out.fill_(7.0)
    op(step, out, cfg, False)
    assert out.cpu().tolist() == [0.0, 0.0]
    assert int(step) == value


def test_advance_past_the_limits(device):
    step, out, cfg = tensors(device, step=MAX_STEP - 1, config=(0.5, 0.0, 0.0, 1.0, 0, 1, 0, 0))
    op(step, out, cfg, True)
    assert int(step) == MAX_STEP and out.cpu().tolist() == [0.5, 0.5]
    op(step, out, cfg, True)
    assert int(step) == MAX_STEP + 1 and out.cpu().tolist() == [0.0, 0.0]
    step.fill_(2**63 - 1)  # wraps instead of overflowing
    op(step, out, cfg, True)
    assert int(step) == -(2**63) and out.cpu().tolist() == [0.0, 0.0]


def test_max_step_is_exported():
    assert _C.MAX_STEP == MAX_STEP


GOOD = (0.9, 0.1, 0.0, 1.0, 2.0, 3.0, 0.0, 0.0) + NO_BEMA
GOOD_BEMA = (1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 5.0, 0.0, 10.0, 1.0, 0.5, 0.2)
BAD_FIELDS = [
    (0, -0.1),
    (0, 1.5),
    (0, math.nan),
    (1, -0.01),
    (1, 0.95),  # above decay
    (1, math.nan),
    (2, math.inf),
    (2, math.nan),
    (3, math.nan),
    (3, -math.inf),
    (4, -1.0),
    (4, 1.5),
    (4, float(MAX_STEP + 2)),
    (4, math.inf),
    (5, 0.0),
    (5, 2.5),
    (5, float(MAX_STEP + 2)),
    (5, math.nan),
    (6, -1.0),
    (6, 8.0),
    (6, 1.5),
    (6, math.nan),
    (7, -1.0),
    (7, 2.0),
    (7, 0.5),
    (7, math.inf),
    (8, 1.0),  # BEMA's fields are 0 for the other kinds
    (9, 0.5),
    (10, math.nan),
    (11, -1.0),
]
BAD_BEMA_FIELDS = [
    (1, 1.5),  # min_ema_multiplier above 1
    (6, 8.0),
    (8, -1.0),
    (8, math.inf),
    (9, -0.5),
    (9, math.nan),
    (10, -0.1),
    (10, math.inf),
    (11, -2.0),
    (11, math.nan),
]


@pytest.mark.parametrize("field, value", BAD_BEMA_FIELDS)
def test_bad_bema_config_field_is_named(field, value):
    config = list(GOOD_BEMA)
    config[field] = value
    step, out, cfg = tensors("cpu", step=5, config=config)
    out.fill_(3.0)
    with pytest.raises(ValueError, match=rf"config: {FIELDS[field]} must"):
        op(step, out, cfg, True)
    assert int(step) == 5 and out.tolist() == [3.0, 3.0]


def test_bema_lag_and_multiplier_cannot_both_be_0():
    config = list(GOOD_BEMA)
    config[8] = config[9] = 0.0
    step, out, cfg = tensors("cpu", step=5, config=config)
    with pytest.raises(ValueError, match="config: multiplier must"):
        op(step, out, cfg, True)


def test_bema_tracks_follow_trl_over_a_run():
    """The three tracks' weights over TRL's defaults (update_freq 4 here, update_after 3): the
    reset at step 3, then beta, theta0's 0 and alpha on steps 7, 11, ..."""
    for kind in (BEMA_EMA, BEMA_THETA0, BEMA_ALPHA):
        config = (1.0, 0.0, 0.0, 1.0, 3.0, 4.0, float(kind), 0.0, 10.0, 1.0, 0.5, 0.2)
        step, out, cfg = tensors("cpu", config=config)
        for t in range(1, 30):
            op(step, out, cfg, True)
            weight = out[0].item()
            if t < 3 or (t > 3 and (t - 3) % 4):
                assert weight == 0.0, (kind, t)
            elif t == 3:
                assert weight == (0.0 if kind == BEMA_ALPHA else 1.0), (kind, t)
            elif kind == BEMA_EMA:
                assert weight == max((10 + t) ** -0.5, 0.0), t
            elif kind == BEMA_ALPHA:
                assert weight == (10 + t) ** -0.2, t
            else:
                assert weight == 0.0, t


def test_an_alpha_that_underflows_still_writes_the_correction():
    config = (1.0, 0.0, 0.0, 1.0, 0.0, 1.0, float(BEMA_ALPHA), 0.0, 10.0, 1.0, 0.5, 400.0)
    step, out, cfg = tensors("cpu", step=1000, config=config)
    op(step, out, cfg, False)
    assert out[0].item() == 5e-324


@pytest.mark.parametrize("field, value", BAD_FIELDS)
def test_bad_config_field_is_named(field, value):
    config = list(GOOD)
    config[field] = value
    step, out, cfg = tensors("cpu", step=5, config=config)
    out.fill_(3.0)
    with pytest.raises(ValueError, match=rf"config: {FIELDS[field]} must"):
        op(step, out, cfg, True)
    assert int(step) == 5 and out.tolist() == [3.0, 3.0]


@pytest.mark.parametrize("power", [0.0, -1.0])
@pytest.mark.parametrize("kind", [NONE, DIFFUSERS, TORCH_EMA])
def test_warmup_power_must_be_positive_only_with_the_power_warmup(power, kind):
    step, out, cfg = tensors("cpu", step=5, config=(0.9, 0.0, 10.0, power, 0, 1, POWER, 0))
    with pytest.raises(ValueError, match="config: warmup_power must"):
        op(step, out, cfg, False)
    step, out, cfg = tensors("cpu", step=5, config=(0.9, 0.0, 10.0, power, 0, 1, kind, 0))
    op(step, out, cfg, False)
    assert_out(out, reference((0.9, 0.0, 10.0, power, 0, 1, kind, 0), 5), f"kind {kind}")


@pytest.mark.parametrize("gamma", [0.0, -2.0])
def test_warmup_gamma_must_be_positive_with_the_power_warmup(gamma):
    step, out, cfg = tensors("cpu", step=5, config=(0.9, 0.0, gamma, 1.0, 0, 1, POWER, 0))
    with pytest.raises(ValueError, match="config: warmup_gamma must"):
        op(step, out, cfg, False)


@pytest.mark.parametrize("gamma", [-1.0, -3.0, math.inf])
def test_the_power_functions_gamma_must_exceed_minus_one(gamma):
    config = (1.0, 0.0, gamma, 1.0, 0, 1, POWER_FUNCTION, 0)
    step, out, cfg = tensors("cpu", step=5, config=config)
    with pytest.raises(ValueError, match="config: warmup_gamma must"):
        op(step, out, cfg, False)


def test_the_power_function_is_edm2s_profile_from_its_first_update():
    """t-th update from the copy: decay (1 - 1/t)^(gamma + 1); the first one copies (decay 0)."""
    gamma = 6.94
    for t, after in ((1, 0), (2, 0), (3, 0), (50, 0), (7, 3)):
        config = (1.0, 0.0, gamma, 1.0, after, 1, POWER_FUNCTION, 0)
        step, out, cfg = tensors("cpu", step=t + after, config=config)
        op(step, out, cfg, False)
        assert out[1].item() == pytest.approx((1 - 1 / t) ** (gamma + 1), rel=1e-15, abs=0.0)


def test_limits_of_the_integer_fields_are_accepted():
    step, out, cfg = tensors(
        "cpu", step=MAX_STEP, config=(0.5, 0.0, 0.0, 1.0, MAX_STEP, MAX_STEP, 3, 1)
    )
    op(step, out, cfg, False)
    assert out.tolist() == [0.0, 0.0]  # not past update_after_step yet, and not a phase-0 step


def bad_tensor_cases():
    good = {
        "step": torch.tensor(1, dtype=torch.int64),
        "out": torch.zeros(2, dtype=torch.float64),
        "config": torch.tensor(GOOD, dtype=torch.float64),
    }
    cases = [
        ("step", torch.tensor(1, dtype=torch.int32), ValueError, "step must be one int64 element"),
        ("step", torch.tensor([1, 2]), ValueError, r"step .* got int64 of shape \[2\]"),
        ("out", torch.zeros(2, dtype=torch.float32), ValueError, "out must be 2 contiguous"),
        ("out", torch.zeros(3, dtype=torch.float64), ValueError, r"out .* shape \[3\]"),
        ("out", torch.zeros(4, dtype=torch.float64)[::2], ValueError, "out must be 2 contiguous"),
        ("config", torch.tensor(GOOD, dtype=torch.float32), ValueError, "config must be 12"),
        ("config", torch.tensor(GOOD[:6], dtype=torch.float64), ValueError, r"shape \[6\]"),
        (
            "config",
            torch.tensor(GOOD * 2, dtype=torch.float64)[::2],
            ValueError,
            "config must be 12 contiguous",
        ),
        ("out", torch.zeros(2, dtype=torch.float64, device="meta"), RuntimeError, "out is on meta"),
        (
            "config",
            torch.tensor(GOOD, dtype=torch.float64, device="meta"),
            RuntimeError,
            "config is on meta but step is on cpu",
        ),
    ]
    for name, tensor, error, match in cases:
        args = dict(good, **{name: tensor})
        yield pytest.param(args, error, match, id=f"{name}-{match[:24]}")


@pytest.mark.parametrize("args, error, match", list(bad_tensor_cases()))
def test_bad_tensors_are_refused(args, error, match):
    step_before = args["step"].clone()
    with pytest.raises(error, match=match):
        op(args["step"], args["out"], args["config"], True)
    if args["step"].device.type != "meta":
        assert torch.equal(args["step"], step_before)


def test_meta_tensors_are_refused():
    step, out, cfg = (t.to("meta") for t in tensors("cpu"))
    with pytest.raises(RuntimeError, match="meta tensors hold no data"):
        op(step, out, cfg, True)


@pytest.mark.parametrize("advance", [False, True])
def test_opcheck(device, advance):
    step, out, cfg = tensors(device, step=7, config=(0.99, 0.5, 3.0, 0.75, 2, 2, POWER, 1))
    torch.library.opcheck(op, (step, out, cfg, advance))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_invalid_config_writes_no_update():
    # The device kernel cannot raise without a sync: a config the caller failed to validate
    # leaves the EMA as it is (weight 0) and marks the decay NaN.
    step, out, cfg = tensors("cuda", step=3, config=(0.9, 0.0, 0.0, 1.0, 0, 0, 0, 0))
    op(step, out, cfg, True)
    assert int(step) == 4
    weight, decay = out.cpu().tolist()
    assert weight == 0.0 and math.isnan(decay)


@pytest.mark.parametrize("kind", ["advance", "int", "tensor", "cpu tensor"])
def test_schedule_begin_saves_marks_and_moves_the_counter(device, kind):
    # Schedule.begin: _saved <- step, _dirty, then the counter set or advanced and the weight of
    # that step computed, as the reference formula says.
    from fused_ema._update.schedule import Schedule, check_options

    rng = random.Random()
    schedule = Schedule(check_options(decay=0.99, warmup=(2.0, 0.75)), torch.device(device))
    config = tuple(schedule.config.tolist())
    current = rng.randrange(0, 10**6)
    schedule.step.fill_(current)
    value = rng.randrange(0, 10**6)
    given = {
        "advance": None,
        "int": value,
        "tensor": torch.tensor(value, dtype=torch.int32, device=device),
        "cpu tensor": torch.tensor(value),
    }[kind]
    expected = current + 1 if given is None else value
    schedule.begin(given)
    assert schedule._dirty is True
    assert int(schedule._saved) == current
    assert int(schedule.step) == expected
    assert_out(schedule.out, reference(config, expected), f"{kind} from {current}")
    schedule.rollback()
    assert int(schedule.step) == current and schedule._dirty is False
    assert_out(schedule.out, reference(config, current), f"rolled back to {current}")
