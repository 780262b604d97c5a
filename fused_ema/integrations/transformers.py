"""Hugging Face Trainer integration: EMACallback keeps a ModelEma (updated after every optimizer
step, saved as ema.pt in every checkpoint folder, restored on resume), BEMACallback a Bema. The
Trainer has no hook before evaluation nor when it loads a checkpoint, hence EMATrainerMixin /
EMATrainer (evaluation on the EMA, the resumed folder) and ema_weights(trainer)."""

from __future__ import annotations

import contextlib
import glob
import os
import warnings

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .._files import atomic_write
from ..bema import Bema, check_bema_options
from ..ema import ModelEma
from ._common import hold_ema, whole_state_dict

__all__ = [
    "BEMACallback",
    "BEMA_FILE",
    "EMA_FILE",
    "EMACallback",
    "EMATrainer",
    "EMATrainerMixin",
    "ema_weights",
]

EMA_FILE = "ema.pt"
"""The file holding `ema.state_dict()` in each `checkpoint-<step>` folder."""
BEMA_FILE = "bema.pt"
"""The file holding BEMACallback's `Bema.state_dict()` in each `checkpoint-<step>` folder."""


def _folder(args, step: int) -> str:
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def _saved_folder(args, state) -> str:
    """The checkpoint folder the Trainer has just written: output_dir/checkpoint-<step>, or in a
    hyperparameter-search trial output_dir/<the trial's run>/checkpoint-<step>, whose run name
    only the Trainer knows (run-<n> or its hp_name's): the newest one there."""
    if getattr(state, "trial_params", None) is None and getattr(state, "trial_name", None) is None:
        return _folder(args, state.global_step)
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    runs = glob.glob(os.path.join(glob.escape(str(args.output_dir)), "*", name))
    return max(runs, key=os.path.getmtime) if runs else _folder(args, state.global_step)


class EMACallback(TrainerCallback):
    """Keeps a `fused_ema.ModelEma` of the Trainer's model during `trainer.train()`.

    The EMA is updated in `on_step_end`, once per optimizer step (after gradient accumulation),
    with `step=state.global_step`. Each checkpoint folder `output_dir/checkpoint-<step>` gets
    `ema.pt` (the EMA's state_dict); a resumed run loads it back and continues bit for bit.

    Args:
        decay: the EMA decay (ModelEma's default, 0.9999, when None).
        ema: a ModelEma you built yourself for the model, instead of the keywords.
        copy_to_model_at_end: when training ends, write the EMA weights into the model.
        resume_from: the checkpoint folder to restore the EMA from. Without it, a resumed run
            (`state.global_step > 0` at train begin) looks in the folder EMATrainer was resumed
            from, `args.resume_from_checkpoint`, then `output_dir/checkpoint-<global_step>`.
        on_missing: a resumed run without an ema.pt whose step matches: "error" raises,
            "restart" warns and starts a new EMA from the resumed model.
        **ema_kwargs: any other ModelEma keyword (warmup=, update_every=, device=, dtype=, ...).
    """

    FILE = EMA_FILE  # in each checkpoint folder
    EMA = ModelEma  # what it keeps, built from _ema_kwargs

    def __init__(
        self,
        decay: float | None = None,
        *,
        ema: ModelEma | None = None,
        copy_to_model_at_end: bool = False,
        resume_from: str | os.PathLike | None = None,
        on_missing: str = "error",
        **ema_kwargs,
    ):
        if on_missing not in ("error", "restart"):
            raise ValueError(f"on_missing must be one of ('error', 'restart'), got {on_missing!r}")
        hold_ema(self, ema, decay, ema_kwargs, copy_to_model_at_end=copy_to_model_at_end)
        self.resume_from = resume_from
        self.on_missing = on_missing

    # ------------------------------------------------------------------ training

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Runs after the Trainer loaded a checkpoint's weights and state: a fresh EMA of the
        model, with the checkpoint's ema.pt loaded into it when training resumes."""
        resume_from, self.resume_from = self.resume_from, None
        ema = self.ema if self._ema_kwargs is None else self.EMA(model, **self._ema_kwargs)
        if state.global_step > 0:
            self._restore(ema, args, state.global_step, resume_from)
        self.ema = ema

    def _restore(self, ema: ModelEma, args, step: int, resume_from) -> None:
        found = [getattr(args, "resume_from_checkpoint", None), _folder(args, step)]
        looked = []
        for folder in found if resume_from is None else [resume_from]:
            if not isinstance(folder, (str, os.PathLike)):
                continue
            path = os.path.join(folder, self.FILE)
            looked.append(path)
            if os.path.isfile(path):
                state = torch.load(path, map_location="cpu", weights_only=True)
                saved = int(state["step"]) if isinstance(state, dict) and "step" in state else None
                if saved == step:
                    ema.load_state_dict(state)  # all or nothing: a damaged file raises
                    return
                looked[-1] += f" (its EMA is at step {saved})"
        message = (
            f"fused_ema: training resumed at step {step} but no {self.FILE} of that step was found "
            f"(looked at {', '.join(looked) or 'nothing'}). Resume with EMATrainer, or pass "
            "EMACallback(resume_from=<checkpoint folder>)"
        )
        if self.on_missing == "error":
            raise FileNotFoundError(message + ", or on_missing='restart' to start a new EMA.")
        warnings.warn(message + "; a new EMA starts from the resumed model.", stacklevel=3)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.ema.update(model, step=state.global_step)

    def on_save(self, args, state, control, **kwargs):
        """Called after the Trainer wrote `checkpoint-<global_step>` (process 0 writes ema.pt;
        under DeepSpeed ZeRO-3 every process first joins in gathering the EMA whole)."""
        checkpoint = whole_state_dict(self.ema)
        if not args.should_save:
            return
        folder = _saved_folder(args, state)
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"fused_ema: the checkpoint folder {folder} the Trainer should have written "
                "does not exist, so the EMA has nowhere to go"
            )
        atomic_write(  # crash-safe: a reader never sees half a file
            os.path.join(folder, self.FILE), lambda temporary: torch.save(checkpoint, temporary)
        )

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.copy_to_model_at_end:
            self.ema.copy_to(model)


