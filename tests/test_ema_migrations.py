"""Moving a run to ModelEma keeps its average: each peer (the real package) trains and saves the
way it does, ModelEma loads that file, and both continue on the same weights; they must stay equal
to float rounding. Peers that are not installed skip and say why."""

import argparse
import json
import random

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fused_ema
from benchmarks import peers as peer_access
from ema_helpers import small_mlp, train_step
from peers import peer, timm_model_ema

BEFORE, AFTER = 30, 25  # steps the peer runs before saving, and both run after


class Run:
    """A model trained on fresh random data (AdamW), one step per next()."""

    def __init__(self, model=None, seed=None):
        seed = random.randrange(2**31) if seed is None else seed
        torch.manual_seed(seed)
        self.model = small_mlp() if model is None else model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-2)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.step = 0

    def next(self):
        train_step(self.model, self.optimizer, self.generator)
        self.step += 1
        return self.step


def assert_close_to(ours: fused_ema.ModelEma, expected: dict, prefix: str = ""):
    """Every floating tensor of `expected` (peers truncate integer buffers to a float average, or
    leave them alone) equals ModelEma's to float32 rounding."""
    weights = ours.state_dict()["weights"]
    compared = 0
    for name, value in expected.items():
        if not value.is_floating_point():
            continue
        got = weights[prefix + name]
        torch.testing.assert_close(got, value.to(got.dtype), rtol=1e-5, atol=1e-6, msg=name)
        compared += 1
    assert compared >= 4


def continue_both(run, ours, update_theirs, update_ours, expected, prefix=""):
    """AFTER more training steps, each followed by both updates; the two agree after the first
    (a copy instead of an average would differ by far more than rounding) and the last."""
    for k in range(AFTER):
        step = run.next()
        update_theirs(step)
        update_ours(step)
        if k in (0, AFTER - 1):
            assert_close_to(ours, expected(), prefix)
    live = dict(run.model.named_parameters())
    lag = sum((v - live[k]).norm() for k, v in expected().items() if k in live)
    assert lag > 1e-3  # the average lags the model: a copy would not pass


# ---------------------------------------------------------------------- timm


TIMM_V3 = {
    "warmup": dict(decay=0.995, use_warmup=True, warmup_power=0.75, update_after_step=3),
    "constant": dict(decay=0.99, use_warmup=False),
}


@pytest.mark.parametrize("settings", list(TIMM_V3.values()), ids=list(TIMM_V3))
@pytest.mark.parametrize("saved", ["state_dict_ema", "ModelEmaV3.state_dict"])
def test_timm_model_ema_v3(tmp_path, settings, saved):
    timm = timm_model_ema()
    run = Run()
    theirs = timm.ModelEmaV3(run.model, **settings)
    for _ in range(BEFORE):
        theirs.update(run.model, step=run.next())
    if saved == "state_dict_ema":  # what timm's CheckpointSaver writes (train.py passes args)
        checkpoint = {
            "epoch": 1,
            "arch": "mlp",
            "state_dict": run.model.state_dict(),
            "state_dict_ema": theirs.module.state_dict(),
            "args": argparse.Namespace(model="mlp", lr=0.1, model_ema_decay=0.999),
            "version": 2,
            "metric": 0.5,
        }
        torch.save(checkpoint, tmp_path / "c.pth")
    else:
        torch.save(theirs.state_dict(), tmp_path / "c.pth")  # module.* keys
    ours = fused_ema.ModelEma(run.model, **settings)
    ours.load_state_dict(tmp_path / "c.pth", step=run.step)
    assert ours.step == BEFORE
    continue_both(
        run,
        ours,
        lambda step: theirs.update(run.model, step=step),
        lambda step: ours.update(run.model, step=step),
        lambda: theirs.module.state_dict(),
    )


@pytest.mark.parametrize("version", ["ModelEmaV3 without step", "ModelEmaV2", "ModelEma"])
def test_timm_stepless_emas_load_as_started(tmp_path, version):
    timm = timm_model_ema()
    run = Run()
    if version == "ModelEmaV3 without step":
        theirs = timm.ModelEmaV3(run.model, decay=0.99)
    else:
        theirs = getattr(timm, version)(run.model, decay=0.99)
    inner = theirs.ema if version == "ModelEma" else theirs.module
    for _ in range(BEFORE):
        run.next()
        theirs.update(run.model)
    torch.save({"state_dict_ema": inner.state_dict()}, tmp_path / "c.pth")
    ours = fused_ema.ModelEma(run.model, 0.99)  # the README's row: no step needed
    result = ours.load_state_dict(tmp_path / "c.pth")
    assert result.format == "timm checkpoint"
    assert ours.step == 1  # started: the next update averages
    continue_both(
        run,
        ours,
        lambda step: theirs.update(run.model),
        lambda step: ours.update(run.model),
        lambda: inner.state_dict(),
    )


