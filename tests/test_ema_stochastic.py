"""ModelEma with bfloat16/float16 EMA tensors: stochastic rounding on by default (timm 1.0.31's
keywords), the exact random stream of fused_ema.lerp_stochastic_ keyed by name and step, resumed
bit for bit from a checkpoint, and a precision warning only when it is off."""

import warnings
import zlib

import pytest
import torch
from torch import nn

import fused_ema
from ema_helpers import small_mlp, train_step

HALF = [torch.bfloat16, torch.float16]


def drift(model, generator, scale=1e-3):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)


# Seeds from 2**63 up (and -1, PostHocEma's 2**64 - 1 for track 0) reach the op as the int64 of the
# same bits, as lerp_stochastic_'s own seed does.
@pytest.mark.parametrize("seed", [7, 2**63, 2**64 - 1, -1])
@pytest.mark.parametrize("dtype", HALF)
def test_default_is_stochastic_and_follows_the_op_bit_for_bit(dtype, seed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    ema = fused_ema.ModelEma(model, decay=0.999, dtype=dtype, stochastic_rounding_seed=seed)
    names = [n for n, _ in model.named_parameters()]
    mine = [p.detach().to(dtype) for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 41):
        drift(model, g)
        ema.update(model)
        weight = 1.0 if step == 1 else 1 - 0.999
        fused_ema.lerp_stochastic_(
            mine,
            [p.detach() for p in model.parameters()],
            torch.tensor(weight, dtype=torch.float64),
            seed=seed,
            step=step,
            keys=[zlib.crc32(n.encode()) & 0x7FFFFFFF for n in names],
        )
    weights = ema.state_dict()["weights"]
    for name, value in zip(names, mine):
        assert weights[name].dtype == dtype
        assert torch.equal(weights[name], value), name


def test_stochastic_bf16_keeps_moving_where_round_to_nearest_stalls():
    torch.manual_seed(2)
    model = nn.Linear(64, 64)
    on = fused_ema.ModelEma(model, decay=0.9999, dtype=torch.bfloat16)
    with pytest.warns(fused_ema.PrecisionWarning):
        off = fused_ema.ModelEma(
            model, decay=0.9999, dtype=torch.bfloat16, stochastic_rounding=False
        )
    exact = fused_ema.ModelEma(model, decay=0.9999, dtype=torch.float64)
    for ema in (on, off, exact):
        ema.update(model)  # the first update copies
    with torch.no_grad():
        model.weight.add_(0.05)  # a step each update moves by 5e-6: far below half a bf16 ulp
    for _ in range(300):
        for ema in (on, off, exact):
            ema.update(model)
    target = exact.state_dict()["weights"]["weight"]
    bias_on = (on.state_dict()["weights"]["weight"].double() - target).mean()
    bias_off = (off.state_dict()["weights"]["weight"].double() - target).mean()
    assert abs(float(bias_off)) > 1e-3  # round to nearest never moved
    assert abs(float(bias_on)) < 0.05 * abs(float(bias_off)), (float(bias_on), float(bias_off))


def test_no_precision_warning_while_stochastic_rounding_is_on():
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_ema.PrecisionWarning)
        fused_ema.ModelEma(small_mlp(), decay=0.9999, dtype=torch.bfloat16)


def test_resume_continues_the_random_stream_exactly(tmp_path):
    torch.manual_seed(4)
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    settings = dict(decay=0.99, dtype=torch.bfloat16, stochastic_rounding_seed=11, warmup=True)
    through = fused_ema.ModelEma(model, **settings)
    g = torch.Generator().manual_seed(5)
    snapshots = []
    for step in range(1, 21):
        train_step(model, opt, g)
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        through.update(model)
        if step == 10:
            torch.save(through.state_dict(), tmp_path / "ema.pt")
    replay = small_mlp()
    resumed = fused_ema.ModelEma(replay, decay=0.5, dtype=torch.bfloat16)  # other settings
    resumed.load_state_dict(tmp_path / "ema.pt")
    assert resumed.step == 10
    for snapshot in snapshots[10:]:
        replay.load_state_dict(snapshot)
        resumed.update(replay)
    ours, theirs = resumed.state_dict(), through.state_dict()
    assert ours["rounding"] == {"stochastic_rounding": True, "stochastic_rounding_seed": 11}
    for name, value in theirs["weights"].items():
        assert torch.equal(ours["weights"][name], value), name


@pytest.mark.parametrize("bad", [1.5, True, 2**64, "0"])
def test_bad_seeds_are_refused(bad):
    with pytest.raises(ValueError, match="stochastic_rounding_seed"):
        fused_ema.ModelEma(small_mlp(), dtype=torch.bfloat16, stochastic_rounding_seed=bad)


def test_a_bad_rounding_entry_in_a_checkpoint_changes_nothing():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9, dtype=torch.bfloat16)
    ema.update(model)
    sd = ema.state_dict()
    sd = {**sd, "rounding": {"stochastic_rounding": "yes", "stochastic_rounding_seed": 0}}
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    with pytest.raises(fused_ema.CheckpointError, match="rounding"):
        ema.load_state_dict(sd)
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name])


def test_ranks_with_the_same_inputs_keep_identical_emas():
    # What keeps DDP replicas identical: the bits depend on (seed, step, name, index) only, not on
    # the object, the thread count or the order of construction.
    torch.manual_seed(6)
    model = small_mlp()
    a = fused_ema.ModelEma(model, decay=0.99, dtype=torch.float16)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = fused_ema.ModelEma(model, decay=0.99, dtype=torch.float16)
        g = torch.Generator().manual_seed(7)
        for _ in range(15):
            drift(model, g, 1e-2)
            torch.set_num_threads(1)
            a.update(model)
            torch.set_num_threads(max(previous, 2))
            b.update(model)
    finally:
        torch.set_num_threads(previous)
    for name, value in a.state_dict()["weights"].items():
        assert torch.equal(value, b.state_dict()["weights"][name]), name
