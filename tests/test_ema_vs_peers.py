"""ModelEma equals the EMA libraries it replaces, over 200 training steps with their schedules:
the installed timm's real ModelEmaV3 (bit for bit where both compute a lerp), torch's own
AveragedModel with get_ema_multi_avg_fn (bit for bit) and the installed ema-pytorch (which rounds
its decay to float32, hence a float32 tolerance).

timm is loaded from its one file timm/utils/model_ema.py (benchmarks/peers.py), never with
`import timm`, which imports torchvision; without timm installed those tests skip and say so."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fused_ema
from benchmarks import peers as peer_access
from ema_helpers import TiedNet, small_mlp, train_step
from peers import require, timm_model_ema

STEPS = 200
ROOT = Path(__file__).resolve().parents[1]


def round_to_nearest():
    """ModelEma keywords for a plain (round-to-nearest) bf16 EMA, once ModelEma has the
    stochastic_rounding keyword (its default is True, as in timm 1.0.31)."""
    if "stochastic_rounding" in inspect.signature(fused_ema.ModelEma).parameters:
        return {"stochastic_rounding": False}
    return {}


def train_both(model, ours, theirs, seed, steps=STEPS, lr=1e-2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):  # timm's train.py passes the 1-based update count
        train_step(model, optimizer, g)
        theirs.update(model, step=step)
        ours.update(model, step=step)


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


TIMM_SETTINGS = {
    "warmup": dict(decay=0.999, use_warmup=True, update_after_step=0),
    "warmup-delayed": dict(
        decay=0.99,
        use_warmup=True,
        warmup_gamma=2.0,
        warmup_power=0.75,
        min_decay=0.2,
        update_after_step=7,
    ),
    "constant": dict(decay=0.95, use_warmup=False, update_after_step=3),
    "exclude-buffers": dict(decay=0.99, use_warmup=True, exclude_buffers=True),
}


# Run in a fresh interpreter: loads timm's model_ema.py as the tests do, then names every
# module of the timm or torchvision packages that is imported.
LOAD_TIMM_ALONE = """
import json, sys
from benchmarks import peers
module = peers.load_timm_model_ema()
assert hasattr(module, "ModelEmaV3")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("timm", "torchvision"))))
"""


def test_timm_is_loaded_without_its_package():
    """Loading timm's ModelEma file imports neither the timm package nor torchvision. Checked in a
    fresh interpreter: in this one, other tests may have imported either (lightning imports
    torchvision where it is installed), whatever the peers helper does."""
    module = timm_model_ema()
    assert peer_access.load_timm_model_ema() is module  # loaded once
    paths = [str(ROOT), str(Path(fused_ema.__file__).resolve().parents[1])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_TIMM_ALONE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_timm_is_the_version_env_sh_pins():
    timm_model_ema()
    env_sh_venv = Path(os.environ.get("FUSED_EMA_VENV", Path(__file__).parents[1] / ".venv"))
    if Path(sys.prefix).resolve() != env_sh_venv.resolve():
        pytest.skip(f"checks what .ci/env.sh installs into {env_sh_venv}; running in {sys.prefix}")
    assert peer_access.timm_version() == peer_access.TIMM_VERSION, "not the timm env.sh pins"


@pytest.mark.parametrize("settings", TIMM_SETTINGS.values(), ids=TIMM_SETTINGS.keys())
def test_equals_timm_model_ema_v3(settings):
    timm = timm_model_ema()
    torch.manual_seed(0)
    model = small_mlp()
    theirs = timm.ModelEmaV3(model, **settings)
    ours = fused_ema.ModelEma(model, **settings)  # timm's own keyword spellings work unchanged
    train_both(model, ours, theirs, seed=1)
    assert ours.step == STEPS
    assert ours.current_decay == theirs.get_decay(STEPS)
    # fp32 model and EMA: timm's torch._foreach_lerp_ and the fused kernel round identically;
    # buffers included (averaged, or copied with exclude_buffers, num_batches_tracked copied)
    assert_same_state(ours, theirs.module.state_dict())


def test_bf16_ema_equals_timm_round_to_nearest():
    # A bf16 EMA of a bf16 model with timm's stochastic rounding off: both lerp bf16 into bf16,
    # rounding to nearest. timm's dtype=None keeps the model's dtype, where fused_ema's would
    # pick float32, so the EMA dtype is given explicitly.
    timm = timm_model_ema()
    torch.manual_seed(8)
    model = small_mlp(dtype=torch.bfloat16)
    settings = dict(decay=0.99, use_warmup=True, warmup_power=0.75)
    theirs = timm.ModelEmaV3(model, **settings, stochastic_rounding=False)
    ours = fused_ema.ModelEma(model, **settings, dtype=torch.bfloat16, **round_to_nearest())
    train_both(model, ours, theirs, seed=9, lr=3e-2)
    assert theirs.module[0].weight.dtype == torch.bfloat16
    assert_same_state(ours, theirs.module.state_dict())


def test_fp32_ema_of_bf16_model_matches_timm_to_float_rounding():
    # timm's mixed-dtype path is not a lerp: torch._foreach_lerp_ needs equal dtypes, so it runs
    # ema.mul_(1 - w).add_(model, alpha=w), with 1 - w and w each rounded to float32, where the
    # fused kernel computes ema + w * (model - ema) with one float32 w (PyTorch's lerp). The two
    # differ by a few float32 roundings per step, which the EMA's contraction keeps from growing
    # step after step: after 200 steps they differ by at most 3.3 float32 epsilons of each
    # tensor's largest entry (measured); the bound is 16.
    timm = timm_model_ema()
    torch.manual_seed(10)
    model = small_mlp(dtype=torch.bfloat16)
    settings = dict(decay=0.99, use_warmup=True, warmup_power=0.75)
    theirs = timm.ModelEmaV3(model, **settings, dtype=torch.float32)
    ours = fused_ema.ModelEma(model, **settings, dtype=torch.float32)
    train_both(model, ours, theirs, seed=11, lr=3e-2)
    assert theirs.module[0].weight.dtype == torch.float32
    weights = ours.state_dict()["weights"]
    eps = torch.finfo(torch.float32).eps
    for name, expected in theirs.module.state_dict().items():
        got = weights[name]
        if not expected.is_floating_point():
            assert torch.equal(got, expected), name
            continue
        assert got.dtype == torch.float32, name
        bound = 16 * eps * float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=bound, msg=f"{name}: off")


def test_bf16_stochastic_rounding_tracks_like_timm():
    # Stochastic rounding draws different random bits (timm: torch.randint from a CPU generator;
    # fused_ema: a hash keyed by seed, step and element), so the two agree in distribution only:
    # each stays as close to the exact float64 EMA as the other, where round-to-nearest stalls.
    timm = timm_model_ema()
    require(peer_access.timm_missing(stochastic_rounding=True))
    require(peer_access.model_ema_stochastic_missing())
    torch.manual_seed(12)
    model = small_mlp(dtype=torch.bfloat16)
    theirs = timm.ModelEmaV3(model, decay=0.999, stochastic_rounding=True)
    ours = fused_ema.ModelEma(
        model,
        decay=0.999,
        dtype=torch.bfloat16,
        stochastic_rounding=True,
        stochastic_rounding_seed=0,
    )
    nearest = timm.ModelEmaV3(model, decay=0.999, stochastic_rounding=False)
    exact = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(13)
    for step in range(1, STEPS + 1):
        train_step(model, optimizer, g)
        for ema in (theirs, ours, nearest):
            ema.update(model, step=step)
        w = 1.0 - theirs.get_decay(step)
        for k, v in exact.items():
            v.lerp_(model.state_dict()[k].double(), w)

    def error(state):
        return sum(float((state[k].double() - v).square().sum()) for k, v in exact.items()) ** 0.5

    ours_err = error(ours.state_dict()["weights"])
    theirs_err = error(theirs.module.state_dict())
    nearest_err = error(nearest.module.state_dict())
    assert ours_err < 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)
    assert theirs_err < nearest_err and ours_err < nearest_err, (ours_err, nearest_err)


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


def test_ema_pytorch_beta_one_freezes_as_warmup_none_does():
    """migrating.md: ema-pytorch's beta=1.0 freezes its EMA after the copying steps; ModelEma
    with decay 1.0 and warmup=None does the same, bit for bit (a warmup would keep moving)."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    torch.manual_seed(6)
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    every = dict(update_after_step=3, update_every=2)
    theirs = ema_pytorch.EMA(model, beta=1.0, include_online_model=False, **every)
    ours = fused_ema.ModelEma(model, 1.0, warmup=None, update_every_decay="plain", **every)
    g = torch.Generator().manual_seed(7)
    for _ in range(12):
        train_step(model, optimizer, g)
        theirs.update()
        ours.update(model)
    state = {k: v for k, v in theirs.ema_model.state_dict().items() if v.is_floating_point()}
    assert_same_state(ours, state)
    assert not torch.equal(ours.module.state_dict()["0.weight"], model.state_dict()["0.weight"])


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