# ---------------------------------------------------------------------- torch, Lightning


@pytest.mark.parametrize("use_buffers", [True, False])
def test_averaged_model(tmp_path, use_buffers):
    run = Run()
    theirs = AveragedModel(
        run.model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=use_buffers
    )
    for _ in range(BEFORE):
        run.next()
        theirs.update_parameters(run.model)
    torch.save(theirs.state_dict(), tmp_path / "swa.pt")
    # use_buffers=False copies the model's buffers at every update
    ours = fused_ema.ModelEma(run.model, 0.99, buffers="average" if use_buffers else "copy")
    assert ours.load_state_dict(tmp_path / "swa.pt").format == "AveragedModel"
    assert ours.step == BEFORE
    continue_both(
        run,
        ours,
        lambda step: theirs.update_parameters(run.model),
        lambda step: ours.update(run.model),
        lambda: theirs.module.state_dict(),
    )


@pytest.mark.parametrize("every, start", [(1, None), (2, 4)])
def test_lightning_ema_weight_averaging(tmp_path, every, start):
    pl = peer(peer_access.load_lightning)
    from lightning.pytorch.callbacks import Callback, EMAWeightAveraging

    seed = random.randrange(2**31)
    torch.manual_seed(seed)

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_mlp()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-2)

    class SaveAt(Callback):  # a checkpoint in the middle of training, as ModelCheckpoint does
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == BEFORE:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    class Record(Callback):  # the weights EMAWeightAveraging averages after each step
        def __init__(self):
            self.states = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.states.append((trainer.global_step, state))

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(32 * (BEFORE + AFTER), 6)), batch_size=32
    )
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )

    def averaging():
        return EMAWeightAveraging(
            decay=0.99, update_every_n_steps=every, update_starting_at_step=start
        )

    pl.Trainer(max_steps=BEFORE, callbacks=[averaging(), SaveAt()], **options).fit(Lit(), data)
    record = Record()
    resumed = Lit()
    pl.Trainer(max_steps=BEFORE + AFTER, callbacks=[averaging(), record], **options).fit(
        resumed, data, ckpt_path=tmp_path / "mid.ckpt"
    )
    assert len(record.states) == AFTER
    # at the end of fit, EMAWeightAveraging copies its average into the module

    follower = Lit()
    ours = fused_ema.ModelEma(
        follower,
        0.99,
        update_every=every,
        update_every_decay="plain",
        update_after_step=start or 0,
    )
    if every == 1 and start is None:  # n_averaged counts the steps
        result = ours.load_state_dict(tmp_path / "mid.ckpt")
    else:  # it counts updates: the README's row passes the trainer's step
        result = ours.load_state_dict(tmp_path / "mid.ckpt", step=BEFORE)
    assert result.format == "Lightning WeightAveraging"
    assert ours.step == BEFORE
    for global_step, state in record.states:
        follower.load_state_dict(state)
        ours.update(follower, step=global_step)
    assert_close_to(ours, resumed.state_dict())
    last = record.states[-1][1]
    assert (
        sum(
            (resumed.state_dict()[k] - v).abs().sum()
            for k, v in last.items()
            if v.is_floating_point()
        )
        > 1e-3
    )


# ---------------------------------------------------------------------- ema-pytorch, torch_ema


@pytest.mark.parametrize("every, after", [(1, 5), (3, 10)])
def test_ema_pytorch(tmp_path, every, after):
    ema_pytorch = peer(peer_access.load_ema_pytorch)
    run = Run()
    settings = dict(update_after_step=after, update_every=every, inv_gamma=1.0, power=0.75)
    theirs = ema_pytorch.EMA(run.model, beta=0.99, min_value=0.1, **settings)
    for _ in range(BEFORE):
        run.next()
        theirs.update()
    torch.save(
        theirs.state_dict(), tmp_path / "ema.pt"
    )  # initted, step, ema_model.*, online_model.*
    ours = fused_ema.ModelEma(
        run.model,
        0.99,
        warmup=(1.0, 0.75),
        min_decay=0.1,
        update_after_step=after,
        update_every=every,
        update_every_decay="plain",
    )
    assert ours.load_state_dict(tmp_path / "ema.pt").format == "ema-pytorch"
    assert ours.step == BEFORE
    continue_both(
        run,
        ours,
        lambda step: theirs.update(),
        lambda step: ours.update(run.model),
        lambda: theirs.ema_model.state_dict(),
    )


