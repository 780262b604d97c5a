"""fused_ema.integrations.transformers with the real Hugging Face Trainer, and ModelEma under
accelerate's register_for_checkpointing (itself and through WholeCheckpoint): one EMA update per
optimizer step (also with gradient accumulation), ema.pt in every checkpoint folder, resumed runs
bit-identical to straight ones, evaluation and prediction on the EMA weights. The reference is
torch's lerp over the weights recorded after each optimizer step (tests/integration_reference.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from integration_reference import ReferenceEma, assert_same, ema_of, snapshot
from torch import nn

try:
    import transformers
except ImportError as err:  # not installed, or an install that failed part-way
    pytest.skip(
        f"transformers cannot be imported ({err}); .ci/env.sh installs transformers==5.23.0",
        allow_module_level=True,
    )
import fused_ema  # noqa: E402
from fused_ema.integrations.accelerate import WholeCheckpoint  # noqa: E402
from fused_ema.integrations.transformers import (  # noqa: E402
    EMA_FILE,
    EMACallback,
    EMATrainer,
    ema_weights,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DECAY = 0.9


class Net(nn.Module):
    """What the Trainer needs of a model: keyword inputs, a dict with the loss. Records the
    weights it evaluates with (eval mode) in `seen`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 1))
        self.seen: list[dict] = []

    def forward(self, x, labels=None):
        if not self.training:
            self.seen.append(snapshot(self))
        logits = self.body(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(logits, labels)
        return out


class Data(torch.utils.data.Dataset):
    def __init__(self, seed: int, n: int = 32):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Recorder(transformers.TrainerCallback):
    """The training weights after each optimizer step, into the reference."""

    def __init__(self):
        self.reference = ReferenceEma(DECAY)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.reference.add(model)


def arguments(output_dir, accumulate=1, **kwargs):
    options = dict(
        output_dir=str(output_dir),
        max_steps=8 // accumulate,
        save_steps=4 // accumulate,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        learning_rate=0.05,
        use_cpu=True,
        report_to=[],
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


def run(output_dir, trainer_class=transformers.Trainer, resume=None, callback=None, **kwargs):
    model, recorder = Net(), Recorder()
    callback = callback or EMACallback(decay=DECAY)
    trainer = trainer_class(
        model=model,
        args=arguments(output_dir, **kwargs),
        train_dataset=Data(1),
        eval_dataset=Data(2, n=8),
        callbacks=[recorder, callback],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, callback, recorder.reference


def saved_ema(folder) -> dict:
    return torch.load(folder / EMA_FILE, weights_only=True)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_straight_and_resumed_runs_give_the_same_ema(tmp_path, accumulate):
    """8 batches straight vs 4, checkpoint, resume (the Trainer's own resume_from_checkpoint=True
    on the output folder; EMATrainer from a folder elsewhere): EMA, step and model bit-identical,
    and ema.pt of each checkpoint equal to the reference over the steps before it."""
    steps = 8 // accumulate
    _, model, callback, reference = run(tmp_path / "a", accumulate=accumulate)
    assert reference.steps == steps and callback.ema.step == steps
    straight = callback.ema.state_dict()
    assert_same(straight["weights"], reference.weights, "EMA vs reference")
    for step in (steps // 2, steps):
        saved = saved_ema(tmp_path / "a" / f"checkpoint-{step}")
        assert int(saved["step"]) == step
        assert_same(saved["weights"], ema_of(reference.history[:step], DECAY), f"ema.pt {step}")

    half = f"checkpoint-{steps // 2}"
    shutil.copytree(tmp_path / "a" / half, tmp_path / "b" / half)
    resumed = [
        run(tmp_path / "b", resume=True, accumulate=accumulate),
        run(tmp_path / "c", EMATrainer, resume=str(tmp_path / "a" / half), accumulate=accumulate),
    ]
    for name, (_, resumed_model, resumed_callback, _) in zip("bc", resumed):
        assert resumed_callback.ema.step == steps, name
        assert_same(resumed_callback.ema.state_dict()["weights"], straight["weights"], name)
        assert_same(snapshot(resumed_model), snapshot(model), f"model {name}")


class _Trial:
    """What Trainer.train(trial=...) reads of an optuna trial (optuna is not installed here)."""

    number, params = 0, {}

    def report(self, *args):
        pass

    def should_prune(self):
        return False


@pytest.mark.parametrize("runs_before", [0, 1])
def test_a_hyperparameter_search_trial_saves_its_ema_in_the_trials_folder(
    tmp_path, monkeypatch, runs_before
):
    """A trial's checkpoints go to output_dir/run-<n>/checkpoint-<step> (Trainer._get_output_dir):
    ema.pt lands there (before: FileNotFoundError, training stopped), also where an earlier
    trial left a checkpoint of the same step in its own run folder."""
    from transformers import integrations
    from transformers.trainer_utils import HPSearchBackend

    monkeypatch.setattr(integrations, "hp_params", lambda trial: trial.params)
    for number in range(runs_before + 1):
        model, recorder, callback = Net(), Recorder(), EMACallback(decay=DECAY)
        trainer = transformers.Trainer(
            model=model,
            args=arguments(tmp_path),
            train_dataset=Data(1 + number),
            callbacks=[recorder, callback],
        )
        trainer.hp_search_backend, trainer.hp_space = HPSearchBackend.OPTUNA, lambda trial: {}
        trial = _Trial()
        trial.number = number
        trainer.train(trial=trial)
        for step in (4, 8):
            saved = saved_ema(tmp_path / f"run-{number}" / f"checkpoint-{step}")
            assert int(saved["step"]) == step
            expected = ema_of(recorder.reference.history[:step], DECAY)
            assert_same(saved["weights"], expected, f"run-{number} ema.pt {step}")
    assert not (tmp_path / "checkpoint-4").exists()


def test_where_a_resumed_run_finds_its_ema(tmp_path):
    """A plain Trainer resumed from a folder outside its output_dir cannot know it: an error that
    says what to do, resume_from= fixes it; on_missing="restart" starts a new EMA instead."""
    _, _, straight, straight_reference = run(tmp_path / "a")
    elsewhere = tmp_path / "a" / "checkpoint-4"
    with pytest.raises(FileNotFoundError, match="resumed at step 4.*EMATrainer"):
        run(tmp_path / "d", resume=str(elsewhere))
    _, _, callback, _ = run(
        tmp_path / "e",
        resume=str(elsewhere),
        callback=EMACallback(decay=DECAY, resume_from=elsewhere),
    )
    assert_same(callback.ema.state_dict()["weights"], straight.ema.state_dict()["weights"], "e")

    (elsewhere / EMA_FILE).unlink()
    restart = EMACallback(decay=DECAY, on_missing="restart")
    with pytest.warns(UserWarning, match="a new EMA starts"):
        _, _, callback, reference = run(
            tmp_path / "f", EMATrainer, resume=str(elsewhere), callback=restart
        )
    # the new EMA starts from the resumed model (step 4's weights); steps 5..8 average into it
    assert reference.steps == 4 and callback.ema.step == 8
    want = ema_of(straight_reference.history[3:4] + reference.history, DECAY)
    assert_same(callback.ema.state_dict()["weights"], want, "restarted EMA")


def test_evaluation_and_prediction_run_on_the_ema_weights(tmp_path):
    trainer, model, callback, reference = run(
        tmp_path, EMATrainer, eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=8
    )
    assert len(model.seen) == 2, "one evaluation batch at steps 4 and 8"
    assert_same(model.seen[0], ema_of(reference.history[:4], DECAY), "evaluation at step 4")
    assert_same(model.seen[1], reference.weights, "evaluation at step 8")
    training = reference.history[-1]
    assert_same(snapshot(model), training, "after train")
    assert any(not torch.equal(reference.weights[k], training[k]) for k in training)

    model.seen.clear()
    trainer.evaluate()
    trainer.predict(Data(3, n=8))
    assert len(model.seen) == 2
    for weights in model.seen:
        assert_same(weights, reference.weights, "evaluate/predict weights")
    assert_same(snapshot(model), training, "after evaluate and predict")


def test_ema_weights_context_for_a_plain_trainer(tmp_path):
    trainer, model, callback, reference = run(tmp_path)
    with ema_weights(trainer):
        assert_same(snapshot(model), reference.weights, "inside ema_weights")
        with pytest.raises(ZeroDivisionError):
            with ema_weights(trainer):  # nested: no second swap
                assert_same(snapshot(model), reference.weights, "nested")
                raise ZeroDivisionError
        assert_same(snapshot(model), reference.weights, "after the nested block")
    assert_same(snapshot(model), reference.history[-1], "after ema_weights")
    with pytest.raises(RuntimeError, match="no EMA yet"):
        fresh = transformers.Trainer(
            model=Net(), args=arguments(tmp_path / "x"), callbacks=[EMACallback(decay=DECAY)]
        )
        with ema_weights(fresh):
            pass


def test_copy_to_model_at_end_and_the_ema_keywords(tmp_path):
    callback = EMACallback(decay=DECAY, copy_to_model_at_end=True, warmup=True)
    _, model, callback, reference = run(tmp_path, callback=callback)
    assert callback.ema.schedule["warmup"] == (1.0, 2.0 / 3.0)
    assert_same(snapshot(model), callback.ema.state_dict()["weights"], "model after train")


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="decay"):
        EMACallback(decay=-0.5)
    with pytest.raises(TypeError, match="warmpu"):
        EMACallback(decay=0.9, warmpu=True)
    with pytest.raises(ValueError, match="on_missing"):
        EMACallback(decay=0.9, on_missing="ignore")
    with pytest.raises(ValueError, match="not both"):
        EMACallback(decay=0.9, ema=fused_ema.ModelEma(nn.Linear(2, 2)))


@pytest.mark.parametrize("registered", ["ema", "WholeCheckpoint(ema)"])
def test_accelerate_register_for_checkpointing_round_trip(tmp_path, registered):
    try:
        import accelerate
    except ImportError as err:
        pytest.skip(
            f"accelerate cannot be imported ({err}); .ci/env.sh installs accelerate==1.15.0"
        )
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, decay=DECAY)
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    # WholeCheckpoint gathers ZeRO-3 partitions (tests/test_zero3.py); here it is the EMA's own
    accelerator.register_for_checkpointing(ema if registered == "ema" else WholeCheckpoint(ema))
    data = Data(1)

    def train(steps):
        for step in range(steps):
            batch = data[slice(4 * step, 4 * step + 4)]
            loss = model(**batch)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            ema.update(model, step=ema.step + 1)

    train(3)
    accelerator.save_state(tmp_path / "state")
    saved = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    train(2)
    after_five = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    accelerator.load_state(tmp_path / "state")
    assert ema.step == 3
    assert_same(ema.state_dict()["weights"], saved, "EMA after load_state")
    train(2)  # the model was restored too: the same two steps again
    assert_same(ema.state_dict()["weights"], after_five, "EMA continued after load_state")


def test_whole_checkpoint_wraps_only_an_ema():
    with pytest.raises(TypeError, match="WholeCheckpoint wraps a fused_ema.ModelEma"):
        WholeCheckpoint(nn.Linear(2, 2).weight)


def test_importing_fused_ema_imports_no_framework():
    code = (
        "import sys, fused_ema, fused_ema.integrations, fused_ema.integrations.accelerate; "
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') "
        "if m in sys.modules]; assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
