"""Lightning callback: a ModelEma of the LightningModule, updated after every optimizer step,
swapped in for validation/test/predict, saved in Lightning checkpoints and resumed bit for bit.
Needs `lightning` (`lightning.pytorch`); with only `pytorch_lightning` installed, that is used."""

from __future__ import annotations

import warnings
import weakref

import torch

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # only the older distribution is installed
    from pytorch_lightning.callbacks import Callback

from ..ema import ModelEma
from ._common import hold_ema

__all__ = ["EMACallback"]


class EMACallback(Callback):
    """Keeps a `fused_ema.ModelEma` of the LightningModule during `trainer.fit`.

    The EMA is updated once per optimizer step, after it (the trainer's `global_step` moved: right
    under `accumulate_grad_batches` and manual optimization), with `step=trainer.global_step`, so
    `warmup`, `update_after_step` and `update_every` follow optimizer steps. Several optimizers
    stepping in one batch make one update, at the batch's end (docs/integrations.md).

    Args:
        decay: the EMA decay (ModelEma's default, 0.9999, when None).
        ema: a ModelEma you built yourself for the LightningModule, instead of the keywords.
        swap_eval: run validation (the sanity check too), test and predict with the EMA weights
            swapped into the module; the training weights come back when each ends, also when it
            raises.
        copy_to_model_at_end: when fit ends, write the EMA weights into the module.
        **ema_kwargs: any other ModelEma keyword (warmup=, update_every=, device=, dtype=, ...).

    Checkpoints: the checkpoint's "state_dict" always holds the training weights, also for a
    checkpoint written while the EMA weights are swapped in (ModelCheckpoint at validation end);
    the EMA is this callback's state, ``checkpoint["callbacks"]["EMACallback"]["ema"]``, whose
    "weights" entry is a state dict of the module. `trainer.fit(..., ckpt_path=...)` restores it
    and training continues exactly as if never interrupted.
    """

    def __init__(
        self,
        decay: float | None = None,
        *,
        ema: ModelEma | None = None,
        swap_eval: bool = True,
        copy_to_model_at_end: bool = False,
        **ema_kwargs,
    ):
        super().__init__()
        flags = dict(swap_eval=swap_eval, copy_to_model_at_end=copy_to_model_at_end)
        hold_ema(self, ema, decay, ema_kwargs, **flags)  # self.ema, self._ema_kwargs, self._swap
        self._module_ref = None
        self._pending: dict | None = None  # callback state loaded before the EMA was bound
        self._last_step: int | None = None
        self._fresh = False  # an EMA built by this fit that no checkpoint state went into
        self._restored = False  # this trainer call's checkpoint held the callback's state

    # ------------------------------------------------------------------ binding and state

    def _bind(self, pl_module, create: bool = True) -> None:
        """The EMA for `pl_module`, built at the start of fit (after configure_model and the
        strategy's setup), with a state restored from a checkpoint loaded into it."""
        bound = self._module_ref is not None and self._module_ref() is pl_module
        if self._ema_kwargs is not None and not bound and (create or self._pending is not None):
            self.ema = ModelEma(pl_module, **self._ema_kwargs)
            self._module_ref = weakref.ref(pl_module)
            self._fresh = True  # built here, no state of a checkpoint loaded into it yet
        if self._pending is not None and self.ema is not None:
            state, self._pending = self._pending, None
            self.ema.load_state_dict(state)  # all or nothing: a bad state raises, EMA unchanged
            self._fresh = False

    def state_dict(self) -> dict:
        if self._pending is not None:
            return {"ema": self._pending}
        if self.ema is None:
            return {}
        with self._swap.paused() as paused:
            state = self.ema.state_dict()
            if paused:  # the EMA's tensors take the model's weights again after the block
                state["weights"] = {k: v.clone() for k, v in state["weights"].items()}
        return {"ema": state}

    def load_state_dict(self, state_dict: dict) -> None:
        if "ema" not in state_dict:
            raise KeyError(f"EMACallback state without an 'ema' entry: keys {sorted(state_dict)}")
        self._pending = state_dict["ema"]  # loaded into the EMA when fit, validate, ... start
        self._restored = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """A checkpoint written while the EMA weights are swapped in: its "state_dict" (the
        module's tensors, not copies) must be the training weights, so they are cloned with the
        training weights put back for the moment."""
        if self._swap.target is None or "state_dict" not in checkpoint:
            return
        with self._swap.paused():
            checkpoint["state_dict"] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in checkpoint["state_dict"].items()
            }

    # ------------------------------------------------------------------ training

    def on_fit_start(self, trainer, pl_module) -> None:
        self._bind(pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        self._bind(pl_module)  # a strategy that restores checkpoints after setup loads it here
        self._last_step = trainer.global_step
        if self._fresh and trainer.global_step > 0:
            warnings.warn(
                f"fused_ema: training resumed at step {trainer.global_step} from a checkpoint "
                "without EMACallback state (saved without this callback, or save_weights_only="
                "True); a new EMA starts from the resumed model",
                stacklevel=2,
            )
        self._fresh = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._last_step is not None and step > self._last_step:  # an optimizer step happened
            self._last_step = step
            self.ema.update(pl_module, step=step)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.copy_to_model_at_end and self.ema is not None:
            self.ema.copy_to(pl_module)

    # ------------------------------------------------------------------ evaluation

    def on_validation_start(self, trainer, pl_module) -> None:
        """Validation, test and predict run with the EMA weights swapped in (swap_eval)."""
        if not self.swap_eval:
            return
        if trainer.ckpt_path is not None and trainer.state.fn != "fit" and not self._restored:
            # (save_weights_only=True): another EMA than the checkpoint's would be evaluated
            warnings.warn(
                f"fused_ema: {trainer.ckpt_path} holds no EMACallback state (saved with "
                "save_weights_only=True, or without this callback): its own weights are "
                "evaluated, not an EMA",
                stacklevel=2,
            )
            return
        self._bind(pl_module, create=False)
        if self.ema is not None:
            self._swap.enter(self.ema, pl_module)

    def on_validation_end(self, trainer, *args, **kwargs) -> None:
        """The training weights back: when each evaluation ends, on an exception, at teardown."""
        self._swap.leave()

    def teardown(self, trainer, *args, **kwargs) -> None:
        self._swap.leave()
        self._restored = False  # the next trainer call restores its own checkpoint, if any

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_exception = on_validation_end