@pytest.mark.parametrize("use_num_updates", [True, False])
def test_torch_ema(tmp_path, use_num_updates):
    torch_ema = peer(peer_access.load_torch_ema)
    run = Run()
    theirs = torch_ema.ExponentialMovingAverage(
        run.model.parameters(), decay=0.99, use_num_updates=use_num_updates
    )
    for _ in range(BEFORE):
        run.next()
        theirs.update()
    torch.save(theirs.state_dict(), tmp_path / "ema.pt")
    warmup = "torch_ema" if use_num_updates else False
    ours = fused_ema.ModelEma(run.model, 0.99, warmup=warmup, buffers="ignore")
    assert ours.load_state_dict(tmp_path / "ema.pt").format == "torch_ema"
    assert ours.step == (BEFORE if use_num_updates else 1)
    names = [n for n, _ in run.model.named_parameters()]
    continue_both(
        run,
        ours,
        lambda step: theirs.update(),
        lambda step: ours.update(run.model),
        lambda: dict(zip(names, theirs.shadow_params)),
    )


@pytest.mark.parametrize("ignored", ["first", "middle"])
def test_torch_ema_into_an_ema_with_ignore_names(tmp_path, ignored):
    """shadow_params follow all of model.parameters(), those ignore_names leaves out included:
    each lands under its own name (they were paired with the EMA's parameters only, and refused
    as a count mismatch)."""
    torch_ema = peer(peer_access.load_torch_ema)
    run = Run()
    names = [n for n, _ in run.model.named_parameters()]
    left_out = names[0] if ignored == "first" else names[len(names) // 2]
    theirs = torch_ema.ExponentialMovingAverage(run.model.parameters(), decay=0.99)
    for _ in range(BEFORE):
        run.next()
        theirs.update()
    torch.save(theirs.state_dict(), tmp_path / "ema.pt")
    ours = fused_ema.ModelEma(
        run.model, 0.99, warmup="torch_ema", buffers="ignore", ignore_names=[left_out]
    )
    result = ours.load_state_dict(tmp_path / "ema.pt")
    assert (result.missing_keys, result.unexpected_keys, ours.step) == ([], [], BEFORE)
    kept = {n: s for n, s in zip(names, theirs.shadow_params) if n != left_out}
    assert set(ours.state_dict()["weights"]) == set(kept)
    continue_both(
        run,
        ours,
        lambda step: theirs.update(),
        lambda step: ours.update(run.model),
        lambda: {n: s for n, s in zip(names, theirs.shadow_params) if n != left_out},
    )


# ---------------------------------------------------------------------- diffusers


DIFFUSERS = {
    "ramp": dict(use_ema_warmup=False, update_after_step=4),
    "warmup": dict(use_ema_warmup=True, inv_gamma=2.0, power=0.75, min_decay=0.2),
}


def ours_for_diffusers(model, settings, **kwargs):
    warmup = "diffusers"
    if settings["use_ema_warmup"]:
        warmup = (settings["inv_gamma"], settings["power"])
    return fused_ema.ModelEma(
        model,
        0.995,
        warmup=warmup,
        min_decay=settings.get("min_decay", 0.0),
        update_after_step=settings.get("update_after_step", 0),
        **kwargs,
    )


@pytest.mark.parametrize("settings", list(DIFFUSERS.values()), ids=list(DIFFUSERS))
def test_diffusers_state_dict(tmp_path, settings):
    training_utils = peer(peer_access.load_diffusers)
    run = Run()
    theirs = training_utils.EMAModel(run.model.parameters(), decay=0.995, **settings)
    for _ in range(BEFORE):
        run.next()
        theirs.step(run.model.parameters())
    torch.save(theirs.state_dict(), tmp_path / "ema.pt")  # what accelerate's hooks save
    ours = ours_for_diffusers(run.model, settings, buffers="ignore")
    assert ours.load_state_dict(tmp_path / "ema.pt").format == "diffusers EMAModel"
    assert ours.step == BEFORE
    continue_with_diffusers(run, ours, theirs)


def continue_with_diffusers(run, ours, theirs):
    """continue_both with a diffusers EMAModel, whose shadow params follow the parameters' order."""
    names = [n for n, _ in run.model.named_parameters()]
    continue_both(
        run,
        ours,
        lambda step: theirs.step(run.model.parameters()),
        lambda step: ours.update(run.model),
        lambda: dict(zip(names, theirs.shadow_params)),
    )


@pytest.mark.parametrize("settings", list(DIFFUSERS.values()), ids=list(DIFFUSERS))
def test_diffusers_save_pretrained_folder(tmp_path, settings):
    training_utils = peer(peer_access.load_diffusers)

    class TinyModel(training_utils.ModelMixin, training_utils.ConfigMixin):
        @training_utils.register_to_config
        def __init__(self, width: int = 16):
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(6, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 4)
            )

        def forward(self, x):
            return self.net(x)

    run = Run(TinyModel())
    theirs = training_utils.EMAModel(
        run.model.parameters(),
        decay=0.995,
        model_cls=TinyModel,
        model_config=run.model.config,
        **settings,
    )
    for _ in range(BEFORE):
        run.next()
        theirs.step(run.model.parameters())
    theirs.save_pretrained(tmp_path / "unet_ema")  # what the diffusers training scripts save
    assert (tmp_path / "unet_ema" / "config.json").is_file()
    # diffusers averages parameters only; the folder's buffers are a fresh model's
    ours = ours_for_diffusers(run.model, settings, buffers="copy")
    result = ours.load_state_dict(tmp_path / "unet_ema")
    assert result.format == "diffusers save_pretrained"
    assert ours.step == BEFORE
    continue_with_diffusers(run, ours, theirs)


