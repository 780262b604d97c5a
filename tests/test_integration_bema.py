"""fused_ema.integrations.transformers.BEMACallback with the real Hugging Face Trainer: the
corrected weights against the paper's formulas in float64 over the weights recorded after each
optimizer step, bema.pt in every checkpoint folder, a resumed run bit-identical to a straight one,
evaluation on the corrected weights, output_dir/bema at the end, TRL's arguments refused by name,
and equality with TRL's own BEMACallback where TRL can be installed beside this torch."""

from __future__ import annotations

import shutil

import pytest
import torch
from bema_reference import PaperBema
from integration_reference import snapshot

try:
    import transformers
except ImportError as err:  # not installed, or an install that failed part-way
    pytest.skip(
        f"transformers cannot be imported ({err}); .ci/env.sh installs transformers==5.23.0",
        allow_module_level=True,
    )
from test_integration_transformers import Data, Net, arguments  # noqa: E402

from fused_ema.integrations.transformers import (  # noqa: E402
    BEMA_FILE,
    BEMACallback,
    EMATrainer,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
OPTIONS = {"update_freq": 2, "update_after": 1, "lag": 4}


class Recorder(transformers.TrainerCallback):
    """The training weights after each optimizer step, fed to the float64 reference."""

    def __init__(self, reference: PaperBema | None = None):
        self.reference = reference

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.reference is None:
            self.reference = PaperBema(model, **OPTIONS)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.reference.update(model, state.global_step)


def run(output_dir, trainer_class=transformers.Trainer, resume=None, callback=None, **kwargs):
    model, recorder = Net(), Recorder()
    callback = callback or BEMACallback(**OPTIONS)
    trainer = trainer_class(
        model=model,
        args=arguments(output_dir, **kwargs),
        train_dataset=Data(1),
        eval_dataset=Data(2, n=8),
        callbacks=[recorder, callback],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, callback, recorder.reference


def close(got: dict, want: dict, what: str) -> None:
    for name, value in want.items():
        assert torch.allclose(got[name].double(), value, rtol=1e-5, atol=1e-7), f"{what}: {name}"


def test_the_corrected_weights_follow_the_paper_and_resume_bit_for_bit(tmp_path):
    _, model, callback, reference = run(tmp_path / "a")
    bema = callback.ema
    assert bema.step == 8
    close(bema.corrected.state_dict()["weights"], reference.out, "corrected")
    close(bema.ema.state_dict()["weights"], reference.ema, "EMA")
    close(snapshot(callback.running_model), reference.out, "running_model")
    saved = torch.load(tmp_path / "a" / "checkpoint-4" / BEMA_FILE, weights_only=True)
    assert saved["format"] == "fused_ema.bema" and saved["step"] == 4
    # as TRL, the corrected model is saved at the end (save_pretrained where the model has it)
    assert (tmp_path / "a" / "bema" / "model.pt").is_file()

    straight = bema.state_dict()
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    _, resumed_model, resumed, _ = run(tmp_path / "b", resume=True)
    assert resumed.ema.step == 8
    for a, b in zip(straight["emas"], resumed.ema.state_dict()["emas"]):
        for name, value in a["weights"].items():
            assert torch.equal(value, b["weights"][name]), name


def test_evaluation_runs_on_the_corrected_weights(tmp_path):
    _, model, callback, reference = run(
        tmp_path, EMATrainer, eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=8
    )
    assert len(model.seen) == 2
    close(model.seen[-1], reference.out, "the weights evaluated at step 8")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"update_freq": 0}, "update_freq"),
        ({"ema_power": -1.0}, "ema_power"),
        ({"bias_power": float("nan")}, "bias_power"),
        ({"lag": -3}, "lag"),
        ({"update_after": 1.5}, "update_after"),
        ({"min_ema_multiplier": 2.0}, "min_ema_multiplier"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BEMACallback(**kwargs)


def test_trl_arguments_are_attributes_as_in_trl():
    callback = BEMACallback(update_freq=7, lag=3, device="cpu")
    assert (callback.update_freq, callback.lag, callback.device) == (7, 3.0, "cpu")
    assert callback.running_model is None
