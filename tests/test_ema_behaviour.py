"""ModelEma's everyday behaviour: the schedule (warmup, update_after_step, update_every, given
steps), buffers, dtypes, ema.module, wrappers, stats and argument checks."""

import contextlib
import copy
import math
import pickle
import threading
import warnings

import pytest
import torch
from torch import nn

import fused_ema
from ema_helpers import TiedNet, small_mlp, train_step

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def python_decay(step, decay, warmup=None, min_decay=0.0, update_after_step=0):
    """The schedule, written independently of the C++ formula."""
    s = step - update_after_step - 1
    if s <= 0:
        return 0.0
    if warmup:
        gamma, power = warmup
        return max(min(1 - (1 + s / gamma) ** -power, decay), min_decay)
    return decay


@pytest.mark.parametrize(
    "config",
    [
        dict(decay=0.9999, warmup=(1.0, 2 / 3)),
        dict(decay=0.99, warmup=(10.0, 0.75), min_decay=0.5, update_after_step=4),
        dict(decay=0.9, update_after_step=2),
    ],
)
def test_decay_schedule_follows_the_formula(config):
    model = small_mlp()
    ema = fused_ema.ModelEma(model, **config)
    for step in range(1, 60):
        ema.update(model)
        assert ema.step == step
        expected = python_decay(
            step,
            config["decay"],
            config.get("warmup"),
            config.get("min_decay", 0.0),
            config.get("update_after_step", 0),
        )
        assert ema.current_decay == pytest.approx(expected, rel=1e-15, abs=0)


def test_copies_until_update_after_step_then_averages():
    torch.manual_seed(0)
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, decay=0.5, update_after_step=3)
    for _ in range(4):  # steps 1..4 = update_after_step + 1 copy
        train_step(model, opt)
        ema.update(model)
        for name, value in model.state_dict().items():
            assert torch.equal(
                ema.state_dict()["weights"][name],
                value.to(torch.float32) if value.is_floating_point() else value,
            ), name
    previous = ema.module[0].weight.detach().clone()
    train_step(model, opt)
    ema.update(model)
    expected = previous + 0.5 * (model[0].weight.detach() - previous)
    torch.testing.assert_close(ema.module[0].weight, expected, rtol=1e-6, atol=1e-7)


def test_update_every_skips_steps_and_uses_decay_power():
    torch.manual_seed(1)
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, decay=0.9, update_every=4)
    ema.update(model)  # step 1: copy
    for step in range(2, 14):
        train_step(model, opt)
        before = ema.module[0].weight.detach().clone()
        ema.update(model)
        after = ema.module[0].weight.detach()
        if (step - 1) % 4:
            assert torch.equal(after, before), f"step {step} should be skipped"
        else:
            expected = before + (1 - 0.9**4) * (model[0].weight.detach() - before)
            torch.testing.assert_close(after, expected, rtol=1e-6, atol=1e-7)
    assert ema.step == 13


@pytest.mark.parametrize("kind", ["int", "numpy-int", "cpu-tensor", "int32-tensor"])
def test_given_steps_drive_the_schedule(kind):
    np = pytest.importorskip("numpy")
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.999, warmup=True)
    for step in (1, 2, 10, 500):
        value = {
            "int": step,
            "numpy-int": np.int64(step),
            "cpu-tensor": torch.tensor(step),
            "int32-tensor": torch.tensor([step], dtype=torch.int32),
        }[kind]
        ema.update(model, step=value)
        assert ema.step == step
        assert ema.current_decay == pytest.approx(python_decay(step, 0.999, (1.0, 2 / 3)))


BAD_STEPS = [
    2.5,
    3.0,
    float("nan"),
    -1,
    2**53 + 1,
    2**70,
    True,
    "7",
    torch.tensor([1, 2]),
    torch.tensor(3.0),
    torch.tensor(True),
    torch.tensor(-4),
    torch.tensor(2**60),
    torch.tensor(5, device="meta"),
    torch.tensor([5]).to_sparse(),  # one element, but sparse: was a RuntimeError from reshape
]


@pytest.mark.parametrize("bad", BAD_STEPS, ids=repr)
def test_bad_steps_are_refused_and_change_nothing(bad):
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9, warmup=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema.update(model)
    train_step(model, opt)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    decay = ema.current_decay
    train_step(model, opt)
    with pytest.raises(ValueError, match="step"):
        ema.update(model, step=bad)
    assert ema.step == 2 and ema.current_decay == decay
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name


