"""fused_ema.integrations.lightning with the real Lightning Trainer: one EMA update per optimizer
step (accumulation, manual optimization), evaluation on the EMA weights with the training weights
back afterwards (also after an exception), checkpoints that resume bit for bit, DDP with 2 CPU
processes launched by Lightning itself. The reference is torch's lerp over the weights recorded
after each optimizer step (tests/integration_reference.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from integration_reference import ReferenceEma, assert_same, ema_of, snapshot
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as L
except ImportError as err:  # not installed, or an install that failed part-way
    pytest.skip(
        f"lightning cannot be imported ({err}); .ci/env.sh installs lightning==2.6.6",
        allow_module_level=True,
    )
from fused_ema.integrations.lightning import EMACallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning",
    "ignore::DeprecationWarning",
    "ignore:.isinstance.treespec, LeafSpec.. is deprecated",
)

DECAY = 0.9
DDP_SCRIPT = Path(__file__).parent / "integrations" / "lightning_ddp.py"


class Net(L.LightningModule):
    """A small regression model (BatchNorm: averaged float buffers and a copied integer one) that
    records its weights after every optimizer step and what it evaluates with."""

    def __init__(self, manual_every: int = 0, fail_validation_at: int = -1, save_in_val=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.reference = ReferenceEma(DECAY)
        self.seen: list = []  # (hook, sanity checking, weights) for each evaluation batch
        self.manual_every = manual_every
        self.automatic_optimization = manual_every == 0
        self.fail_validation_at = fail_validation_at
        self.save_in_val = save_in_val

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        self.manual_backward(loss)
        if (batch_idx + 1) % self.manual_every == 0:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()
            self.reference.add(self)
        return None

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.reference.add(self)

    def _evaluate(self, hook, batch):
        self.seen.append((hook, self.trainer.sanity_checking, snapshot(self)))
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        if len(self.seen) == self.fail_validation_at:
            raise RuntimeError("validation failed on purpose")
        if self.save_in_val is not None and not self.trainer.sanity_checking:
            self.trainer.save_checkpoint(self.save_in_val)
            self.save_in_val = None
        self.log("val_loss", self._evaluate("val", batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._evaluate("test", batch))

    def predict_step(self, batch, batch_idx):
        return self._evaluate("predict", batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def loader(seed: int, n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def trainer(tmp_path, callbacks, **kwargs):
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=1,
    )
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


def ema_weights(callback: EMACallback) -> dict:
    return callback.ema.state_dict()["weights"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_straight_and_resumed_runs_give_the_same_ema(tmp_path, accumulate):
    """2 epochs straight vs 1 epoch, checkpoint (written by ModelCheckpoint at validation end,
    with the EMA weights swapped in), resume: the EMA, its step and the model are bit-identical,
    and each equals the reference over the optimizer steps actually taken."""
    steps = 8 // accumulate  # 4 batches an epoch, 2 epochs
    model, callback = Net(), EMACallback(decay=DECAY)
    checkpoints = L.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1, monitor="val_loss"
    )
    run = trainer(tmp_path, [callback, checkpoints], accumulate_grad_batches=accumulate)
    run.fit(model, loader(1), loader(2))
    assert run.global_step == steps and model.reference.steps == steps
    assert callback.ema.step == steps
    assert_same(ema_weights(callback), model.reference.weights, "EMA vs reference")
    assert_same(snapshot(model), model.reference.history[-1], "model after fit vs training weights")

    first = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=True)
    half = model.reference.history[: steps // 2]
    assert_same(first["state_dict"], half[-1], "checkpoint state_dict vs the training weights")
    saved = first["callbacks"]["EMACallback"]["ema"]
    assert int(saved["step"]) == steps // 2
    assert_same(saved["weights"], ema_of(half, DECAY), "checkpointed EMA vs reference")

    resumed_model, resumed = Net(), EMACallback(decay=DECAY)
    run = trainer(tmp_path / "resumed", [resumed], accumulate_grad_batches=accumulate)
    run.fit(resumed_model, loader(1), loader(2), ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt")
    assert resumed.ema.step == steps
    assert_same(ema_weights(resumed), ema_weights(callback), "resumed EMA vs straight EMA")
    assert_same(snapshot(resumed_model), snapshot(model), "resumed model vs straight model")


def test_evaluation_runs_on_the_ema_weights_and_gives_the_training_weights_back(tmp_path):
    model, callback = Net(), EMACallback(decay=DECAY)
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(model, loader(1), loader(2))
    sanity, val = model.seen[0], model.seen[1]
    assert sanity[:2] == ("val", True) and val[:2] == ("val", False)
    ema = model.reference.weights
    assert_same(val[2], ema, "validation weights vs the EMA")
    training = model.reference.history[-1]
    assert_same(snapshot(model), training, "after fit")
    assert any(not torch.equal(ema[k], training[k]) for k in ema), "the test cannot tell them apart"

    for hook, call in (("test", run.test), ("predict", run.predict)):
        model.seen.clear()
        call(model, loader(3))
        assert model.seen and all(h == hook for h, _, _ in model.seen)
        for _, _, weights in model.seen:
            assert_same(weights, ema, f"{hook} weights vs the EMA")
        assert_same(snapshot(model), training, f"after {hook}")


def test_sanity_check_runs_on_the_starting_weights(tmp_path):
    model, callback = Net(), EMACallback(decay=DECAY)
    start = snapshot(model)
    trainer(tmp_path, [callback], max_epochs=1).fit(model, loader(1), loader(2))
    assert model.seen[0][1], "no sanity check ran"
    assert_same(model.seen[0][2], start, "sanity check weights")


def test_an_exception_in_validation_restores_the_training_weights(tmp_path):
    model, callback = Net(fail_validation_at=2), EMACallback(decay=DECAY)
    with pytest.raises(RuntimeError, match="on purpose"):
        trainer(tmp_path, [callback], max_epochs=1).fit(model, loader(1), loader(2))
    assert model.reference.steps == 4
    assert_same(snapshot(model), model.reference.history[-1], "model after the failed validation")
    assert_same(ema_weights(callback), model.reference.weights, "EMA after the failed validation")
    callback.ema.update(model, step=5)  # still usable: not left inside swapped()


def test_a_checkpoint_written_inside_validation_holds_the_training_weights(tmp_path):
    path = tmp_path / "inside.ckpt"
    model, callback = Net(save_in_val=path), EMACallback(decay=DECAY)
    trainer(tmp_path, [callback], max_epochs=1).fit(model, loader(1), loader(2))
    saved = torch.load(path, weights_only=True)
    assert_same(saved["state_dict"], model.reference.history[-1], "state_dict written in val")
    assert_same(saved["callbacks"]["EMACallback"]["ema"]["weights"], model.reference.weights, "EMA")
    assert_same(model.seen[-1][2], model.reference.weights, "validation after the save")


def test_manual_optimization_updates_once_per_optimizer_step(tmp_path):
    model, callback = Net(manual_every=3), EMACallback(decay=DECAY)
    trainer(tmp_path, [callback], max_epochs=2).fit(model, loader(1))
    assert model.reference.steps == 2  # 4 batches an epoch: one step at the 3rd of each
    assert callback.ema.step == 2
    assert_same(ema_weights(callback), model.reference.weights, "EMA vs reference")


class TwoOptimizers(Net):
    """Manual optimization with two optimizers stepping in every batch (a GAN's pattern)."""

    def __init__(self):
        super().__init__(manual_every=1)
        self.batch_ends = [snapshot(self)]  # the weights the EMA starts from, then each batch's

    def training_step(self, batch, batch_idx):
        x, y = batch
        for optimizer in self.optimizers():
            self.manual_backward(nn.functional.mse_loss(self(x), y))
            optimizer.step()
            optimizer.zero_grad()
        self.batch_ends.append(snapshot(self))

    def configure_optimizers(self):
        weights = list(self.net.parameters())
        return torch.optim.Adam(weights[:2], lr=0.05), torch.optim.Adam(weights[2:], lr=0.05)


def test_several_optimizers_in_one_batch_make_one_update_at_its_end(tmp_path):
    """As docs/integrations.md says: global_step counts each optimizer's steps, the EMA moves once
    a batch (its first update, at step 2, averages into the starting weights)."""
    model, callback = TwoOptimizers(), EMACallback(decay=DECAY)
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(model, loader(1))
    assert run.global_step == callback.ema.step == 8  # 4 batches, 2 optimizer steps each
    reference = ReferenceEma(DECAY)
    for state in model.batch_ends:
        reference.add_state(state)
    assert_same(ema_weights(callback), reference.weights, "EMA vs once-a-batch reference")


def test_copy_to_model_at_end_and_the_ema_keywords(tmp_path):
    model = Net()
    callback = EMACallback(decay=DECAY, copy_to_model_at_end=True, update_after_step=2)
    trainer(tmp_path, [callback], max_epochs=1).fit(model, loader(1))
    want = ema_of(model.reference.history[2:], DECAY)  # steps 1..3 copy the model
    assert_same(snapshot(model), want, "model after fit")
    assert_same(ema_weights(callback), want, "EMA")


def test_a_user_built_ema_is_used(tmp_path):
    import fused_ema

    model = Net()
    ema = fused_ema.ModelEma(model, decay=DECAY)
    callback = EMACallback(ema=ema)
    trainer(tmp_path, [callback], max_epochs=1).fit(model, loader(1))
    assert callback.ema is ema and ema.step == 4
    assert_same(ema_weights(callback), model.reference.weights, "EMA")


def test_bad_arguments_are_refused_at_construction():
    import fused_ema

    with pytest.raises(ValueError, match="decay"):
        EMACallback(decay=1.5)
    with pytest.raises(TypeError, match="warmpu"):
        EMACallback(decay=0.9, warmpu=True)
    with pytest.raises(ValueError, match="not both"):
        EMACallback(decay=0.9, ema=fused_ema.ModelEma(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="swap_eval"):
        EMACallback(swap_eval="yes")


def test_validate_test_predict_from_a_checkpoint_use_its_ema(tmp_path):
    model, callback = Net(), EMACallback(decay=DECAY)
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(model, loader(1))
    run.save_checkpoint(tmp_path / "fit.ckpt")
    fresh = Net()
    evaluator = trainer(tmp_path, [EMACallback(decay=DECAY)])
    for call in (evaluator.validate, evaluator.test, evaluator.predict):
        fresh.seen.clear()
        call(fresh, loader(3), ckpt_path=tmp_path / "fit.ckpt")
        assert fresh.seen
        for _, _, weights in fresh.seen:
            assert_same(weights, model.reference.weights, f"{call.__name__} weights vs the EMA")
        assert_same(snapshot(fresh), model.reference.history[-1], f"after {call.__name__}")


def test_a_weights_only_checkpoint_is_evaluated_with_its_own_weights(tmp_path):
    """validate/test/predict(ckpt_path=) of a checkpoint saved with save_weights_only=True (no
    callback state) swapped in the EMA of the end of fit: another point of training than the
    checkpoint's, without a word. Now its own weights are evaluated, with a warning."""
    model, callback = Net(), EMACallback(decay=DECAY)
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(model, loader(1))
    run.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    run.save_checkpoint(tmp_path / "full.ckpt")
    with torch.no_grad():  # the model moves on: the checkpoint's weights are what it holds
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    for call in (run.validate, run.test, run.predict):
        model.seen.clear()
        with pytest.warns(UserWarning, match="holds no EMACallback state"):
            call(model, loader(3), ckpt_path=tmp_path / "weights.ckpt")
        for _, _, weights in model.seen:
            assert_same(weights, model.reference.history[-1], f"{call.__name__}: its own weights")
    model.seen.clear()
    run.validate(model, loader(3), ckpt_path=tmp_path / "full.ckpt")  # with the state: its EMA
    for _, _, weights in model.seen:
        assert_same(weights, model.reference.weights, "validate with the callback state")


class FailingPredict(Net):
    def predict_step(self, batch, batch_idx):
        raise ValueError("predict failed on purpose")


def test_an_exception_in_a_standalone_predict_gives_the_training_weights_back(tmp_path):
    """trainer.predict runs under inference_mode (Lightning's default) and its failure is handled
    outside it: the user's error propagates and the model gets its training weights back."""
    model, callback = FailingPredict(), EMACallback(decay=DECAY)
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(model, loader(1))
    with pytest.raises(ValueError, match="on purpose"):
        run.predict(model, loader(3))
    assert_same(snapshot(model), model.reference.history[-1], "model after the failed predict")
    assert_same(ema_weights(callback), model.reference.weights, "EMA after the failed predict")
    callback.ema.update(model, step=5)  # still usable: not left inside swapped()


def test_validate_from_a_checkpoint_then_fit_from_it_continues_the_ema(tmp_path):
    """A callback whose EMA was first built under validate's inference_mode loads the checkpoint
    again when fit resumes from it (before: its step counter was an inference tensor)."""
    model, callback = Net(), EMACallback(decay=DECAY)
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(model, loader(1))
    run.save_checkpoint(tmp_path / "fit.ckpt")
    resumed, again = Net(), EMACallback(decay=DECAY)
    second = trainer(tmp_path, [again], max_epochs=2)
    second.validate(resumed, loader(3), ckpt_path=tmp_path / "fit.ckpt")
    second.fit(resumed, loader(1), ckpt_path=tmp_path / "fit.ckpt")
    straight, reference = Net(), EMACallback(decay=DECAY)
    trainer(tmp_path / "straight", [reference], max_epochs=2).fit(straight, loader(1))
    assert again.ema.step == reference.ema.step
    assert_same(ema_weights(again), ema_weights(reference), "resumed EMA vs a straight run")


def test_resuming_from_a_checkpoint_without_the_ema_warns_and_starts_a_new_one(tmp_path):
    """fit(ckpt_path=) from a checkpoint written without the callback: a new EMA, said aloud
    (the transformers callback raises there by default); from one with it: no warning."""
    plain, model = trainer(tmp_path, [], max_epochs=1), Net()
    plain.fit(model, loader(1))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    resumed, callback = Net(), EMACallback(decay=DECAY)
    with pytest.warns(UserWarning, match="without EMACallback state"):
        trainer(tmp_path, [callback]).fit(resumed, loader(1), ckpt_path=tmp_path / "plain.ckpt")
    assert callback.ema.step == 8
    with_ema = trainer(tmp_path, [EMACallback(decay=DECAY)], max_epochs=1)
    with_ema.fit(Net(), loader(1))
    with_ema.save_checkpoint(tmp_path / "ema.ckpt")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without EMACallback state")
        trainer(tmp_path, [EMACallback(decay=DECAY)]).fit(
            Net(), loader(1), ckpt_path=tmp_path / "ema.ckpt"
        )


def test_a_corrupt_checkpoint_state_raises_and_leaves_the_ema_as_built(tmp_path):
    import fused_ema

    model, callback = Net(), EMACallback(decay=DECAY)
    run = trainer(tmp_path, [callback], max_epochs=1)
    run.fit(model, loader(1))
    run.save_checkpoint(tmp_path / "good.ckpt")
    checkpoint = torch.load(tmp_path / "good.ckpt", weights_only=True)
    del checkpoint["callbacks"]["EMACallback"]["ema"]["weights"]["net.0.weight"]
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    fresh, fresh_callback = Net(), EMACallback(decay=DECAY)
    with pytest.raises(fused_ema.CheckpointError, match="net.0.weight"):
        trainer(tmp_path, [fresh_callback], max_epochs=2).fit(
            fresh, loader(1), ckpt_path=tmp_path / "bad.ckpt"
        )
    # built from the restored module before the load failed; nothing of the bad state went in
    assert fresh_callback.ema.step == 0
    assert_same(ema_weights(fresh_callback), checkpoint["state_dict"], "EMA after the failure")
    assert fresh_callback.state_dict()["ema"]["step"] == 0


def test_ddp_with_two_cpu_processes_resumes_bit_for_bit(tmp_path):
    """Lightning's own launcher starts the second process (strategy="ddp"); both ranks hold the
    same EMA, equal to the reference, and a resumed DDP run continues it exactly."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    for mode in ("straight", "resume"):
        command = [sys.executable, str(DDP_SCRIPT), mode, str(tmp_path)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the DDP {mode} run did not finish in 240 s")
        if result.returncode != 0 and "could not spawn" in result.stdout:
            pytest.skip(result.stdout.strip().splitlines()[-1])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = {
        (mode, r): torch.load(tmp_path / f"{mode}_rank{r}.pt", weights_only=True)
        for mode in ("straight", "resume")
        for r in (0, 1)
    }
    straight = ranks["straight", 0]
    assert straight["global_step"] == 4 and int(straight["ema"]["step"]) == 4
    assert_same(straight["ema"]["weights"], straight["reference"], "DDP EMA vs reference")
    for key, got in ranks.items():
        assert int(got["ema"]["step"]) == 4, key
        assert_same(got["ema"]["weights"], straight["ema"]["weights"], f"rank EMA {key}")
        assert_same(got["model"], straight["model"], f"model {key}")