# ---------------------------------------------------------------------- the step itself


def test_load_step_overrides_and_setter_validates():
    run = Run()
    ours = fused_ema.ModelEma(run.model, 0.9, update_after_step=4)
    state = {k: v.clone() for k, v in run.model.state_dict().items()}
    ours.load_state_dict(state)
    assert ours.step == 5  # update_after_step + 1: started
    ours.load_state_dict(state, step=17)
    assert ours.step == 17
    ours.step = torch.tensor(23)
    assert ours.step == 23
    before = ours.state_dict()
    for bad in (-1, 1.5, True, "3", torch.tensor(2.0), torch.tensor([1, 2]), 2**53 + 1):
        with pytest.raises(ValueError, match="step"):
            ours.step = bad
        with pytest.raises(ValueError, match="step"):
            ours.load_state_dict({k: v + 1 for k, v in state.items()}, step=bad)
        after = ours.state_dict()
        assert after["step"] == 23
        assert all(torch.equal(after["weights"][k], v) for k, v in before["weights"].items())


def test_stepless_load_with_warmup_warns_and_names_the_fix():
    run = Run()
    ours = fused_ema.ModelEma(run.model, 0.999, warmup=True)
    with pytest.warns(UserWarning, match=r"stores no step.*step=N"):
        ours.load_state_dict(run.model.state_dict())
    assert ours.step == 1


# ---------------------------------------------------------------------- save_pretrained folders


def test_pretrained_folder_sharded_bin_and_empty(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    run = Run()
    ours = fused_ema.ModelEma(run.model, 0.9)
    state = {
        k: v + 1 if v.is_floating_point() else v + 3 for k, v in run.model.state_dict().items()
    }
    names = sorted(state)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for shard, keys in halves.items():
        safetensors.save_file({k: state[k].contiguous() for k in keys}, str(sharded / shard))
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (sharded / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (sharded / "config.json").write_text(json.dumps({"_class_name": "X", "optimization_step": 9}))
    assert ours.load_state_dict(sharded).format == "diffusers save_pretrained"
    assert ours.step == 9
    assert all(torch.equal(ours.state_dict()["weights"][k], v) for k, v in state.items())

    plain = tmp_path / "bin"
    plain.mkdir()
    torch.save({k: v - 2 for k, v in state.items()}, plain / "diffusion_pytorch_model.bin")
    ours.load_state_dict(plain)  # no config.json: no step, so started
    assert ours.step == 1
    assert torch.equal(ours.state_dict()["weights"]["0.bias"], state["0.bias"] - 2)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    before = ours.state_dict()
    with pytest.raises(fused_ema.CheckpointError, match="no weights in the folder.*config.json"):
        ours.load_state_dict(empty)
    (empty / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(fused_ema.CheckpointError, match="could not read it"):
        ours.load_state_dict(empty, step=5)
    after = ours.state_dict()
    assert after["step"] == before["step"]
    assert all(torch.equal(after["weights"][k], v) for k, v in before["weights"].items())


def test_step_overrides_a_stored_step_and_drives_the_next_update():
    run = Run()
    saved = fused_ema.ModelEma(run.model, 0.95, warmup=(1.0, 1.0))
    for _ in range(4):
        saved.update(run.model)
    ours = fused_ema.ModelEma(run.model, 0.95, warmup=(1.0, 1.0))
    ours.load_state_dict(saved.state_dict(), step=9)
    assert ours.step == 9 and saved.step == 4
    ours.update(run.model)  # averaging step s = 10 - 0 - 1 = 9: decay 1 - 1 / (1 + 9)
    assert ours.step == 10 and ours.current_decay == pytest.approx(0.9, rel=1e-15)
    ours.step = 1
    ours.update(run.model)
    assert ours.current_decay == pytest.approx(0.5, rel=1e-15)
