"""Stateful property test of ModelEma: hypothesis drives random sequences of training, updates
(counted, explicit int, numpy and tensor steps, non_blocking), bad steps, structure changes
(insert, rename, reorder, replace, reshape, delete, buffers reassigned), resyncs, swapped() blocks
(with and without an exception), copy_to, checkpoints saved and loaded back (whole, partial, with
another schedule, corrupted) and interrupted updates, and after every step compares the EMA with
an independent float64 model of what was applied: weights by name, ema.step and
ema.current_decay. A call that raises must leave the EMA bit-identical to before.

The reference is written from the documented contract only (README, csrc/schedule_formula.h): its
own schedule, its own lerp in float64 and its own name bookkeeping (identity first, then same name
and shape). fused_ema is only driven through its public API; the internals it touches are the
fused call of either form of an update (fused_ema._update.plan.lerp_, and Prepared.run: a
prepared update's one call), wrapped to inject a KeyboardInterrupt before or after the real call.
"""

from __future__ import annotations

import copy
import math
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from torch import nn

import fused_ema
import fused_ema._update.plan as plan_module
import fused_ema._update.prepared as prepared_module

WIDTH = 4
MAX_LAYERS = 6
BIG_STEP = 2**62  # beyond any step the EMA can count exactly: refused
THEN = st.sampled_from(["follow", "leave"])  # after a structure change


# ---------------------------------------------------------------------- the reference schedule


def expected_schedule(step: int, o: dict) -> tuple[float, float]:
    """(lerp weight, per-step decay) of `step`, from the documented formula."""
    s = step - o["update_after_step"] - 1
    if s <= 0:
        decay = 0.0
    elif o["warmup"] is not None:
        gamma, power = o["warmup"]
        ramp = 1.0 - (1.0 + s / gamma) ** -power
        decay = max(min(ramp, o["decay"]), o["min_decay"])
    else:
        decay = o["decay"]
    every = o["update_every"]
    if (step - 1) % every != 0:
        return 0.0, decay
    return 1.0 - decay**every, decay


# ---------------------------------------------------------------------- model helpers


def fresh_linear(g: torch.Generator, n_in: int = WIDTH, n_out: int = WIDTH) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return layer