def test_integer_buffers_are_copied_exactly_float_buffers_averaged():
    torch.manual_seed(2)
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, decay=0.9)
    for _ in range(25):
        train_step(model, opt)
        ema.update(model)
    weights = ema.state_dict()["weights"]
    tracked = weights["1.num_batches_tracked"]
    assert tracked.dtype == torch.int64 and int(tracked) == 25 == int(model[1].num_batches_tracked)
    assert not torch.equal(weights["1.running_mean"], model[1].running_mean)  # averaged


@pytest.mark.parametrize("mode", ["average", "copy", "ignore"])
def test_buffer_modes(mode):
    torch.manual_seed(3)
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, decay=0.9, buffers=mode)
    for _ in range(5):
        train_step(model, opt)
        ema.update(model)
    weights = ema.state_dict()["weights"]
    if mode == "ignore":
        assert "1.running_mean" not in weights and "1.num_batches_tracked" not in weights
    elif mode == "copy":
        assert torch.equal(weights["1.running_mean"], model[1].running_mean)
        assert weights["1.running_mean"].dtype == model[1].running_mean.dtype
    else:
        assert not torch.equal(weights["1.running_mean"], model[1].running_mean)
    assert int(weights.get("1.num_batches_tracked", torch.tensor(5))) == 5


def test_non_persistent_buffers_are_not_tracked():
    ema = fused_ema.ModelEma(TiedNet())
    assert "cache" not in ema.names() and "scale" in ema.names()


@pytest.mark.parametrize(
    "model_dtype, ema_dtype, expected",
    [
        (torch.bfloat16, None, torch.float32),
        (torch.float16, None, torch.float32),
        (torch.float32, None, torch.float32),
        (torch.float64, None, torch.float64),
        (torch.float32, torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_ema_dtypes(model_dtype, ema_dtype, expected):
    model = small_mlp(model_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fused_ema.PrecisionWarning)
        ema = fused_ema.ModelEma(model, decay=0.9, dtype=ema_dtype)
    ema.update(model)
    ema.update(model)
    weights = ema.state_dict()["weights"]
    assert weights["0.weight"].dtype == expected
    assert weights["1.num_batches_tracked"].dtype == torch.int64


def test_fp32_ema_of_bf16_model_tracks_float64_while_bf16_ema_stalls():
    torch.manual_seed(4)
    model = small_mlp(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    decay = 0.995
    fp32 = fused_ema.ModelEma(model, decay=decay)
    with pytest.warns(fused_ema.PrecisionWarning, match="float32"):
        bf16 = fused_ema.ModelEma(
            model, decay=decay, dtype=torch.bfloat16, stochastic_rounding=False
        )
    reference = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    for step in range(1, 201):
        train_step(model, opt)
        fp32.update(model)
        bf16.update(model)
        weight = 1.0 if step == 1 else 1 - decay
        for n, p in model.named_parameters():
            reference[n] += weight * (p.detach().double() - reference[n])
    fp32_w, bf16_w = fp32.state_dict()["weights"], bf16.state_dict()["weights"]
    for name, ref in reference.items():
        scale = ref.abs().max()
        assert float((fp32_w[name].double() - ref).abs().max() / scale) < 1e-5, name
    worst_bf16 = max(
        float((bf16_w[n].double() - r).abs().max() / r.abs().max()) for n, r in reference.items()
    )
    assert worst_bf16 > 1e-3  # the bf16 EMA lost its updates to rounding
    assert bf16.stats(model)["unchanged_fraction"] > 0.5


def test_module_shares_the_ema_tensors_and_evaluates():
    torch.manual_seed(5)
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9)
    module = ema.module
    assert module is not model and not module.training
    weights = ema.state_dict()["weights"]
    for name, tensor in module.state_dict().items():
        assert tensor.data_ptr() == weights[name].data_ptr(), f"{name} stored twice"
    assert all(not p.requires_grad for p in module.parameters())
    x = torch.randn(5, 6)
    torch.testing.assert_close(module(x), model.eval()(x))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    train_step(model, opt)
    ema.update(model)
    ema.update(model)
    assert ema.module is module  # kept, and it sees the update in place
    assert torch.equal(module[0].weight, ema.state_dict()["weights"]["0.weight"])


class CachedTables(nn.Module):
    """Derived tables registered with persistent=False, as rotary embeddings and attention masks
    are: one float table registered in both blocks, and a bool mask."""

    def __init__(self, length=12, width=8):
        super().__init__()
        table = torch.randn(length, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        for block in self.blocks:
            block.register_buffer("table", table, persistent=False)
        self.register_buffer("mask", torch.rand(length, width) < 0.3, persistent=False)
        self.register_buffer("gain", torch.randn(width))  # persistent: averaged

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x * block.table))
        return (x * self.gain).masked_fill(self.mask, 0.0)


def cached_tables_reference(weights, model, x):
    """CachedTables.forward in float64 on the CPU, from the EMA's weights and the model's own
    tables."""
    x = x.to("cpu", torch.float64)
    for i, block in enumerate(model.blocks):
        w, b = (weights[f"blocks.{i}.{k}"].to("cpu", torch.float64) for k in ("weight", "bias"))
        x = torch.tanh((x * block.table.to("cpu", torch.float64)) @ w.T + b)
    return (x * weights["gain"].to("cpu", torch.float64)).masked_fill(model.mask.cpu(), 0.0)


def drifted(model, generator):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator).to(p.device))
    return model


