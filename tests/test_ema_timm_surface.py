"""ModelEma used the way timm uses its ModelEmaV3: the constructor's positional order, get_decay,
set, calling the EMA and .eval() in a copy of train.py's validate(), distribute_bn's buffer walk
through unwrap_model, the checkpoint saver's state_dict_ema and resuming with timm's real
load_checkpoint (timm/models/_helpers.py, loaded on its own); the real ModelEmaV3 run beside it
as the reference. Also the nn.Module side: .to(), a parent module's state dict, pickling."""

import copy
import importlib.util
import inspect
import io
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import fused_ema
from ema_helpers import TiedNet, small_mlp, train_step, trained
from peers import require_pinned_timm, timm_model_ema

V3_ARGS = (0.999, 0.1, 5, True, 1.0, 0.75, "cpu", torch.float32, True, 7, True, False)


def timm_helpers():
    """timm/models/_helpers.py (load_checkpoint, clean_state_dict): it imports only torch."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "_helpers.py"
    module_spec = importlib.util.spec_from_file_location("_timm_models_helpers", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# Copies of timm's train.py / utils code paths that touch the EMA object.
def unwrap_model(model):  # timm.utils.model.unwrap_model (its timm-ModelEma branch left out)
    if hasattr(model, "module"):
        return unwrap_model(model.module)
    elif hasattr(model, "_orig_mod"):
        return unwrap_model(model._orig_mod)
    return model


def distribute_bn(model, broadcast):  # timm.utils.distributed.distribute_bn, collective injected
    for bn_name, bn_buf in unwrap_model(model).named_buffers(recurse=True):
        if ("running_mean" in bn_name) or ("running_var" in bn_name):
            broadcast(bn_buf)


def validate(model, loader, loss_fn):  # train.py's validate(), its EMA-facing lines
    model.eval()
    outputs, losses = [], []
    with torch.no_grad():
        for input, target in loader:
            output = model(input)
            if isinstance(output, (tuple, list)):
                output = output[0]
            losses.append(loss_fn(output, target))
            outputs.append(output)
    return torch.cat(outputs), torch.stack(losses)


def weights(ema):
    return ema.state_dict()["weights"]


def assert_same(state: dict, reference: dict):
    for name, expected in reference.items():
        assert torch.equal(state[name], expected.to(state[name].dtype)), name


def loader(seed, batches=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g))] * batches


# ---------------------------------------------------------------------- the constructor


def test_positional_order_is_timm_v3s():
    require_pinned_timm()
    timm = timm_model_ema()
    theirs = list(inspect.signature(timm.ModelEmaV3).parameters)
    ours = list(inspect.signature(fused_ema.ModelEma).parameters)
    assert ours[: len(theirs)] == theirs
    for name in ours[len(theirs) :]:  # fused_ema's own options follow, keyword-only
        kind = inspect.signature(fused_ema.ModelEma).parameters[name].kind
        assert kind is inspect.Parameter.KEYWORD_ONLY, name


def test_positional_arguments_mean_what_they_mean_for_v3():
    require_pinned_timm()
    timm = timm_model_ema()
    torch.manual_seed(0)
    model = small_mlp()
    theirs = timm.ModelEmaV3(model, *V3_ARGS)
    ours = fused_ema.ModelEma(model, *V3_ARGS)
    keywords = fused_ema.ModelEma(
        model,
        decay=0.999,
        min_decay=0.1,
        update_after_step=5,
        use_warmup=True,
        warmup_gamma=1.0,
        warmup_power=0.75,
        device="cpu",
        dtype=torch.float32,
        stochastic_rounding=True,
        stochastic_rounding_seed=7,
        foreach=True,
        exclude_buffers=False,
    )
    assert (
        ours.schedule
        == keywords.schedule
        == {
            "decay": 0.999,
            "min_decay": 0.1,
            "warmup": (1.0, 0.75),
            "update_after_step": 5,
            "update_every": 1,
            "update_every_decay": "compensated",
        }
    )
    assert ours.device == torch.device("cpu") and ours.buffer_mode == "average"
    rounding = ours.state_dict()["rounding"]
    assert rounding == {"stochastic_rounding": True, "stochastic_rounding_seed": 7}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 41):
        train_step(model, optimizer, g)
        theirs.update(model, step=step)
        ours.update(model, step=step)
        keywords.update(model, step=step)
    assert_same(weights(ours), theirs.module.state_dict())
    assert_same(weights(keywords), theirs.module.state_dict())


def test_exclude_buffers_positional_copies_buffers():
    model = trained(small_mlp(), 2)
    args = list(V3_ARGS)
    args[-1] = True
    assert fused_ema.ModelEma(model, *args).buffer_mode == "copy"
    with pytest.raises(ValueError, match="exclude_buffers"):
        fused_ema.ModelEma(model, *args, buffers="ignore")
    with pytest.raises(ValueError, match="use_warmup"):
        fused_ema.ModelEma(model, 0.9, use_warmup=True, warmup=(2.0, 0.5))


# ---------------------------------------------------------------------- get_decay and set

DECAY_CONFIGS = [
    dict(decay=0.9999),
    dict(decay=0.999, use_warmup=True),
    dict(decay=0.99, use_warmup=True, warmup_gamma=2.0, warmup_power=0.75, min_decay=0.2),
    dict(decay=0.995, use_warmup=True, warmup_gamma=0.3, warmup_power=1.5, update_after_step=9),
    dict(decay=0.95, update_after_step=3),
    dict(decay=1.0, use_warmup=True, warmup_power=1.0, min_decay=0.5, update_after_step=1),
]


@pytest.mark.parametrize("config", DECAY_CONFIGS)
def test_get_decay_equals_timm_v3(config):
    timm = timm_model_ema()
    model = small_mlp()
    theirs = timm.ModelEmaV3(model, **config)
    ours = fused_ema.ModelEma(model, **config)
    steps = list(range(0, 400)) + [10**4, 123_457, 10**6, 2**40]
    for step in steps:
        assert ours.get_decay(step) == theirs.get_decay(step), step
    assert ours.get_decay() == theirs.get_decay() == config["decay"]
    assert ours.get_decay(torch.tensor(57)) == theirs.get_decay(57)
    with pytest.raises(ValueError, match="step"):
        ours.get_decay(-1)
    with pytest.raises(ValueError, match="step"):
        ours.get_decay(2.5)


def test_get_decay_is_what_the_update_uses():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, 0.99, warmup=True, update_every=3, update_after_step=2)
    for step in range(1, 30):
        ema.update(trained(model, 1, seed=step))
        assert ema.current_decay == ema.get_decay(step), step


TIMM_ATTRIBUTES = (
    "decay",
    "min_decay",
    "update_after_step",
    "use_warmup",
    "warmup_gamma",
    "warmup_power",
    "exclude_buffers",
    "dtype",
    "stochastic_rounding",
    "stochastic_rounding_seed",
    "device",
)


@pytest.mark.parametrize(
    "config",
    DECAY_CONFIGS
    + [
        dict(decay=0.9, exclude_buffers=True, dtype=torch.bfloat16, stochastic_rounding_seed=7),
        dict(decay=0.9, dtype=torch.float16, stochastic_rounding=False, device="cpu"),
    ],
)
def test_timm_attributes_read_as_on_timm(config):
    timm = timm_model_ema()
    model = small_mlp()
    theirs = timm.ModelEmaV3(model, **config)
    ours = fused_ema.ModelEma(model, **config)
    for name in TIMM_ATTRIBUTES:
        mine, timms = getattr(ours, name), getattr(theirs, name)
        if name == "device" and timms is not None:
            mine, timms = torch.device(mine), torch.device(timms)
        assert mine == timms, name
    assert ours.foreach is True


def test_schedule_attributes_can_be_set_and_refuse_bad_values():
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.99, min_decay=0.1, use_warmup=True)
    ema.min_decay = 0.5
    ema.update_after_step = 4
    assert (ema.min_decay, ema.update_after_step) == (0.5, 4)
    # timm's ramp at s = step - update_after_step - 1: 1 - (1 + s) ** (-2/3), floored at min_decay
    assert ema.get_decay(5) == 0.0 and ema.get_decay(6) == 0.5
    assert ema.get_decay(20) == pytest.approx(1 - 16 ** (-2 / 3), rel=1e-12)
    for name, bad in (("min_decay", 0.995), ("min_decay", -1), ("update_after_step", 1.5)):
        with pytest.raises(ValueError, match=name):
            setattr(ema, name, bad)
    assert (ema.min_decay, ema.update_after_step, ema.decay) == (0.5, 4, 0.99)
    for name in ("use_warmup", "dtype", "exclude_buffers", "stochastic_rounding"):
        with pytest.raises(AttributeError):
            setattr(ema, name, getattr(ema, name))


def test_update_every_can_be_set_and_applies_from_the_next_update():
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.9)
    ema.update(model, step=1)  # copies the model
    ema.update_every = 3
    assert ema.update_every == 3 and ema.state_dict()["schedule"]["update_every"] == 3
    for bad in (0, 1.5, True, "3"):
        with pytest.raises(ValueError, match="update_every"):
            ema.update_every = bad
        assert ema.update_every == 3
    expected = {k: v.double() for k, v in ema.module.state_dict().items()}
    for step in range(2, 8):
        trained(model, 1, seed=step)
        ema.update(model, step=step)
        if step in (4, 7):  # steps 1, 1 + k, 1 + 2k, ... with decay ** k (compensated)
            for name, value in model.state_dict().items():
                expected[name] = expected[name] * 0.9**3 + value.double() * (1 - 0.9**3)
        for name, value in ema.module.state_dict().items():
            if value.is_floating_point():  # integer buffers are copied
                torch.testing.assert_close(value.double(), expected[name])


def test_decay_can_be_set_as_on_timm_and_is_checked_first():
    timm = timm_model_ema()
    model = trained(small_mlp(), 2)
    ours = fused_ema.ModelEma(model, 0.9, min_decay=0.1)
    theirs = timm.ModelEmaV3(model, 0.9, min_decay=0.1)
    for step in range(1, 4):
        trained(model, 1, seed=step)
        ours.update(model, step=step)
        theirs.update(model, step=step)
    ours.decay = theirs.decay = 0.6
    assert ours.decay == 0.6 and ours.get_decay() == 0.6 and ours.schedule["decay"] == 0.6
    for step in range(4, 7):
        trained(model, 1, seed=step)
        ours.update(model, step=step)
        theirs.update(model, step=step)
        assert ours.current_decay == 0.6
    for name, value in theirs.module.state_dict().items():
        torch.testing.assert_close(ours.module.state_dict()[name], value)
    assert ours.state_dict()["schedule"]["decay"] == 0.6
    before = {k: v.clone() for k, v in ours.module.state_dict().items()}
    for bad in (1.5, float("nan"), "0.9", None, 0.05):  # 0.05: below min_decay
        with pytest.raises(ValueError, match="decay"):
            ours.decay = bad
        assert ours.decay == 0.6
    with pytest.raises(ValueError, match=r"min_decay \(at most decay\) must be .* \[0.0, 0.05\]"):
        ours.decay = 0.05  # the bound it breaks is named as such
    ours.update(model, step=7)
    for name, value in ours.module.state_dict().items():
        expected = before[name].double() * 0.6 + model.state_dict()[name].double() * 0.4
        if value.is_floating_point():
            torch.testing.assert_close(value.double(), expected)


def test_set_copies_the_model_and_keeps_the_step():
    timm = timm_model_ema()
    model = trained(TiedNet(), 2)
    ours = fused_ema.ModelEma(model, 0.9)
    theirs = timm.ModelEmaV3(model, 0.9)
    for step in range(1, 5):
        trained(model, 1, seed=step)
        ours.update(model, step=step)
    trained(model, 1, seed=99)
    before_step = ours.step
    ours.set(model)
    theirs.set(model)
    assert ours.step == before_step
    assert_same(weights(ours), theirs.module.state_dict())
    assert_same(weights(ours), {k: v for k, v in model.state_dict().items() if k != "cache"})
    # a model of another structure: refused before anything is written
    snapshot = {k: v.clone() for k, v in weights(ours).items()}
    with pytest.raises(fused_ema.StructureMismatchError):
        ours.set(small_mlp())
    assert_same(weights(ours), snapshot)


# ---------------------------------------------------------------------- train.py's pattern


def test_timm_training_pattern_with_the_real_v3_beside_it(tmp_path):
    timm = timm_model_ema()
    helpers = timm_helpers()
    torch.manual_seed(3)
    model = small_mlp()
    theirs = timm.ModelEmaV3(model, decay=0.9, use_warmup=True)
    ours = fused_ema.ModelEma(model, decay=0.9, use_warmup=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(4)
    num_updates = 0
    for _ in range(12):
        train_step(model, optimizer, g)
        num_updates += 1
        theirs.update(model, step=num_updates)
        ours.update(model, step=num_updates)
    loss_fn = nn.CrossEntropyLoss()
    data = loader(5)

    # distribute_bn(model_ema, ...): the buffers it reaches are the EMA's own, written in place
    seen = []

    def broadcast(buf):  # stands in for dist.broadcast: rank 0's values arrive in place
        seen.append(buf)
        buf.mul_(0.5).add_(0.25)

    distribute_bn(theirs, broadcast)
    theirs_seen, seen = seen, []
    distribute_bn(ours, broadcast)
    assert len(seen) == len(theirs_seen) == 2
    assert_same(weights(ours), theirs.module.state_dict())

    # validate(model_ema, ...): .eval() and model_ema(input)
    ours.train()
    assert ours.module.training
    out_theirs, loss_theirs = validate(theirs, data, loss_fn)
    out_ours, loss_ours = validate(ours, data, loss_fn)
    assert not ours.training and not ours.module.training
    assert torch.equal(out_ours, out_theirs) and torch.equal(loss_ours, loss_theirs)
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(theirs.module.state_dict())
    assert torch.equal(out_ours, torch.cat([reference(x) for x, _ in data]))

    # CheckpointSaver: save_state['state_dict_ema'] = get_state_dict(model_ema, unwrap_model)
    path = tmp_path / "last.pth.tar"
    torch.save(
        {
            "epoch": 1,
            "state_dict": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state_dict_ema": unwrap_model(ours).state_dict(),
        },
        path,
    )
    # resume: load_checkpoint(model_ema.module, args.resume, use_ema=True), both EMAs
    resumed_theirs = timm.ModelEmaV3(model, decay=0.9, use_warmup=True)
    resumed_ours = fused_ema.ModelEma(model, decay=0.9, use_warmup=True)
    helpers.load_checkpoint(resumed_theirs.module, str(path), use_ema=True)
    helpers.load_checkpoint(resumed_ours.module, str(path), use_ema=True)
    assert_same(weights(resumed_ours), weights(ours))
    for _ in range(5):
        train_step(model, optimizer, g)
        num_updates += 1
        resumed_theirs.update(model, step=num_updates)
        resumed_ours.update(model, step=num_updates)
    assert_same(weights(resumed_ours), resumed_theirs.module.state_dict())


def test_torch_compile_of_the_ema_as_train_py_does():
    # train.py: model_ema = torch.compile(model_ema); then update, validate, unwrap_model.
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.8)
    compiled = torch.compile(ema)
    for step in range(1, 4):
        compiled.update(trained(model, 1, seed=step), step=step)
    assert ema.step == 3 and unwrap_model(compiled) is ema.module
    compiled.train()
    assert ema.module.training
    out, _ = validate(compiled, loader(1), nn.CrossEntropyLoss())
    assert not ema.module.training
    expected = torch.cat([ema.module(x) for x, _ in loader(1)])
    torch.testing.assert_close(out, expected)  # inductor may fuse float ops differently


def test_the_readme_save_example_is_loaded_by_timm(tmp_path):
    helpers = timm_helpers()
    model = trained(small_mlp(), 3)
    ema = fused_ema.ModelEma(model, decay=0.8, warmup=True)
    for step in range(1, 7):
        ema.update(trained(model, 1, seed=step), step=step)
    path = tmp_path / "ckpt.pt"
    # The README's save example (to "ckpt.pt" there).
    torch.save(
        {
            "state_dict": model.state_dict(),  # timm's load_checkpoint(use_ema=False) reads it
            "state_dict_ema": ema.module.state_dict(),  # ... and this with use_ema=True
            "ema": ema.state_dict(),  # fused_ema's own: the step and schedule too
        },
        path,
    )
    target = small_mlp()
    helpers.load_checkpoint(target, str(path), use_ema=True)
    assert_same(target.state_dict(), weights(ema))
    helpers.load_checkpoint(target, str(path), use_ema=False)
    assert_same(target.state_dict(), model.state_dict())
    resumed = fused_ema.ModelEma(small_mlp(), decay=0.5)
    resumed.load_state_dict(torch.load(path, weights_only=True)["ema"])
    assert resumed.step == 6 and resumed.schedule == ema.schedule
    assert_same(weights(resumed), weights(ema))


def test_timm_reads_the_layouts_the_readme_lists(tmp_path):
    require_pinned_timm()
    helpers = timm_helpers()
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(nn.parallel.DataParallel(model), decay=0.5)
    ema.update(trained(model, 1), step=3)
    plain = ema.module.state_dict()
    layouts = {
        "state_dict_ema": {"state_dict_ema": plain},
        "model_ema": {"model_ema": plain},
        "module. prefix": {"state_dict_ema": {f"module.{k}": v for k, v in plain.items()}},
        "_orig_mod.module.": {
            "state_dict_ema": {f"_orig_mod.module.{k}": v for k, v in plain.items()}
        },
        "bare state dict": plain,
        "full_state_dict": {"state_dict_ema": ema.full_state_dict()},
    }
    for name, saved in layouts.items():
        path = tmp_path / f"{name}.pt"
        torch.save(saved, path)
        target = small_mlp()
        helpers.load_checkpoint(target, str(path), use_ema=True)
        assert_same(target.state_dict(), weights(ema))
        again = fused_ema.ModelEma(small_mlp())
        assert again.load_state_dict(str(path)).missing_keys == [], name
        assert_same(weights(again), weights(ema))


# ---------------------------------------------------------------------- an nn.Module


def test_it_is_a_module_that_owns_no_tensors():
    model = trained(TiedNet(), 2)
    ema = fused_ema.ModelEma(model)
    assert isinstance(ema, nn.Module)
    assert list(ema.parameters()) == [] and list(ema.buffers()) == []
    assert list(ema.named_buffers()) == [] and list(ema.children()) == []
    assert ema.buffer_mode == "average"
    assert not ema.training and not ema.module.training
    x = torch.randint(0, 11, (5,))
    assert torch.equal(ema(x), ema.module(x))
    assert ema.train() is ema and ema.module.training and ema.training
    assert ema.eval() is ema and not ema.module.training
    assert "decay=0.9999" in repr(ema)


class Holder(nn.Module):
    """A LightningModule-like parent: the model and its EMA as attributes."""

    def __init__(self, decay=0.7, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = small_mlp()
        self.ema = fused_ema.ModelEma(self.model, decay, warmup=True, update_after_step=1)

    def forward(self, x):
        return self.model(x)


def snapshot(ema):
    return {k: v.clone() for k, v in weights(ema).items()}, ema.step, ema.schedule


def assert_unchanged(ema, before):
    tensors, step, schedule = before
    assert_same(weights(ema), tensors)
    assert ema.step == step and ema.schedule == schedule


def trained_holder(steps=5):
    holder = Holder()
    opt = torch.optim.SGD(holder.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        train_step(holder.model, opt, g)
        holder.ema.update(holder.model)
    return holder


def test_a_parent_never_hands_the_ema_to_an_optimizer_or_moves_it():
    holder = Holder()
    assert {id(p) for p in holder.parameters()} == {id(p) for p in holder.model.parameters()}
    assert [n for n, _ in holder.named_buffers()] == [
        "model." + n for n, _ in holder.model.named_buffers()
    ]
    holder.double()  # the model becomes float64, the EMA keeps its float32
    assert holder.model[0].weight.dtype == torch.float64
    assert all(t.dtype != torch.float64 for t in weights(holder.ema).values())
    holder.ema.update(holder.model)  # and keeps working (the float64 model is cast)
    assert torch.equal(weights(holder.ema)["0.weight"], holder.model[0].weight.float())


def test_a_ddp_wrapped_parent_leaves_the_ema_to_itself(tmp_path):
    # DDP registers, buckets and broadcasts the parent's parameters and buffers: none is the EMA's.
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not already initialised")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        holder = Holder()
        ddp = nn.parallel.DistributedDataParallel(holder)
        assert {id(p) for p in ddp.parameters()} == {id(p) for p in holder.model.parameters()}
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(6)
        for _ in range(3):
            loss = ddp(torch.randn(8, 6, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            holder.ema.update(holder.model)
        state = copy.deepcopy(ddp.state_dict())
        assert state["module.ema.step"] == 3
        other = Holder(decay=0.3, seed=1)
        nn.parallel.DistributedDataParallel(other).load_state_dict(state)
        assert other.ema.step == 3 and other.ema.decay == holder.ema.decay
        assert_same(weights(other.ema), weights(holder.ema))
    finally:
        dist.destroy_process_group()


def test_a_parent_state_dict_round_trips_the_ema():
    holder = trained_holder()
    saved = io.BytesIO()
    torch.save(holder.state_dict(), saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    assert state["ema.step"] == 5
    assert set(k for k in state if k.startswith("ema.")) == {
        "ema.step",
        *(f"ema.weights.{n}" for n in holder.ema.names()),
    }
    fresh = Holder(decay=0.1, seed=9)  # other weights, other decay
    assert fresh.load_state_dict(state).missing_keys == []
    assert fresh.ema.step == 5 and fresh.ema.schedule == holder.ema.schedule
    assert_same(weights(fresh.ema), weights(holder.ema))
    x = torch.randn(4, 6)
    assert torch.equal(fresh.ema(x), holder.ema(x))
    # the restored EMA continues like the original
    trained(holder.model, 1, seed=5)
    fresh.model.load_state_dict(holder.model.state_dict())
    for parent in (fresh, holder):
        parent.ema.update(parent.model)
    assert_same(weights(fresh.ema), weights(holder.ema))


@pytest.mark.parametrize(
    "damage",
    ["missing weight", "missing step", "wrong shape", "bad step", "unexpected", "bad schedule"],
)
@pytest.mark.parametrize("strict", [True, False])
def test_a_damaged_parent_state_dict_reports_and_changes_nothing(damage, strict):
    state = copy.deepcopy(trained_holder().state_dict())
    target = Holder(decay=0.2, seed=4)
    opt = torch.optim.SGD(target.parameters(), lr=0.1)
    for _ in range(2):
        train_step(target.model, opt)
        target.ema.update(target.model)
    before = snapshot(target.ema)
    if damage == "missing weight":
        del state["ema.weights.0.weight"]
    elif damage == "missing step":
        del state["ema.step"]
    elif damage == "wrong shape":
        state["ema.weights.3.bias"] = torch.randn(7)
    elif damage == "bad step":
        state["ema.step"] = torch.tensor(-3)
    elif damage == "unexpected":
        state["ema.weights.9.weight"] = torch.randn(2)
    else:
        state._metadata["ema"]["fused_ema"]["schedule"]["decay"] = 2.0
    reported = damage in ("missing weight", "missing step", "unexpected")
    if strict or not reported:
        with pytest.raises(RuntimeError) as err:
            target.load_state_dict(state, strict=strict)
        key = {"bad schedule": "decay", "bad step": "step", "wrong shape": "3.bias"}.get(damage)
        assert key is None or key in str(err.value)
    else:
        result = target.load_state_dict(state, strict=False)
        assert result.missing_keys or result.unexpected_keys
    assert_unchanged(target.ema, before)


def test_a_parent_state_dict_without_metadata_keeps_the_ema_schedule():
    holder = trained_holder()
    state = dict(holder.state_dict())  # a plain dict: _metadata gone, as after safetensors
    fresh = Holder(decay=0.1, seed=9)
    fresh.load_state_dict(state)
    assert fresh.ema.step == 5 and fresh.ema.decay == 0.1
    assert_same(weights(fresh.ema), weights(holder.ema))


def test_state_dict_keeps_its_own_format_and_accepts_assign():
    ema = fused_ema.ModelEma(trained(small_mlp(), 2), 0.5)
    state = ema.state_dict()
    assert state["format"] == "fused_ema.ModelEma" and state["buffers"] == "average"
    other = fused_ema.ModelEma(small_mlp(), 0.5)
    other.load_state_dict(state, assign=True)
    assert_same(weights(other), state["weights"])
    flat = ema.state_dict(prefix="e.")
    assert flat["e.step"] == 0 and "e.weights.0.weight" in flat


# ---------------------------------------------------------------------- .to()


def test_to_dtype_converts_the_average_all_at_once():
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.8)
    ema.update(trained(model, 1), step=1)
    ema.update(trained(model, 1, seed=1), step=2)
    before = {k: v.double() for k, v in weights(ema).items()}
    assert ema.to(torch.float64) is ema
    now = weights(ema)
    assert (
        now["0.weight"].dtype == torch.float64 and now["1.num_batches_tracked"].dtype == torch.int64
    )
    assert ema.module[0].weight is ema._binding.table.by_name["0.weight"].ema  # still shared
    trained(model, 1, seed=2)
    ema.update(model, step=3)
    for name, value in model.state_dict().items():
        if value.is_floating_point():
            expected = torch.lerp(before[name], value.double(), 1 - 0.8)  # float64 arithmetic
            assert torch.equal(weights(ema)[name], expected), name
    ema.float()
    assert weights(ema)["0.weight"].dtype == torch.float32
    # nn.Module.type reached the EMA through _apply, a no-op: it returned self, unconverted.
    assert ema.type(torch.float64) is ema and weights(ema)["0.weight"].dtype == torch.float64
    with pytest.raises(TypeError, match="torch.dtype"):
        ema.type("torch.HalfTensor")
    assert weights(ema)["0.weight"].dtype == torch.float64


def test_a_non_bool_non_blocking_is_refused_before_anything_changes():
    """update(non_blocking="no") ran a non_blocking update ("no" is truthy); attach refused it."""
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.8)
    ema.update(model)
    before = snapshot(ema)
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match="non_blocking must be True or False"):
            ema.update(model, non_blocking=bad)
    assert_unchanged(ema, before)


def test_to_a_device_and_refusals_change_nothing():
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.8)
    ema.update(model)
    assert ema.to("cpu") is ema and ema.device == torch.device("cpu")
    assert ema.cpu().device == torch.device("cpu")
    before = snapshot(ema)
    missing = f"cuda:{torch.cuda.device_count()}"  # a device that is not there
    for bad, error in [
        ((missing,), (RuntimeError, AssertionError)),
        ((torch.int32,), ValueError),
        ((torch.float8_e4m3fn,), ValueError),  # floating, but no kernel averages it
        (("meta",), ValueError),
        ((), ValueError),  # memory_format below
    ]:
        kwargs = {"memory_format": torch.channels_last} if not bad else {}
        with pytest.raises(error):
            ema.to(*bad, **kwargs)
        assert_unchanged(ema, before)
        assert ema.device == torch.device("cpu") and ema._binding.policy.dtype is None
    ema.update(trained(model, 1))  # still usable


def test_the_other_backends_move_as_to_does_and_to_empty_is_refused():
    # nn.Module's xpu(), mtia(), ipu() and to_empty() went through _apply, which keeps the EMA
    # where it is: each returned the EMA unmoved, as if it had moved.
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.8)
    ema.update(model)
    before = snapshot(ema)
    for kind in ("xpu", "mtia", "ipu"):
        if getattr(getattr(torch, kind, None), "is_available", lambda: False)():
            continue  # (a machine with that device: it would move)
        for index in (None, 0):
            with pytest.raises(Exception) as moved:
                getattr(ema, kind)(index)
            with pytest.raises(type(moved.value)):
                ema.to(torch.device(kind, index))  # the same refusal as ema.to()'s
            assert_unchanged(ema, before)
    with pytest.raises(RuntimeError, match=r"to_empty\(\) would drop the average"):
        ema.to_empty(device="cpu")
    assert_unchanged(ema, before)
    ema.update(trained(model, 1))


@pytest.mark.parametrize(
    "kwargs",
    [{"dtype": torch.float8_e4m3fn}, {"dtype": torch.float8_e5m2}, {"device": "meta"}],
)
def test_an_ema_no_update_could_run_is_refused_when_built(kwargs):
    # Both were accepted, and every update then failed (float8: no fused kernel averages it;
    # device="meta": its tensors hold no values, reported as reshaped).
    model = trained(small_mlp(), 1)
    with pytest.raises(ValueError, match=r"dtype|meta") as err:
        fused_ema.ModelEma(model, 0.8, **kwargs)
    assert str(next(iter(kwargs.values()))).removeprefix("torch.") in str(err.value)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        ema = fused_ema.ModelEma(model, 0.8, dtype=dtype)
        ema.update(model)
        ema.update(trained(model, 1))
        assert weights(ema)["0.weight"].dtype == dtype


@pytest.mark.parametrize("device", ["gpu", "cpu:x", 3.5, [], object()])
def test_a_bad_device_is_an_error_naming_the_argument(device):
    # torch.device's own RuntimeError or TypeError reached the caller, naming no argument.
    with pytest.raises(ValueError, match=r"^device must be None, a torch.device or a device") as e:
        fused_ema.ModelEma(small_mlp(), 0.8, device=device)
    assert f"got {device!r}" in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_and_back():
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, 0.8)
    ema.update(model)
    ema.cuda()
    assert all(t.is_cuda for t in weights(ema).values()) and ema._schedule.step.is_cuda
    x = torch.randn(3, 6, device="cuda")
    assert ema(x).is_cuda
    ema.update(trained(model, 1))  # a CPU model into a CUDA EMA
    expected = {k: v.cpu() for k, v in weights(ema).items()}
    ema.cpu()
    assert_same(weights(ema), expected)


# ---------------------------------------------------------------------- pickling


def round_trip(obj, how: str):
    """obj through pickle, or through torch.save and torch.load (full unpickling)."""
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_the_ema_round_trips(how):
    model = trained(TiedNet(), 2)
    ema = fused_ema.ModelEma(model, 0.8, warmup=True)
    for step in range(3):
        ema.update(trained(model, 1, seed=step))
    copy_ = round_trip(ema, how)
    assert isinstance(copy_, fused_ema.ModelEma) and copy_.step == 3
    assert_same(weights(copy_), weights(ema))
    trained(model, 1, seed=9)
    ema.update(model)
    copy_.update(model)  # binds to the model by name
    assert_same(weights(copy_), weights(ema))
    assert copy_.step == ema.step == 4


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_the_ema_module_round_trips(how):
    model = trained(TiedNet(), 2)
    ema = fused_ema.ModelEma(model, 0.8)
    ema.update(trained(model, 1))
    module = ema.module
    loaded = round_trip(module, how)
    assert loaded.head.weight is loaded.embed.weight  # ties kept
    assert_same(loaded.state_dict(), weights(ema))
    x = torch.randint(0, 11, (6,))
    assert torch.equal(loaded(x), ema(x))
    ema.update(trained(model, 1, seed=3))  # the copy is independent of the EMA
    assert not torch.equal(loaded.embed.weight, weights(ema)["embed.weight"])


def test_a_stepless_update_differs_from_v3_as_migrating_md_says():
    """docs/migrating.md: V3's update(model) without a step applies the plain decay from the
    weights it was built with; ModelEma counts its own steps (its first update copies). With
    step= the two agree bit for bit."""
    timm = timm_model_ema()
    torch.manual_seed(4)
    model = small_mlp()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    theirs = timm.ModelEmaV3(model, decay=0.9)
    ours = fused_ema.ModelEma(model, decay=0.9)
    trained(model, 1, seed=5)
    theirs.update(model)
    ours.update(model)
    now = model.state_dict()
    for name, value in theirs.module.state_dict().items():
        if value.is_floating_point():
            expected = torch.lerp(start[name], now[name], 0.1)
            assert torch.allclose(value, expected, atol=1e-6), name
            assert torch.equal(ours.module.state_dict()[name], now[name]), name  # a copy
    stepped = timm.ModelEmaV3(model, decay=0.9)
    counted = fused_ema.ModelEma(model, decay=0.9)
    for step in range(1, 4):
        trained(model, 1, seed=5 + step)
        stepped.update(model, step=step)
        counted.update(model, step=step)
    for name, value in stepped.module.state_dict().items():
        assert torch.equal(counted.module.state_dict()[name], value), name