def fresh_norm(g: torch.Generator, n: int = WIDTH) -> nn.BatchNorm1d:
    layer = nn.BatchNorm1d(n)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, generator=g))
        layer.bias.copy_(torch.randn(n, generator=g))
        layer.running_mean.copy_(torch.randn(n, generator=g))
        layer.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        layer.num_batches_tracked.fill_(int(torch.randint(0, 100, (), generator=g)))
    return layer


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor object, kind) for every parameter and persistent buffer."""
    out = [(n, p, "param") for n, p in model.named_parameters()]
    out += [(n, b, "buffer") for n, b in model.named_buffers()]
    return out


@st.composite
def ema_options(draw) -> dict:
    """ModelEma schedule keywords."""
    decay = draw(st.sampled_from([0.5, 0.9, 0.99, 0.0, 1.0]))
    return {
        "decay": decay,
        "min_decay": decay * draw(st.sampled_from([0.0, 0.5, 1.0])),
        "warmup": draw(st.sampled_from([False, True, (3.0, 0.75), (10.0, 1.0), (0.5, 2.0)])),
        "update_after_step": draw(st.integers(0, 3)),
        "update_every": draw(st.integers(1, 3)),
    }


class RefEntry:
    """What the EMA should hold under `name`: `value` (float64 for averaged tensors, the model's
    integer dtype for copied ones), following the model tensor object `obj` (held weakly, as the
    EMA does: a layer removed from the model is freed)."""

    def __init__(self, name: str, obj: torch.Tensor, kind: str, value=None, average=None):
        self.name, self.obj, self.kind = name, obj, kind
        self.average = obj.is_floating_point() if average is None else average
        if value is None:
            value = obj.detach().clone()
            value = value.double() if self.average else value
        self.value = value

    @property
    def obj(self) -> torch.Tensor | None:
        return self._obj()

    @obj.setter
    def obj(self, tensor: torch.Tensor) -> None:
        self._obj = weakref.ref(tensor)


class _Boom(Exception):
    pass


# ---------------------------------------------------------------------- the machine


class EmaMachine(RuleBasedStateMachine):
    """ModelEma against an independent float64 model of what was applied."""

    EMA_DTYPE: torch.dtype | None = torch.float64
    MODES = ("error",)  # on_mismatch, drawn at init
    RTOL = ATOL = 1e-12

    # ------------------------------------------------------------------ set-up

    @initialize(options=ema_options(), seed=st.integers(0, 2**31 - 1), data=st.data())
    def setup(self, options, seed, data):
        self.g = torch.Generator().manual_seed(seed)
        self.model = nn.Sequential(fresh_linear(self.g), fresh_norm(self.g), fresh_linear(self.g))
        self.mode = data.draw(st.sampled_from(self.MODES), label="on_mismatch")
        kwargs = {} if self.EMA_DTYPE is None else {"dtype": self.EMA_DTYPE}
        self.ema = fused_ema.ModelEma(self.model, on_mismatch=self.mode, **options, **kwargs)
        if options["warmup"] is True:
            options = {**options, "warmup": (1.0, 2.0 / 3.0)}  # the documented default
        self.options = {**options, "warmup": options["warmup"] or None}
        self.entries = [RefEntry(n, t, k) for n, t, k in model_tensors(self.model)]
        self.step = 0
        # (checkpoint, reference values, step, options) of every save()
        self.saved: list[tuple[dict, dict, int, dict]] = []

    # ------------------------------------------------------------------ the reference

    @property
    def ema_float_dtype(self) -> torch.dtype:
        return self.EMA_DTYPE or torch.float32

    def match(self):
        """Pairs the model's tensors with reference entries: the entry following that very
        object first (whatever its name now), then an unclaimed entry of the same name and kind.
        Returns [(name, obj, kind, entry or None, how)] and the unclaimed entries."""
        current = model_tensors(self.model)
        by_obj = {id(e.obj): e for e in self.entries if e.obj is not None}
        by_name = {e.name: e for e in self.entries}
        claimed, found = set(), {}
        for name, obj, kind in current:
            e = by_obj.get(id(obj))
            if e is None or e.obj is not obj or e.kind != kind or id(e) in claimed:
                continue
            claimed.add(id(e))
            if tuple(e.value.shape) != tuple(obj.shape):
                found[name] = (e, "reshaped")
            else:
                found[name] = (e, "same" if e.name == name else "renamed")
        for name, obj, kind in current:
            if name in found:
                continue
            e = by_name.get(name)
            if e is None or id(e) in claimed or e.kind != kind:
                found[name] = (None, "new")
                continue
            claimed.add(id(e))
            same_shape = tuple(e.value.shape) == tuple(obj.shape)
            found[name] = (e, "replaced" if same_shape else "reshaped")
        pairs = [(n, t, k, *found[n]) for n, t, k in current]
        removed = [e for e in self.entries if id(e) not in claimed]
        return pairs, removed

    def mismatch(self, for_update: bool) -> bool:
        """Whether update (for_update) or swapped/copy_to must refuse the model as it is now. A
        replaced parameter is a mismatch for update only; a replaced buffer (model.to(),
        reassigned) is followed."""
        pairs, removed = self.match()
        if removed:
            return True
        for _, _, kind, _, how in pairs:
            if how in ("new", "renamed", "reshaped"):
                return True
            if for_update and how == "replaced" and kind == "param":
                return True
        return False

    def follow(self) -> None:
        """ema.resync: matched entries keep their average under their current names; new and
        reshaped tensors start from the model; removed entries go."""
        pairs, _ = self.match()
        entries = []
        for name, obj, kind, e, how in pairs:
            if how in ("new", "reshaped"):
                entries.append(RefEntry(name, obj, kind))
            else:
                entries.append(RefEntry(name, obj, kind, e.value, e.average))
        self.entries = entries

    def rebind(self) -> None:
        by_name = {e.name: e for e in self.entries}
        for name, obj, _ in model_tensors(self.model):
            by_name[name].obj = obj

    def expect_update(self, step: int | None) -> bool:
        """The reference for ema.update(model, step) with a valid step. Returns False when the
        update must raise StructureMismatchError (then nothing changes)."""
        if self.mismatch(for_update=True):
            if self.mode == "error":
                return False
            self.follow()
        else:
            self.rebind()
        self.step = self.step + 1 if step is None else step
        weight, _ = expected_schedule(self.step, self.options)
        for e in self.entries:
            src = e.obj.detach()
            if e.average:
                e.value = e.value + weight * (src.double() - e.value)
            else:
                e.value = src.clone()  # copied on every update, skipped steps included
        return True

    def reference_weights(self) -> dict:
        return {e.name: e.value.clone() for e in self.entries}

    # ------------------------------------------------------------------ checks

    def snapshot(self):
        sd = self.ema.state_dict()
        return (
            {k: v.clone() for k, v in sd["weights"].items()},
            self.ema.step,
            self.ema.current_decay,
            list(self.ema.names()),
            dict(self.ema.schedule),
        )

    def assert_unchanged(self, before) -> None:
        after = self.snapshot()
        assert set(after[0]) == set(before[0])
        for name, value in before[0].items():
            got = after[0][name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
        assert after[1:] == before[1:]

    def model_values(self) -> dict:
        return {n: t.detach().clone() for n, t, _ in model_tensors(self.model)}

    def assert_model_is(self, values: dict) -> None:
        now = model_tensors(self.model)
        assert [n for n, _, _ in now] == list(values)
        for name, t, _ in now:
            assert torch.equal(t.detach(), values[name]), name

    def assert_close(self, got: torch.Tensor, want: torch.Tensor, name: str) -> None:
        got = got.detach().double()
        err = (got - want).abs()
        bound = self.ATOL + self.RTOL * want.abs().max().clamp(min=1.0)
        assert bool((err <= bound).all()), (
            f"{name}: EMA differs from the reference by up to {float(err.max()):.3e} "
            f"(bound {float(bound):.1e})\nEMA {got}\nreference {want}"
        )

    @invariant()
    def ema_matches_reference(self):
        sd = self.ema.state_dict()
        weights = sd["weights"]
        names = {e.name for e in self.entries}
        assert set(weights) == names, (sorted(weights), sorted(names))
        assert set(self.ema.names()) == names
        for e in self.entries:
            got = weights[e.name]
            assert tuple(got.shape) == tuple(e.value.shape), e.name
            if e.average:
                assert got.dtype == self.ema_float_dtype, (e.name, got.dtype)
                self.assert_close(got, e.value, e.name)
            else:
                assert got.dtype == e.value.dtype and torch.equal(got, e.value), e.name
        assert self.ema.step == self.step
        assert int(sd["step"]) == self.step
        _, decay = expected_schedule(self.step, self.options)
        assert math.isclose(self.ema.current_decay, decay, rel_tol=1e-12, abs_tol=1e-15), (
            self.ema.current_decay,
            decay,
        )
        assert sd["schedule"] == {"update_every_decay": "compensated", **self.options}
        module = self.ema.module.state_dict()
        for name in names:
            assert torch.equal(module[name], weights[name]), name

    # ------------------------------------------------------------------ training

    @rule(scale=st.sampled_from([0.1, 1.0, 10.0]), how=st.sampled_from(["inplace", "data", "mix"]))
    def train(self, scale, how):
        """In-place random changes to parameters and float buffers (or new storage through
        .data), num_batches_tracked incremented."""
        self.perturb(scale, how)

    def perturb(self, scale: float = 1.0, how: str = "inplace") -> None:
        g = self.g
        with torch.no_grad():
            for _, t, _ in model_tensors(self.model):
                if not t.is_floating_point():
                    t.add_(int(torch.randint(1, 4, (), generator=g)))
                    continue
                if how == "mix" and bool(torch.rand((), generator=g) < 0.5):
                    continue
                noise = torch.randn(t.shape, generator=g) * scale
                if how == "data":
                    t.data = (t + noise).contiguous()
                else:
                    t.add_(noise)

    @rule(scale=st.sampled_from([0.1, 1.0]))
    def reassign_buffers(self, scale):
        """New buffer objects under the same names and shapes (what model.to() does): followed
        by name, never a mismatch."""
        norms = [m for m in self.model if isinstance(m, nn.BatchNorm1d)]
        for m in norms:
            m.running_mean = m.running_mean + scale * torch.randn(
                m.running_mean.shape, generator=self.g
            )

    # ------------------------------------------------------------------ updates

    @rule(data=st.data(), train_first=st.booleans())
    def update(self, data, train_first):
        if train_first:
            self.perturb()
        kind = data.draw(
            st.sampled_from(
                ["none", "int", "numpy", "tensor", "tensor32", "jump", "backwards", "nb"]
            ),
            label="step kind",
        )
        step = None
        if kind == "int":
            step = data.draw(st.integers(0, 40), label="step")
        elif kind == "numpy":
            step = np.int64(data.draw(st.integers(0, 40), label="step"))
        elif kind in ("tensor", "tensor32"):
            value = data.draw(st.integers(0, 40), label="step")
            dtype = torch.int64 if kind == "tensor" else torch.int32
            step = torch.tensor(value, dtype=dtype)
        elif kind == "jump":
            step = data.draw(st.sampled_from([10**6, 2**40, self.step + 7]), label="step")
        elif kind == "backwards":
            step = data.draw(st.integers(0, max(0, self.step - 1)), label="step")
        before = self.snapshot()
        step_value = int(step) if step is not None else None
        if not self.expect_update(step_value):
            with pytest.raises(fused_ema.StructureMismatchError):
                self.ema.update(self.model, step=step)
            self.assert_unchanged(before)
            return
        self.ema.update(self.model, step=step, non_blocking=(kind == "nb"))

    @rule(
        bad=st.sampled_from(
            [
                -1,
                -(2**40),
                True,
                False,
                3.0,
                2.5,
                math.nan,
                math.inf,
                "3",
                BIG_STEP,
                "tensor-negative",
                "tensor-float",
                "tensor-bool",
                "tensor-two",
                "tensor-big",
            ]
        )
    )
    def bad_update(self, bad):
        if bad == "tensor-negative":
            bad = torch.tensor(-3)
        elif bad == "tensor-float":
            bad = torch.tensor(2.0)
        elif bad == "tensor-bool":
            bad = torch.tensor(True)
        elif bad == "tensor-two":
            bad = torch.tensor([1, 2])
        elif bad == "tensor-big":
            bad = torch.tensor(BIG_STEP)
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.ema.update(self.model, step=bad)
        self.assert_unchanged(before)  # nothing followed either (on_mismatch="resync")

    @rule(when=st.sampled_from(["before", "after"]), explicit=st.booleans())
    def interrupted_update(self, when, explicit):
        """A KeyboardInterrupt raised by the kernel call, before or after it wrote: the update
        happened entirely (step advanced) or not at all (bit-identical)."""
        self.perturb()
        step = self.step + 1 + int(torch.randint(0, 5, (), generator=self.g)) if explicit else None
        new_step = self.step + 1 if step is None else step
        before, ref_before = self.snapshot(), copy.copy(self.entries)
        saved_values = [(e, e.value, e._obj) for e in self.entries]
        real, real_run, calls = plan_module.lerp_, prepared_module.Prepared.run, []

        def interrupting(*args, **kwargs):
            calls.append(when)
            if when == "after":
                real(*args, **kwargs)
            raise KeyboardInterrupt

        def interrupting_run(*args, **kwargs):
            calls.append(when)
            if when == "after" and not real_run(*args, **kwargs):
                calls.pop()  # it declined, having done nothing: the full update follows
                return False
            raise KeyboardInterrupt

        interrupted = False
        plan_module.lerp_ = interrupting
        prepared_module.Prepared.run = interrupting_run
        try:
            self.ema.update(self.model, step=step)
        except KeyboardInterrupt:
            interrupted = True
        except fused_ema.StructureMismatchError:
            assert self.mode == "error" and self.mismatch(for_update=True)
            self.assert_unchanged(before)
            return
        finally:
            plan_module.lerp_ = real
            prepared_module.Prepared.run = real_run
        assert interrupted == bool(calls)
        if self.ema.step == new_step:
            happened = self.expect_update(step)
            assert happened
        else:
            assert interrupted and when == "before", "an update that wrote must finish"
            assert self.ema.step == before[1]
            self.entries = ref_before
            for e, value, obj in saved_values:
                e.value, e._obj = value, obj
            self.assert_unchanged(before)
            if not self.mismatch(for_update=True):
                # The update got as far as binding each entry to the tensor now under its name (a
                # reassigned buffer): nothing observable, and it stays, as it would after any
                # later update. Identity tracking of that buffer then starts from the new object.
                self.rebind()

    # ------------------------------------------------------------------ structure changes

    def after_change(self, then: str) -> None:
        """ "follow": at once, what a user does after a structure change: with
        on_mismatch="error" the update raises and changes nothing, then ema.resync(model)."""
        if then != "follow":
            return  # left pending: later rules meet the changed model
        if self.mode == "error" and self.mismatch(for_update=True):  # (two swaps may undo)
            before = self.snapshot()
            with pytest.raises(fused_ema.StructureMismatchError):
                self.ema.update(self.model)
            self.assert_unchanged(before)
        self.resync()

    def set_layers(self, items: list) -> None:
        """The Sequential's (name, layer) list, as Sequential.__delitem__ rebuilds it."""
        self.model._modules = dict(items)

    @precondition(lambda self: len(self.model) < MAX_LAYERS)
    @rule(data=st.data(), norm=st.booleans(), then=THEN)
    def insert_layer(self, data, norm, then):
        """A layer inserted, the later ones renumbered (as Sequential.insert does): every tensor
        behind it keeps its average under its new name; only the new layer starts from itself."""
        index = data.draw(st.integers(0, len(self.model)), label="index")
        layer = fresh_norm(self.g) if norm else fresh_linear(self.g)
        layers = list(self.model._modules.values())
        layers.insert(index, layer)
        self.set_layers([(str(i), m) for i, m in enumerate(layers)])
        self.after_change(then)

    @rule(data=st.data(), then=THEN)
    def rename_layer(self, data, then):
        """A pure rename: the same tensor objects in the same order under another name."""
        index = data.draw(st.integers(0, len(self.model) - 1), label="index")
        items = list(self.model._modules.items())
        name, layer = items[index]
        items[index] = (f"r{name}", layer)
        self.set_layers(items)
        self.after_change(then)

    @precondition(lambda self: len(self.model) > 1)
    @rule(data=st.data(), then=THEN)
    def swap_layers(self, data, then):
        """Two layers exchange places (and so names)."""
        i = data.draw(st.integers(0, len(self.model) - 2), label="index")
        items = list(self.model._modules.items())
        (a, la), (b, lb) = items[i], items[i + 1]
        items[i], items[i + 1] = (a, lb), (b, la)
        self.set_layers(items)
        self.after_change(then)

    @rule(data=st.data(), reshape=st.booleans(), then=THEN)
    def replace_layer(self, data, reshape, then):
        index = data.draw(st.integers(0, len(self.model) - 1), label="index")
        old = self.model[index]
        if isinstance(old, nn.Linear):
            n_out = old.out_features
            if reshape:
                n_out = data.draw(st.sampled_from([2, 3, 5]).filter(lambda n: n != n_out))
            self.model[index] = fresh_linear(self.g, old.in_features, n_out)
        else:
            n = old.num_features + (1 if reshape else 0)
            self.model[index] = fresh_norm(self.g, n)
        self.after_change(then)

    @precondition(lambda self: len(self.model) > 1)
    @rule(then=THEN)
    def delete_last_layer(self, then):
        self.set_layers(list(self.model._modules.items())[:-1])
        self.after_change(then)

    @rule()
    def resync(self):
        self.ema.resync(self.model)
        self.follow()

    # ------------------------------------------------------------------ using the average

    @rule(raise_inside=st.booleans(), poke=st.booleans())
    def swapped(self, raise_inside, poke):
        before, values = self.snapshot(), self.model_values()
        if self.mismatch(for_update=False):
            with pytest.raises(fused_ema.StructureMismatchError):
                with self.ema.swapped(self.model):
                    pass
        else:
            averages = before[0]
            try:
                with self.ema.swapped(self.model) as inside:
                    assert inside is self.model
                    for name, t, _ in model_tensors(self.model):
                        expected = averages[name].to(t.dtype)
                        assert t.dtype == values[name].dtype
                        assert torch.equal(t.detach(), expected), name
                    if poke:  # the EMA refuses to be used while its tensors hold the model's
                        with pytest.raises(RuntimeError, match="swapped"):
                            self.ema.update(self.model)
                        with pytest.raises(RuntimeError, match="swapped"):
                            self.ema.state_dict()
                    if raise_inside:
                        raise _Boom
            except _Boom:
                assert raise_inside
        self.assert_model_is(values)
        self.assert_unchanged(before)

    @rule()
    def copy_to(self):
        before, values = self.snapshot(), self.model_values()
        if self.mismatch(for_update=False):
            with pytest.raises(fused_ema.StructureMismatchError):
                self.ema.copy_to(self.model)
            self.assert_model_is(values)
        else:
            self.ema.copy_to(self.model)
            for name, t, _ in model_tensors(self.model):
                assert torch.equal(t.detach(), before[0][name].to(t.dtype)), name
        self.assert_unchanged(before)

    # ------------------------------------------------------------------ checkpoints

    @rule()
    def save(self):
        checkpoint = copy.deepcopy(self.ema.state_dict())
        self.saved.append((checkpoint, self.reference_weights(), self.step, dict(self.options)))

    def _shapes_match(self, weights: dict) -> bool:
        mine = {e.name: tuple(e.value.shape) for e in self.entries}
        return {k: tuple(v.shape) for k, v in weights.items()} == mine

    @precondition(lambda self: self.saved)
    @rule(data=st.data(), step_as_int=st.booleans(), other_schedule=st.booleans())
    def load(self, data, step_as_int, other_schedule):
        """An exact restore of weights and step; the checkpoint's schedule (here possibly
        another valid one) replaces the EMA's."""
        index = data.draw(st.integers(0, len(self.saved) - 1), label="checkpoint")
        checkpoint, values, step, options = self.saved[index]
        state = copy.deepcopy(checkpoint)
        if step_as_int:
            state["step"] = int(state["step"])
        if other_schedule:
            options = data.draw(ema_options(), label="schedule")
            if options["warmup"] is True:
                options = {**options, "warmup": (1.0, 2.0 / 3.0)}
            options = {**options, "warmup": options["warmup"] or None}
            state["schedule"] = dict(options)
        before = self.snapshot()
        if not self._shapes_match(checkpoint["weights"]):
            with pytest.raises(fused_ema.CheckpointError):
                self.ema.load_state_dict(state)
            self.assert_unchanged(before)
            return
        result = self.ema.load_state_dict(state)
        assert result.format == "fused_ema"
        assert (result.missing_keys, result.unexpected_keys, result.mismatched_keys) == ([], [], [])
        weights = self.ema.state_dict()["weights"]
        for name, value in checkpoint["weights"].items():
            assert torch.equal(weights[name], value), name  # exact restore
        for e in self.entries:
            e.value = values[e.name].clone()
        self.step = step
        self.options = options

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def load_partial(self, data):
        """strict=False: loads what matches by name and shape, reports the rest."""
        index = data.draw(st.integers(0, len(self.saved) - 1), label="checkpoint")
        checkpoint, values, step, options = self.saved[index]
        state = copy.deepcopy(checkpoint)
        names = sorted(state["weights"])
        drop = data.draw(st.sampled_from([None, *names]), label="drop")
        if drop is not None:
            del state["weights"][drop]
        if data.draw(st.booleans(), label="unexpected"):
            state["weights"]["extra.weight"] = torch.zeros(2)
        mine = {e.name: e for e in self.entries}
        loadable = {
            k: v
            for k, v in state["weights"].items()
            if k in mine and tuple(v.shape) == tuple(mine[k].value.shape)
        }
        expected_missing = {n for n in mine if n not in state["weights"]}
        expected_unexpected = {k for k in state["weights"] if k not in mine}
        expected_mismatched = {k for k in state["weights"] if k in mine and k not in loadable}
        result = self.ema.load_state_dict(state, strict=False)
        assert set(result.missing_keys) == expected_missing
        assert set(result.unexpected_keys) == expected_unexpected
        assert set(result.mismatched_keys) == expected_mismatched
        for name in loadable:
            mine[name].value = values[name].clone()
        self.step = step
        self.options = options

    @precondition(lambda self: self.saved)
    @rule(
        data=st.data(),
        kind=st.sampled_from(
            [
                "not-a-dict",
                "none",
                "wrong-shape",
                "missing",
                "unexpected",
                "step-nan",
                "step-negative",
                "step-2**63",
                "step-fraction",
                "step-vector",
                "update_every-0",
                "decay-nan",
                "decay-above-1",
                "min_decay-above-decay",
                "warmup-negative",
                "update_after_step-negative",
                "schedule-unknown-key",
                "format_version",
                "meta",
                "sparse",
                "integer-weight",
                "not-a-tensor",
            ]
        ),
    )
    def load_corrupted(self, data, kind):
        index = data.draw(st.integers(0, len(self.saved) - 1), label="checkpoint")
        state = copy.deepcopy(self.saved[index][0])
        weights, schedule = state["weights"], state["schedule"]
        floats = sorted(k for k, v in weights.items() if v.is_floating_point())
        name = data.draw(st.sampled_from(floats), label="name")
        strict = True
        if kind == "not-a-dict":
            state = [weights[name]]
        elif kind == "none":
            state = None
        elif kind == "wrong-shape":
            weights[name] = torch.zeros(7, 3, dtype=weights[name].dtype)
        elif kind == "missing":
            del weights[name]
        elif kind == "unexpected":
            weights[name + "_extra"] = weights[name].clone()
        else:
            strict = data.draw(st.booleans(), label="strict")  # fatal even with strict=False
            if kind == "step-nan":
                state["step"] = math.nan
            elif kind == "step-negative":
                state["step"] = torch.tensor(-4)
            elif kind == "step-2**63":
                state["step"] = 2**63
            elif kind == "step-fraction":
                state["step"] = 2.5
            elif kind == "step-vector":
                state["step"] = torch.tensor([1, 2])
            elif kind == "update_every-0":
                schedule["update_every"] = 0
            elif kind == "decay-nan":
                schedule["decay"] = math.nan
            elif kind == "decay-above-1":
                schedule["decay"] = 1.5
            elif kind == "min_decay-above-decay":
                schedule["min_decay"] = schedule["decay"] + 0.25
            elif kind == "warmup-negative":
                schedule["warmup"] = (-1.0, 0.5)
            elif kind == "update_after_step-negative":
                schedule["update_after_step"] = -1
            elif kind == "schedule-unknown-key":
                schedule["ema_decay"] = 0.5
            elif kind == "format_version":
                state["format_version"] = 99
            else:
                strict = True  # a bad tensor is only reported under strict=False
                if kind == "meta":
                    weights[name] = weights[name].to("meta")
                elif kind == "sparse":
                    weights[name] = weights[name].to_sparse()
                elif kind == "integer-weight":
                    weights[name] = weights[name].long()
                elif kind == "not-a-tensor":
                    weights[name] = weights[name].tolist()
        before = self.snapshot()
        with pytest.raises(fused_ema.CheckpointError):
            self.ema.load_state_dict(state, strict=strict)
        self.assert_unchanged(before)