def assert_evaluates(ema, model, generator, rtol=1e-5):
    module = ema.module
    x = torch.randn(12, 8, generator=generator)
    got = module(x.to(module.gain.device, module.gain.dtype)).to("cpu", torch.float64)
    expected = cached_tables_reference(ema.state_dict()["weights"], model, x)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol)


def assert_shares_the_tables(module, model):
    assert len(module.blocks) == len(model.blocks)
    for ours, theirs in zip(module.blocks, model.blocks):
        assert ours.table is theirs.table, "a non-persistent buffer stored twice"
    assert module.mask is model.mask
    assert module.gain is not model.gain  # persistent: the EMA's own average


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"device": "cpu"}, {"dtype": torch.float64}],
    ids=["default", "device=cpu", "float64-ema"],
)
def test_module_shares_the_models_non_persistent_buffers(kwargs):
    """A rotary table or mask (persistent=False: derived, never averaged) is not stored twice:
    on the model's device ema.module holds the model's own tensor. Another EMA dtype is no
    device change: the table keeps the model's dtype and stays shared."""
    torch.manual_seed(14)
    g = torch.Generator().manual_seed(15)
    model = CachedTables()
    ema = fused_ema.ModelEma(model, decay=0.75, **kwargs)
    for _ in range(3):
        ema.update(drifted(model, g))
        assert_shares_the_tables(ema.module, model)
        assert_evaluates(ema, model, g)


def test_module_keeps_sharing_non_persistent_buffers_as_the_ema_follows_the_model():
    torch.manual_seed(16)
    g = torch.Generator().manual_seed(17)
    model = CachedTables()
    ema = fused_ema.ModelEma(model, decay=0.75, on_mismatch="resync")
    ema.update(drifted(model, g))
    extra = nn.Linear(8, 8)
    extra.register_buffer("table", torch.randn(12, 8, generator=g), persistent=False)
    model.blocks.append(extra)  # a new structure: ema.module is rebuilt for it
    ema.update(drifted(model, g))
    assert len(ema.module.blocks) == 3
    assert_shares_the_tables(ema.module, model)
    assert_evaluates(ema, model, g)
    ema.resync(drifted(model, g))
    assert_shares_the_tables(ema.module, model)
    assert_evaluates(ema, model, g)
    other = copy.deepcopy(ema)
    other.update(drifted(model, g))
    ema.load_state_dict(other.state_dict())
    assert_shares_the_tables(ema.module, model)
    assert_evaluates(ema, model, g)
    ema.to(torch.float64)  # a dtype, not a device
    ema.to("cpu")  # where it already is
    assert_shares_the_tables(ema.module, model)
    assert_evaluates(ema, model, g, rtol=1e-12)


def test_a_shallow_copy_is_an_independent_ema_too():
    # copy.copy shared the EMA's tensors, step and ema.module but not the lock and swapped() flag
    # guarding them: the copy's update inside the original's swapped() averaged into tensors
    # holding the model's weights, which the block's end then wrote into the model.
    torch.manual_seed(21)
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    other = copy.copy(ema)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt)
    training = {k: v.clone() for k, v in model.state_dict().items()}
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    with ema.swapped(model):
        other.update(model)
        with pytest.raises(RuntimeError, match="swapped"):
            ema.module(torch.randn(2, 6))
    for name, value in model.state_dict().items():
        assert torch.equal(value, training[name]), name
    assert ema.step == 1 and other.step == 2
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name


