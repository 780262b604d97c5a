"""PostHocEma: EDM2's power-function EMAs of one model, updated from one read of it, and their
snapshots. Each tracked EMA is a ModelEma with the power-function schedule; the first one's update
also updates the others (one fused lerp_many_ per device), so every ModelEma promise (devices,
dtypes, buffers, names, checkpoints, structure changes, non_blocking, compile) is theirs."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .._model.swap import finish_all
from .._model.walk import unwrap_model
from .._tracks import TrackSet, same
from .._update.schedule import POWER_FUNCTION, whole_number
from ..checkpoint import _as_step, is_value
from ..ema import ModelEma
from .profiles import gamma_to_sigma_rel, sigma_rel_to_gamma
from .snapshots import SnapshotError, Snapshots, list_snapshots
from .synthesis import synthesize

_UINT64 = 2**64


class PostHocEma(TrackSet):
    """Power-function EMAs of `model` (EDM2, Karras et al. 2024), for choosing the EMA width
    after training: ``fused_ema.posthoc.synthesize(snapshot_dir, sigma_rel=...)``.

    Each EMA's decay at its t-th update (t from 1: the first update copies the model) is
    ``(1 - 1 / t) ** (gamma + 1)``, gamma from its ``sigma_rel`` (or given by ``gammas=``). One
    ``update(model)`` reads every model tensor once for all of them. Every ``snapshot_every``
    updates, with a ``snapshot_dir``, each EMA is written there (one safetensors file per EMA,
    float tensors in ``snapshot_dtype``) by a background thread: the training step waits for
    neither the copy of a GPU EMA nor the disk.

    Args:
        model: the module to follow.
        sigma_rels: the relative widths of the EMAs tracked (EDM2 tracks 0.05 and 0.10).
        gammas: the power-function exponents instead of sigma_rels.
        snapshot_every: updates between snapshots.
        snapshot_dir: where snapshots go (None: none are written). A fresh PostHocEma refuses a
            folder that holds snapshots already; one restored by load_state_dict continues its
            numbering (and replaces snapshots written after that checkpoint).
        snapshot_dtype: the dtype of float tensors in snapshots (None: the EMA's own).
        device, dtype, buffers, update_after_step, on_mismatch, copy_names: as ModelEma.
        ignore_names, shard, stochastic_rounding, stochastic_rounding_seed: as ModelEma (EMA k
            rounds with seed ``stochastic_rounding_seed + k``).
    """

    FORMAT = "fused_ema.posthoc"
    LEGACY_FORMATS = ("",)  # what releases before 2026-11-28 wrote
    NESTED = ("snapshot_index",)

    def __init__(
        self,
        model: nn.Module,
        sigma_rels=(0.05, 0.10),
        *,
        gammas=None,
        snapshot_every: int = 1000,
        snapshot_dir: str | os.PathLike | None = None,
        snapshot_dtype: torch.dtype | None = torch.float16,
        device=None,
        dtype: torch.dtype | None = None,
        buffers: str = "average",
        update_after_step: int = 0,
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
        on_mismatch: str = "error",
        copy_names=None,
        ignore_names=None,
        shard=False,
    ):
        super().__init__()
        if gammas is None:
            if sigma_rels is None:
                raise ValueError("PostHocEma: give sigma_rels or gammas")
            gammas = [sigma_rel_to_gamma(s) for s in sigma_rels]
        gammas = tuple(gammas)
        self.sigma_rels = tuple(gamma_to_sigma_rel(g) for g in gammas)  # checks every gamma
        self.gammas = tuple(float(g) for g in gammas)
        if not self.gammas:
            raise ValueError("PostHocEma: track at least one EMA")
        if len(set(self.gammas)) < len(self.gammas):  # synthesis solves for one per gamma
            raise ValueError(f"PostHocEma: the widths must differ, got gammas {self.gammas}")
        every = whole_number("snapshot_every", snapshot_every, 1)
        if snapshot_dtype is not None and not (
            isinstance(snapshot_dtype, torch.dtype) and snapshot_dtype.is_floating_point
        ):
            raise ValueError(
                f"snapshot_dtype must be a floating dtype or None, got {snapshot_dtype!r}"
            )
        self._snapshots = Snapshots(snapshot_dir, every, snapshot_dtype)
        seed = whole_number(
            "stochastic_rounding_seed", stochastic_rounding_seed, -(2**63), _UINT64 - 1
        )
        model = unwrap_model(model)
        tracks = tuple(
            ModelEma(
                model,
                decay=1.0,
                update_after_step=update_after_step,
                device=device,
                dtype=dtype,
                stochastic_rounding=stochastic_rounding,
                stochastic_rounding_seed=(seed + k) % _UINT64,
                buffers=buffers,
                warmup=(POWER_FUNCTION, gamma),
                on_mismatch=on_mismatch,
                copy_names=copy_names,
                ignore_names=ignore_names,
                shard=shard,
            )
            for k, gamma in enumerate(self.gammas)
        )
        self._update_after_step = update_after_step
        self._start(tracks, tuple(f"ema{k}" for k in range(len(tracks))))

    def _follow(self) -> None:
        super()._follow()
        # t, the power function's update count (t = 1: the update that copies the model, step
        # update_after_step + 1), while it is known without reading a device.
        fresh = self._tracks[0]._schedule.value() == 0
        self._t = -self._update_after_step if fresh else None
        self._rollbacks = getattr(self._tracks[0]._schedule, "rollbacks", 0)

    # ------------------------------------------------------------------ the EMAs

    @property
    def emas(self) -> tuple[ModelEma, ...]:
        """The tracked EMAs, in the order of sigma_rels; evaluate one with ``emas[k].module``."""
        return self._tracks

    def __len__(self) -> int:
        return len(self._tracks)

    def __getitem__(self, k: int) -> ModelEma:
        return self._tracks[k]

    @property
    def snapshot_dir(self) -> Path | None:
        return self._snapshots.folder

    @property
    def snapshot_every(self) -> int:
        return self._snapshots.every

    @property
    def snapshot_dtype(self) -> torch.dtype | None:
        return self._snapshots.dtype

    # ------------------------------------------------------------------ updating

    def update(self, model: nn.Module, step=None, non_blocking: bool = False) -> None:
        """One update of every tracked EMA toward `model`, reading each model tensor once; then
        a snapshot when the update count reaches a multiple of snapshot_every."""
        leader, snapshots = self._tracks[0], self._snapshots
        if torch.compiler.is_compiling():  # the snapshot's checks and writes run eagerly
            if snapshots.folder is not None:
                self._before_update(step)
            leader._update(model, step, non_blocking)
            if snapshots.folder is not None:
                self._counted_snapshot()
            return
        t = self._before_update(step)
        try:
            leader._update(model, step, non_blocking)
            if t is None and snapshots.folder is not None:
                self._counted_snapshot()
                return
            # A dict store, not Module.__setattr__: a call, where an interrupt could leave the
            # count one behind the counter and every later snapshot labelled with the step before.
            self.__dict__["_t"] = t
            if snapshots.due(t):
                self._take(t)
        except BaseException:
            # An interrupt may land once the update has gone through: the counter says whether
            # it did, read back now for a snapshot due there (and at the next update).
            self.__dict__["_t"] = None
            if snapshots.folder is not None and not non_blocking:
                self._counted_snapshot(missed=True)
            raise

    @torch.compiler.disable
    def _before_update(self, step) -> int | None:
        """What every update checks before it changes anything (the last snapshot copied out,
        a failed write raised, the snapshot steps growing, the folder this run's); returns the
        update count after it where known without reading a device."""
        leader, snapshots = self._tracks[0], self._snapshots
        snapshots.wait_staged()
        snapshots.raise_failure()
        rollbacks = getattr(leader._schedule, "rollbacks", 0)
        if rollbacks != self._rollbacks:  # an update undone since (a failed non_blocking one,
            # raised by any call): the count is read from the counter again
            self.__dict__["_t"], self.__dict__["_rollbacks"] = None, rollbacks
        t = None  # the update count after this update, when known without reading a device
        if step is None and self._t is not None:
            t = self._t + 1
        elif step is not None and not isinstance(step, torch.Tensor):
            t = whole_number("step", step, 0) - self._update_after_step
        elif step is not None and snapshots.folder is not None:
            # Read now (one sync, which the snapshot's count would cost after the update): a
            # snapshot due at this step is checked below before anything changes.
            t = leader._schedule.as_value(step) - self._update_after_step
        # Before the update changes anything; an update count known only after it may be due.
        if snapshots.due(t) or (t is None and snapshots.folder is not None):
            snapshots.check_folder()  # (after a resume, reads the last snapshot's update count)
        last = snapshots.last_step
        if snapshots.due(t) and last is not None and t <= last:
            # Synthesis reads the snapshots in order of their steps: one that does not grow
            # past the last one written would make the whole folder unusable.
            raise ValueError(
                f"PostHocEma.update: step={step!r} would write a snapshot at update count {t}, "
                f"not past the last snapshot written (update count {last}): snapshot steps must "
                "grow; nothing was changed"
            )
        return t

    @torch.compiler.disable
    def _counted_snapshot(self, missed: bool = False) -> None:
        """A snapshot if due at the update count read from the leader's counter (a device read);
        `missed`: only if none was taken at that count (after an update that may not have run)."""
        t = self._tracks[0]._schedule.value() - self._update_after_step
        self.__dict__["_t"] = t
        if self._snapshots.due(t) and not (missed and t == self._snapshots.last_step):
            self._take(t)

    def _take(self, t: int) -> None:
        """The snapshot at update count `t`, part of the update that reached it: taken to its end
        whatever interrupts it (finish_all), once."""
        snapshots = self._snapshots

        def take_once():
            if snapshots.last_step != t:
                snapshots.take(self._tracks, self.gammas, t)

        finish_all([take_once])

    def synchronize(self) -> None:
        """Waits for a non_blocking update and for every snapshot submitted to be written."""
        self._tracks[0].synchronize()
        self._snapshots.flush()

    # ------------------------------------------------------------------ snapshots

    def save_snapshot(self) -> None:
        """Writes a snapshot of every EMA now (besides the periodic ones); none where this update
        count has one already."""
        if self.snapshot_dir is None:
            raise ValueError("PostHocEma.save_snapshot: this PostHocEma has no snapshot_dir")
        self._tracks[0].synchronize()
        snapshots, t = self._snapshots, self.step - self._update_after_step
        snapshots.raise_failure()  # (a failed write of this step would otherwise pass unseen)
        if t < 1:
            raise ValueError(
                f"PostHocEma.save_snapshot: no update has started the EMAs yet (update count {t}, "
                f"update_after_step {self._update_after_step}): there is nothing to snapshot"
            )
        # A second snapshot of one step (the periodic one at the end of a run, say) would make
        # the folder unusable: synthesis refuses a step that does not grow.
        snapshots.check_folder()  # (after a resume, reads the last snapshot's update count)
        if t == snapshots.last_step or (snapshots.last_step is None and snapshots.due(t)):
            return
        if snapshots.last_step is not None and t < snapshots.last_step:  # (update(step=) lowered)
            raise ValueError(
                f"PostHocEma.save_snapshot: the update count {t} is below that of the last "
                f"snapshot written ({snapshots.last_step}): snapshot steps must grow; nothing "
                "was written"
            )
        snapshots.take(self._tracks, self.gammas, t)

    def synthesize(self, sigma_rel: float | None = None, *, gamma=None, step=None) -> dict:
        """fused_ema.posthoc.synthesize over this run's snapshots (once they are written)."""
        if self.snapshot_dir is None:
            raise ValueError("PostHocEma.synthesize: this PostHocEma has no snapshot_dir")
        self.synchronize()
        # A resumed run's folder may still hold the later snapshots of the run it resumed (until
        # it replaces them): they are not this run's, and the default step would be theirs.
        taken = self._snapshots.next_index
        mine = [s for s in list_snapshots(self.snapshot_dir) if s.index < taken]
        if not mine:
            raise SnapshotError(f"{self.snapshot_dir} holds no snapshots of this run yet")
        return synthesize(mine, sigma_rel=sigma_rel, gamma=gamma, step=step)

    def close(self) -> None:
        """Waits until every snapshot taken is written; raises the first failure."""
        self._snapshots.flush()

    # ------------------------------------------------------------------ checkpoints

    def _header(self) -> dict:
        return {
            "gammas": list(self.gammas),
            "snapshot_index": self._snapshots.next_index,
            "snapshot_every": self.snapshot_every,
        }

    def _header_problems(self, state: dict) -> list[str]:
        problems = []
        if not same(state.get("gammas"), list(self.gammas)):
            problems.append(
                f"gammas {state.get('gammas')!r}: this PostHocEma tracks {list(self.gammas)}"
            )
        every = state.get("snapshot_every")  # (absent from older checkpoints)
        writes = self.snapshot_dir is not None  # (one that takes no snapshots loads any)
        if writes and every is not None and not is_value(every, self.snapshot_every):
            problems.append(
                f"snapshot_every {every!r}: this PostHocEma snapshots every {self.snapshot_every} "
                "updates (its snapshots would no longer continue the run's)"
            )
        index = state.get("snapshot_index")  # a one-element tensor in a parent's state dict
        if index is None:
            problems.append("snapshot_index is missing")
        _as_step(index, "snapshot_index", problems)
        return problems

    def _restore_header(self, state: dict) -> None:
        # resumed from a checkpoint taken before snapshot `snapshot_index`: may replace later ones
        self._snapshots.next_index = int(state["snapshot_index"])
        self._snapshots.resumed, self._snapshots.checked, self._t = True, False, None
        self._snapshots.last_step = None

    def __repr__(self) -> str:
        widths = ", ".join(f"{s:.3g}" for s in self.sigma_rels)
        where = self.snapshot_dir if self.snapshot_dir is not None else "none"
        return (
            f"PostHocEma(sigma_rels=({widths}), snapshot_every={self.snapshot_every}, "
            f"snapshot_dir={where})"
        )