class Float32Machine(EmaMachine):
    """The default float32 EMA of a float32 model (the same-dtype kernel, no staging): float32
    rounding of each update, accumulated over the steps."""

    EMA_DTYPE = None
    MODES = ("error", "resync")
    RTOL = ATOL = 2e-6


class Float64ResyncMachine(EmaMachine):
    MODES = ("resync",)


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

EmaMachine.TestCase.settings = SETTINGS
Float64ResyncMachine.TestCase.settings = SETTINGS
Float32Machine.TestCase.settings = SETTINGS

TestFloat64Ema = EmaMachine.TestCase
TestFloat64EmaResync = Float64ResyncMachine.TestCase
TestFloat32Ema = Float32Machine.TestCase


def test_interrupted_update_in_resync_mode_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ema = fused_ema.ModelEma(model, decay=0.5, on_mismatch="resync")
    names = ema.names()
    del model[1]
    real, real_run = plan_module.lerp_, prepared_module.Prepared.run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # before the kernel writes anything

    plan_module.lerp_ = interrupted
    prepared_module.Prepared.run = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            ema.update(model)
    finally:
        plan_module.lerp_ = real
        prepared_module.Prepared.run = real_run
    assert ema.step == 0  # rolled back: the update did not happen...
    assert ema.names() == names  # ...so the EMA must still be as it was (fails: resynced)