def test_copies_of_the_ema_keep_the_tables_with_what_they_copy():
    """A deepcopy or unpickled EMA is independent of the model: its ema.module owns one copy of
    each table (still one tensor for both blocks). A parent deepcopied with both the model and
    the EMA gets an ema.module sharing the copied model's tables."""
    torch.manual_seed(18)
    g = torch.Generator().manual_seed(19)
    model = CachedTables()
    ema = fused_ema.ModelEma(model, decay=0.75)
    ema.update(drifted(model, g))
    x = torch.randn(12, 8, generator=g)
    expected = ema.module(x)
    for other in (copy.deepcopy(ema), pickle.loads(pickle.dumps(ema))):
        module = other.module
        assert module.blocks[0].table is not model.blocks[0].table
        assert torch.equal(module.blocks[0].table, model.blocks[0].table)
        assert module.blocks[1].table is module.blocks[0].table
        assert torch.equal(module.mask, model.mask)
        torch.testing.assert_close(module(x), expected, rtol=0, atol=0)
        other.update(model)  # binds to the model by name and keeps working
    parent = nn.Module()
    parent.model, parent.ema = model, ema
    twin = copy.deepcopy(parent)
    assert_shares_the_tables(twin.ema.module, twin.model)
    assert twin.model.mask is not model.mask
    torch.testing.assert_close(twin.ema.module(x), expected, rtol=0, atol=0)


@cuda
@pytest.mark.parametrize(
    "model_device, ema_device",
    [("cuda", None), ("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")],
)
def test_non_persistent_buffers_across_devices(model_device, ema_device):
    """Shared where the EMA lives on the model's device; an EMA on another device (a CPU EMA of
    a CUDA model) holds one copy of each table there (the table of both blocks stays one
    tensor), so ema.module runs on the EMA's device."""
    torch.manual_seed(20)
    g = torch.Generator().manual_seed(21)
    model = CachedTables().to(model_device)
    ema = fused_ema.ModelEma(model, decay=0.75, device=ema_device)
    ema.update(drifted(model, g))
    module = ema.module
    if ema_device is None or ema_device == model_device:
        assert_shares_the_tables(module, model)
    else:
        assert len(module.blocks) == len(model.blocks)
        for ours, theirs in zip(module.blocks, model.blocks):
            assert ours.table.device.type == ema_device
            assert torch.equal(ours.table.cpu(), theirs.table.cpu())
        assert module.blocks[1].table is module.blocks[0].table
        assert module.mask.device.type == ema_device
        assert torch.equal(module.mask.cpu(), model.mask.cpu())
    assert_evaluates(ema, model, g)


class Locked(nn.Module):
    """A model deepcopy cannot copy (it holds a lock), as in real training code."""

    def __init__(self):
        super().__init__()
        self.net = small_mlp()
        self.lock = threading.Lock()

    def forward(self, x):
        return self.net(x)