class BEMACallback(EMACallback):
    """A drop-in for ``trl.BEMACallback`` (same arguments and meaning), on a fused `fused_ema.Bema`:
    one fused pass per BEMA step instead of TRL's copy of the model and Python loop, and
    fused_ema's resume and evaluation behaviour: each checkpoint folder gets ``bema.pt``, a resumed
    run continues bit for bit, and `EMATrainer` / `ema_weights(trainer)` evaluate on the corrected
    weights. As TRL does, the corrected model is saved to ``output_dir/bema`` when training ends
    (``save_at_end=False`` skips it). ``callback.ema`` is the Bema, ``callback.running_model`` its
    corrected module.

    Args:
        update_freq, ema_power, bias_power, lag, update_after: trl.BEMACallback's (see Bema).
        multiplier, min_ema_multiplier, device: trl.BEMACallback's ("cpu" by default, as TRL's).
        resume_from, on_missing: as EMACallback.
        **bema_kwargs: any other Bema keyword (dtype=, buffers=, ...).
    """

    FILE, EMA = BEMA_FILE, Bema

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
        *,
        save_at_end: bool = True,
        resume_from: str | os.PathLike | None = None,
        on_missing: str = "error",
        **bema_kwargs,
    ):
        options = check_bema_options(
            update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier
        )
        super().__init__(resume_from=resume_from, on_missing=on_missing)
        vars(self).update(options, device=device)  # TRL's attribute names
        self._ema_kwargs = {**options, "device": device, **bema_kwargs}
        self.save_at_end = bool(save_at_end)

    @property
    def running_model(self):
        """TRL's name: a module holding the corrected weights (None before training begins)."""
        return None if self.ema is None else self.ema.module

    def on_train_end(self, args, state, control, model=None, **kwargs):
        """As TRL: process 0 saves the corrected model to ``output_dir/bema``."""
        if not self.save_at_end or not state.is_world_process_zero or self.ema is None:
            return
        folder = os.path.join(args.output_dir, "bema")
        module = self.ema.module
        if hasattr(module, "save_pretrained"):
            module.save_pretrained(folder)
        else:
            os.makedirs(folder, exist_ok=True)
            torch.save(module.state_dict(), os.path.join(folder, "model.pt"))


# ---------------------------------------------------------------------- evaluation


def find_ema_callback(trainer: Trainer) -> EMACallback:
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, EMACallback)]
    if len(found) != 1:
        raise ValueError(
            f"the Trainer has {len(found)} fused_ema EMACallback(s); exactly one is needed "
            "(Trainer(callbacks=[EMACallback(...)]))"
        )
    return found[0]


@contextlib.contextmanager
def _swapped(trainer: Trainer, required: bool):
    callback = find_ema_callback(trainer)
    if callback.ema is None and required:
        raise RuntimeError(
            "fused_ema: the EMACallback has no EMA yet: it is built when trainer.train() starts"
        )
    # None: already inside (evaluate within ema_weights), or no EMA yet
    model = None if callback.ema is None else callback._swap.enter(callback.ema, trainer.model)
    try:
        yield trainer.model if model is None else model
    finally:
        if model is not None:
            callback._swap.leave()


def ema_weights(trainer: Trainer):
    """`with ema_weights(trainer): trainer.evaluate()`: the EMA weights in the Trainer's model
    for the block, the training weights back after it (also when it raises)."""
    return _swapped(trainer, required=True)


class EMATrainerMixin:
    """`class MyTrainer(EMATrainerMixin, Trainer)`: evaluate() and predict() (also the evaluations
    during training) run on the EMA weights once the EMA exists, and train(resume_from_checkpoint=)
    tells the callback which folder to restore the EMA from."""

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        callback = find_ema_callback(self)
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
        if isinstance(folder, (str, os.PathLike)):
            callback.resume_from = folder
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with _swapped(self, required=False):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with _swapped(self, required=False):
            return super().predict(*args, **kwargs)


class EMATrainer(EMATrainerMixin, Trainer):
    """A Trainer that evaluates and predicts with the EMA of its EMACallback."""
