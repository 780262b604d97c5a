"""Several ModelEmas of one model updated as one (PostHocEma's power-function EMAs, Bema's EMA,
theta0 and corrected weights): the first track's update also updates the others from one read of
the model, and their checkpoints are one, all or nothing. Each class says what its header holds
(state_dict()'s keys beside the tracks) and how the tracks are combined (updater.Updater.follow)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ._files import read_source
from ._model.swap import finish_all
from ._state.ema_state import META_KEY, commit_loads
from ._state.loading import LoadResult
from ._state.placement import MovedByTo
from .checkpoint import is_value
from .ema import ModelEma
from .errors import CheckpointError


class TrackSet(MovedByTo, nn.Module):
    FORMAT = ""
    FORMAT_VERSION = 1
    LEGACY_FORMATS: tuple[str, ...] = ()  # older "format" values a checkpoint may carry
    JOINT = "lerp_many"  # how the leader's update combines the tracks (plan.DeviceGroup)

    def _start(self, tracks: tuple[ModelEma, ...], names: tuple[str, ...]) -> None:
        """Called once by the subclass's __init__ with its tracks, the leader first."""
        self._tracks = tracks
        self._track_names = names  # the prefixes of their keys in a parent's state_dict
        self._follow()

    def _follow(self) -> None:
        for track in self._tracks:
            track._updater.owner = type(self).__name__  # its own update(), setters... raise
        leader = self._tracks[0]._updater
        for track in self._tracks[1:]:
            track._updater.follow(leader, track, self.JOINT)

    # ------------------------------------------------------------------ what a subclass adds

    NESTED: tuple[str, ...] = ()  # header keys a parent module's state_dict() gets too (tensors)

    def _header(self) -> dict:
        """state_dict()'s keys besides format, format_version and the tracks ("emas")."""
        return {}

    def _header_problems(self, state: dict) -> list[str]:
        """What is wrong with a checkpoint's header (its format already matched). A parent's
        state dict gives the NESTED keys as found (tensors), the others as _header() has them."""
        return []

    def _restore_header(self, state: dict) -> None:
        """Applies a checked header, after every track loaded."""

    # ------------------------------------------------------------------ shared behaviour

    @property
    def step(self) -> int:
        return self._tracks[0].step

    def synchronize(self) -> None:
        """Waits for a non_blocking update still running (raising the error it ended with)."""
        self._tracks[0].synchronize()

    def resync(self, model: nn.Module) -> None:
        """ModelEma.resync for every track, all or none: a track that cannot follow the model
        (or an interrupt) puts back those that did."""
        undos: list = []
        with self._tracks[0]._updater.exclusive(f"{type(self).__name__}.resync()"):
            try:
                for track in self._tracks:
                    track._resync(model, undos)
            except BaseException:
                finish_all(list(reversed(undos)))
                raise

    def to(self, *args, **kwargs):
        for track in self._tracks:
            track._to(*args, **kwargs)
        return self

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Every track's state_dict and the header. A parent module's state_dict() gets flat keys:
        each track's under ``{prefix}{name}.``."""
        if args:
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args) :])
        self.synchronize()  # (a PostHocEma's: the snapshots it counts are on disk, or raised)
        if destination is None and not prefix:
            return {
                "format": self.FORMAT,
                "format_version": self.FORMAT_VERSION,
                **self._header(),
                "emas": [track.state_dict() for track in self._tracks],
            }
        for name, track in zip(self._track_names, self._tracks):
            destination = track.state_dict(
                destination=destination, prefix=f"{prefix}{name}.", keep_vars=keep_vars
            )
        header = self._header()
        for key in self.NESTED:
            destination[prefix + key] = torch.tensor(header[key])
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None:  # what the parent's load hands this set back (local_metadata)
            settings = {k: v for k, v in header.items() if k not in self.NESTED}
            tracks = {name: metadata.get(f"{prefix}{name}") for name in self._track_names}
            metadata[prefix[:-1]] = {
                "version": self._version,
                META_KEY: {"header": settings, "tracks": tracks},
            }
        return destination

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        """Restores every track and the header from state_dict()'s dict (or a file), all or
        nothing: each track's checkpoint is checked and converted before any is written. With
        strict=False, the keys every track left unmatched, each under its track's name."""
        with self._tracks[0]._updater.exclusive(f"{type(self).__name__}.load_state_dict()"):
            return self._load(state, strict)

    def _load(self, state, strict: bool) -> LoadResult:
        kind = type(self).__name__
        self._ready("load_state_dict")
        state, source = read_source(state, f"{kind} checkpoint")
        formats = (self.FORMAT, *self.LEGACY_FORMATS)
        if not isinstance(state, dict) or not any(
            is_value(state.get("format"), f) for f in formats
        ):
            problem = f"not a {kind} state dict (expected 'format': {self.FORMAT!r})"
            raise CheckpointError([problem], source)
        problems = []
        if not is_value(state.get("format_version"), self.FORMAT_VERSION):
            problems.append(
                f"format_version {state.get('format_version')!r}: expected {self.FORMAT_VERSION}"
            )
        problems += self._header_problems(state)
        emas = state.get("emas")
        if not isinstance(emas, (list, tuple)) or len(emas) != len(self._tracks):
            problems.append(f"'emas' must list {len(self._tracks)} EMA state dicts")
        if problems:
            raise CheckpointError(problems, source)
        prepared = []
        for name, track, own in zip(self._track_names, self._tracks, emas):
            try:
                prepared.append(track._state.prepare(own, strict))
            except CheckpointError as err:
                raise CheckpointError([f"{name}: {p}" for p in err.problems], source) from None
        problems = self._commit(prepared, state, [], state.get("step"))
        if problems:
            raise CheckpointError(problems, source)
        # strict=False: what each track left unmatched, under its name ("theta0.0.weight").
        results = [(name, load.result) for name, (load, _) in zip(self._track_names, prepared)]
        return LoadResult(
            results[0][1].format,
            *(
                [f"{name}.{key}" for name, result in results for key in getattr(result, field)]
                for field in ("missing_keys", "unexpected_keys", "mismatched_keys")
            ),
        )

    def _ready(self, what: str) -> None:
        for track in self._tracks:
            track._ready(what)  # no non_blocking update pending, not inside swapped()

    def _commit(self, prepared, header: dict, problems: list, header_step=None) -> list[str]:
        """Writes the tracks' prepared loads (EmaState.prepare), then applies `header`, unless
        there are `problems` or the loads do not fit this set: the tracks are one object, so each
        keeps the schedule this set gives it and all share one step. Returns the problems. Once
        begun, an interrupt stops none of the writes (swap.finish_all)."""
        kind = type(self).__name__
        loads = [load for load, _ in prepared]
        problems = problems + [
            f"{name}: schedule {load.options} is not the one this {kind} gives it "
            f"({track._schedule.options})"
            for name, track, load in zip(self._track_names, self._tracks, loads)
            if load.options is not None and not same(load.options, track._schedule.options)
        ]
        steps = [load.step for load in loads]
        if len(set(steps)) > 1:
            named = ", ".join(f"{n} {s}" for n, s in zip(self._track_names, steps))
            problems.append(f"the EMAs are at different steps ({named}): they update together")
        elif None not in (header_step, *steps[:1]) and not is_value(header_step, steps[0]):
            problems.append(f"step {header_step!r} beside EMAs at step {steps[0]}")
        if not problems:
            for track, (load, rounding) in zip(self._tracks, prepared):
                track._state.warn_precision(load.options, rounding)
            writes = [track._state.load_writes(*p) for track, p in zip(self._tracks, prepared)]
            commit_loads([*writes, ([], [lambda: self._restore_header(header)])])
        return problems

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """A parent module's load_state_dict(): every track's keys, all or nothing."""
        with self._tracks[0]._updater.exclusive(f"{type(self).__name__}.load_state_dict()"):
            saved = (local_metadata or {}).get(META_KEY)
            saved = saved if isinstance(saved, dict) else {}
            self._load_nested(state_dict, prefix, saved, missing_keys, unexpected_keys, errors)

    def _load_nested(self, state_dict, prefix, saved, missing_keys, unexpected_keys, errors):
        """_load_from_state_dict with `saved`, what state_dict() put in the set's metadata: the
        header's settings and each track's metadata (the schedule it was saved with)."""
        self._ready("load_state_dict")
        tracks = saved.get("tracks") if isinstance(saved.get("tracks"), dict) else {}
        ready, found = [], set()
        for name, track in zip(self._track_names, self._tracks):
            sub = f"{prefix}{name}."
            found.update(key for key in state_dict if key.startswith(sub))
            ready.append(
                track._state.prepare_nested(
                    state_dict, sub, tracks.get(name), missing_keys, unexpected_keys, errors
                )
            )
        nested = {key: prefix + key for key in self.NESTED}  # header key -> its key here
        header = self._header() | (
            saved.get("header") if isinstance(saved.get("header"), dict) else {}
        )
        header |= {k: state_dict[s] for k, s in nested.items() if s in state_dict}
        missing = [s for s in nested.values() if s not in state_dict]
        missing_keys.extend(missing)
        found.update(nested.values())
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in found)
        if None not in ready and not missing:
            problems = self._commit(ready, header, self._header_problems(header))
            errors.extend(f"{prefix[:-1] or 'the state dict'}: {p}" for p in problems)

    def __copy__(self) -> TrackSet:
        # As ModelEma's: a shallow copy would share the tracks, and their locks, with this set.
        return copy.deepcopy(self)

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self._follow()


def same(a, b) -> bool:
    """Schedule options (or a header's copy of them) equal, floats to 1e-9 relative (a gamma
    computed on another machine)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return type(a) is type(b) and a == b