def test_model_that_cannot_be_deepcopied():
    torch.manual_seed(7)
    model = Locked()
    ema = fused_ema.ModelEma(model, decay=0.5)  # no deepcopy needed to average
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ema.update(model)
    train_step(model.net, opt)
    ema.update(model)
    # ema.module runs the model itself, in eval mode, with the EMA swapped in for the call
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = Locked()
    ema.copy_to(reference)
    x = torch.randn(5, 6)
    with torch.no_grad():
        got = ema.module(x)
        expected = reference.eval()(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert model.training and model.net[1].training  # modes restored
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert set(ema.module.state_dict()) == set(ema.names())


def test_wrappers_bind_to_the_same_names():
    model = TiedNet()
    plain = fused_ema.ModelEma(model).names()
    assert fused_ema.ModelEma(torch.compile(model)).names() == plain
    assert fused_ema.ModelEma(nn.DataParallel(model)).names() == plain
    assert "head.weight" in plain and "embed.weight" in plain


@pytest.mark.parametrize("bad", [None, 5, "model", torch.ones(3)])
def test_a_model_that_is_not_a_module_is_a_type_error_that_changes_nothing(bad):
    # It was an AttributeError ("'int' object has no attribute '__dict__'") naming no argument.
    torch.manual_seed(8)
    model = small_mlp()
    with pytest.raises(TypeError, match="must be an nn.Module, got "):
        fused_ema.ModelEma(bad)
    ema = fused_ema.ModelEma(model, decay=0.9)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    calls = [ema.update, ema.resync, ema.set, ema.copy_to] + [ema.stats] * (bad is not None)
    for call in calls:  # stats(None): the stats without a model
        with pytest.raises(TypeError, match=type(bad).__name__):
            call(bad)
    assert ema.step == 1
    assert all(torch.equal(ema.state_dict()["weights"][k], v) for k, v in before.items())


def test_stats_report_distance_window_and_non_finite():
    torch.manual_seed(6)
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, decay=0.99)
    ema.update(model)
    stats = ema.stats(model)
    assert stats["relative_distance"] == 0.0 and stats["step"] == 1
    for _ in range(10):
        train_step(model, opt)
        ema.update(model)
    stats = ema.stats(model)
    assert stats["relative_distance"] > 0
    assert stats["window"] == pytest.approx(100.0)
    assert stats["averaged"] == 8 and stats["copied"] == 1 and stats["untracked"] == 0
    assert stats["ema_nan"] == 0
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    ema.update(model)
    stats = ema.stats(model)
    assert stats["ema_nan"] == 1 and stats["model_nan"] == 1
    assert math.isnan(stats["relative_distance"])  # the NaN propagates, never reads as 0


@pytest.mark.parametrize(("every", "how"), [(1, "compensated"), (20, "compensated"), (20, "plain")])
def test_stats_unchanged_fraction_is_what_the_next_update_leaves_unchanged(every, how):
    # With update_every=k the fraction was measured with 1 - decay, not the 1 - decay ** k an
    # update applies: a bf16 EMA that moved on most elements read as stalled.
    torch.manual_seed(7)
    model = nn.Linear(48, 48)
    ema = fused_ema.ModelEma(
        model,
        decay=0.995,
        dtype=torch.bfloat16,
        stochastic_rounding=False,  # rounded to nearest: the next update's result is determined
        update_every=every,
        update_every_decay=how,
    )
    ema.update(model, step=1)
    for step in (1 + every, 1 + 2 * every):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight), alpha=0.3)
            model.bias.add_(torch.randn_like(model.bias), alpha=0.3)
        predicted = ema.stats(model)["unchanged_fraction"]
        before = [t.clone() for t in (ema.module.weight, ema.module.bias)]
        ema.update(model, step=step)
        after = (ema.module.weight, ema.module.bias)
        same = sum(int((a == b).sum()) for a, b in zip(after, before))
        assert predicted == same / sum(b.numel() for b in before)
        assert 0.0 < predicted < 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(decay=1.5), "decay"),
        (dict(decay=-0.1), "decay"),
        (dict(min_decay=0.99999), "min_decay"),
        (dict(warmup=(0.0, 1.0)), "warmup"),
        (dict(warmup="yes"), "warmup"),
        (dict(update_every=0), "update_every"),
        (dict(update_after_step=-1), "update_after_step"),
        (dict(buffers="sometimes"), "buffers"),
        (dict(on_mismatch="ignore"), "on_mismatch"),
        (dict(dtype=torch.int32), "dtype"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fused_ema.ModelEma(small_mlp(), **kwargs)


@pytest.mark.parametrize("step", [None, 7])
def test_failed_update_leaves_step_and_weights_as_they_were(monkeypatch, step):
    import fused_ema._update.plan as plan_module
    import fused_ema._update.prepared as prepared_module

    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9, warmup=True)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    decay_before = ema.current_decay

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    # The fused call of either form of an update: a prepared one's single call, or lerp_.
    monkeypatch.setattr(plan_module, "lerp_", broken)
    monkeypatch.setattr(prepared_module.Prepared, "run", broken)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        ema.update(model, step=step)
    assert ema.step == 1 and ema.current_decay == decay_before
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name


def test_an_ema_built_or_swapped_under_inference_mode_works_outside_it():
    """Lightning runs validate/test/predict under inference_mode and leaves them (or fails) outside
    it: an EMA built there could never load a checkpoint (its step counter was an inference
    tensor), and a swap entered there failed to leave, stranding the EMA's weights in the model."""
    torch.manual_seed(43)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7))
    with torch.inference_mode():
        ema = fused_ema.ModelEma(model, decay=0.75)
    ema.update(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(model)
    saved = ema.state_dict()
    ema.load_state_dict(saved)  # before: "Inplace update to inference tensor outside InferenceMode"
    saved = copy.deepcopy(saved)  # its tensors were the EMA's own, which the swap exchanges
    training = {k: v.clone() for k, v in model.state_dict().items()}
    held = contextlib.ExitStack()
    with torch.inference_mode():
        held.enter_context(ema.swapped(model))
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved["weights"][name]), name
    held.close()  # left outside the mode
    for name, value in model.state_dict().items():
        assert torch.equal(value, training[name]), name
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, saved["weights"][name]), name
    assert ema.step == 2


def test_a_model_tensor_changed_inside_swapped_loses_only_its_own_values():
    """`.data =` of another shape inside the block: its EMA values went with the old memory. The
    swap-out refused every tensor and left the EMA stuck "inside swapped()" for good; now the
    others come back, a ValueError names it, and the EMA stays usable."""
    torch.manual_seed(44)
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema.update(model)
    training = copy.deepcopy(model.state_dict())
    averaged = copy.deepcopy(ema.state_dict()["weights"])
    with pytest.raises(ValueError, match=r"the model's 0\.weight changed inside the block"):
        with ema.swapped(model):
            model[0].weight.data = torch.randn(8, 6)
    now = ema.state_dict()["weights"]
    for name, value in model.state_dict().items():
        if name != "0.weight":
            assert torch.equal(value, training[name]), name
            assert torch.equal(now[name], averaged[name]), name
    assert torch.equal(now["0.weight"], training["0.weight"])  # the block's start, as said
    with pytest.raises(fused_ema.StructureMismatchError, match="0.weight"):
        ema.update(model)
    model[0].weight.data = training["0.weight"].clone()
    ema.update(model)
    assert ema.step == 3


def test_ema_to_under_inference_mode_leaves_tensors_later_updates_can_write():
    # The converted EMA tensors were inference tensors: every update after the block raised.
    torch.manual_seed(41)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    ema = fused_ema.ModelEma(model, decay=0.75)
    ema.update(model)
    with torch.inference_mode():
        ema.to(torch.float64)
    start = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(model)
    for name, value in model.state_dict().items():
        expected = start[name] + 0.25 * (value.double() - start[name])
        assert torch.allclose(ema.state_dict()["weights"][name], expected, rtol=0, atol=1e-12)


def test_ema_module_inside_swapped_is_refused_rather_than_handing_out_the_models_weights():
    """Inside swapped() the EMA's tensors hold the model's weights: ema.module.state_dict() (the
    README's checkpoint recipe) saved those as the EMA's."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2))
    ema = fused_ema.ModelEma(model, decay=0.5)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    averaged = ema.module.state_dict()["0.weight"].clone()
    with ema.swapped(model):
        with pytest.raises(RuntimeError, match="ema.module inside `with ema.swapped"):
            ema.module.state_dict()
        assert torch.equal(model[0].weight, averaged)  # the model holds the EMA's weights
    assert torch.equal(ema.module.state_dict()["0.weight"], averaged)


def test_share_memory_moves_the_ema_tensors_to_shared_memory_and_updates_continue():
    """nn.Module.share_memory() went through _apply, which leaves the EMA as it is: a no-op."""
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    before = ema.module[0].weight.double().clone()
    assert ema.share_memory() is ema
    assert all(t.is_shared() for t in ema.module.state_dict().values())
    with torch.no_grad():
        model[0].weight.add_(torch.randn(4, 4))
    ema.update(model)
    expected = before.lerp(model[0].weight.double(), 0.5)
    torch.testing.assert_close(ema.module[0].weight.double(), expected, rtol=0, atol=1e-6)
    assert ema.module[0].weight.is_shared()


def test_raising_the_decay_of_a_16_bit_round_to_nearest_ema_warns_before_it_changes():
    model = nn.Linear(4, 4)
    ema = fused_ema.ModelEma(model, 0.5, dtype=torch.bfloat16, stochastic_rounding=False)
    with pytest.warns(fused_ema.PrecisionWarning, match="decay 0.9999"):
        ema.decay = 0.9999
    with warnings.catch_warnings(), pytest.raises(fused_ema.PrecisionWarning):
        warnings.simplefilter("error")
        ema.decay = 0.99999
    assert ema.decay == 0.9999
