"""What binds an EMA to a model: its entries, the update plan for the model's current walk, the
evaluation module and the model it follows. When the model changed, a new binding is built aside
(structure checked, tensors placed, plan made) and switched to only once complete, with a way
back for an update that fails later."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .._dist import zero3
from .._dist.dtensor import is_dtensor, local, refuse_unsharded
from .._ext.grad import outside_inference_mode, without_grad
from .._ext.loader import _C
from .._model.module_view import EmaForwardCheck, SwappedModelView, build_module
from .._model.tracking import EntryPolicy, EntryTable, check_dense, unbound
from .._model.walk import named_tensors
from ..ops import refuse_freed
from .plan import UpdatePlan


class NamedError(ValueError):
    """A refusal that names its tensors itself (the ops' errors give list indices)."""


def _memory(t):
    """Where a plain dense tensor's storage is; None for others (meta, empty: none)."""
    plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
    return t.untyped_storage().data_ptr() or None if plain and t.numel() else None


def shared_with_ema(entries, named) -> list[str]:
    """The model tensors of `named` ((name, tensor) pairs, their storage intact) whose memory is
    one of the EMA `entries`' tensors', each with the EMA tensor it shares."""
    ours = {}
    for e in entries:
        ours.setdefault(_memory(e.ema), e.name)
    ours.pop(None, None)
    return [
        f"the model's {name} shares memory with the EMA's {ours[_memory(t)]} (the EMA must own "
        "its tensors: was an EMA tensor put into the model, or the EMA's module passed as the "
        "model?)"
        for name, t in named
        if _memory(t) in ours
    ]


_RESYNC_HINT = (
    "Call ema.resync(model) to follow the model (tensors keep their average under their new "
    "names, new or reshaped ones start from the model), or build the EMA with "
    "on_mismatch='resync'."
)


class Binding:
    def __init__(self, ema, model: nn.Module, policy: EntryPolicy, on_mismatch: str, seed):
        self.policy = policy
        self.on_mismatch = on_mismatch
        self.seed = seed  # stochastic rounding of 16-bit EMA tensors; None: round to nearest
        tracked = policy.select(named_tensors(model, self.with_buffers), warn_unused=True)
        if policy.shard is not None:
            policy.shard.check_replicated(tracked)
        self.table = _normal(
            lambda: self._packed(EntryTable([policy.new_entry(t) for t in tracked]))
        )
        self.plan: UpdatePlan | None = None
        self.model_ref = weakref.ref(model)
        self.module = self._build_module(ema, self.table.entries, model)

    def _packed(self, table: EntryTable) -> EntryTable:
        """A sharded EMA's chunks in one flat buffer per dtype and device (see _dist/shard.py)."""
        shard = self.policy.shard
        return table if shard is None else EntryTable(shard.pack(table.entries))

    def _followed(self, tracked) -> EntryTable:
        """The table for `tracked`, built aside (autograd off) from the current one."""
        return _normal(lambda: self._packed(self.table.followed(tracked, self.policy)))

    def _build_module(self, ema, entries, model) -> nn.Module:
        # A sharded EMA is gathered into the model for each forward; ZeRO-3 partitions cannot
        # stand in for the weights of a copy.
        if self.policy.shard is not None or self.zero3(entries):
            return SwappedModelView(ema, model)
        return build_module(ema, entries, model, self.policy.dtype)

    def zero3(self, entries=None) -> bool:
        """Whether the EMA follows a DeepSpeed ZeRO-3 model (averages partitions)."""
        return any(zero3.is_zero3(e.bound()) for e in entries or self.table.entries)

    @property
    def with_buffers(self) -> bool:
        return self.policy.buffers != "ignore"

    def tracked(self, model: nn.Module) -> list:
        """The model's tensors this EMA follows (without those ignore_names leaves out), refusing
        those FSDP2 holds unsharded (see refuse_unsharded)."""
        tracked = self.policy.select(named_tensors(model, self.with_buffers))
        refuse_unsharded(self.table.by_name, tracked, self.policy.shard)
        for t in tracked:  # (a buffer replaced by a sparse one is followed, not made anew)
            check_dense(t)
        return tracked

    def schedule_device(self, table: EntryTable | None = None) -> torch.device:
        """Where the step counter lives: with the first EMA tensor that is not on the CPU."""
        for entry in (table or self.table).entries:
            device = local(entry.ema).device
            if device.type not in ("cpu", "meta"):
                return device
        return torch.device("cpu")

    # ------------------------------------------------------------------ following the model

    def walk(self, model, snapshot) -> tuple[list, int | None]:
        """The model's walk and the hash of its names; the hash is None when the current plan
        (for `snapshot`) vouches, through what its last walk read, that the model holds the same
        tensor objects under the same names."""
        walk = self.plan.unchanged_walk(model) if self.vouches(snapshot) else None
        return (walk, None) if walk is not None else _C.tensor_walk(model, self.with_buffers, True)

    def vouches(self, snapshot) -> bool:
        """Whether the current plan (for `snapshot`) may be used when the model is unchanged."""
        return self.plan is not None and self.plan.snapshot == snapshot

    def plan_for(self, ema, model, walk, names, snapshot, schedule, trusted, undos: list):
        """The plan for this walk of `model` (from walk()); how to undo what was needed to make
        it goes into `undos` (nothing when the current plan fits). `trusted`: the prepared update
        checks what the tensors hold, so the plan need only hold the same objects."""
        plan = self.plan
        # (trusted: the prepared update's own check declines a converted EMA tensor, and the
        # update comes back here untrusted)
        converted = [] if plan is None or trusted else plan.converted(self.table)
        if converted:
            raise NamedError(
                f"fused_ema: EMA tensors converted behind the EMA's back: {', '.join(converted)} "
                "(through ema.module? ema.to(dtype) converts the whole EMA); nothing was changed"
            )
        if self.vouches(snapshot) and (trusted or plan.same_tensors(walk)):
            if names is None:  # the walk cache vouched for the objects and names
                return plan
            if names == plan.names and _C.walk_matches(walk, plan.refs):  # the same objects
                plan.remember(model, walk, self.with_buffers)
                return plan
        if names is None:  # a walk cache (the leader's, for a follower) vouched: planned again
            names = _C.tensor_walk(model, self.with_buffers, True)[1]
        tracked = self.tracked(model)
        table = self.table
        changes = table.changes(tracked)
        shared = changes and shared_with_ema(table.entries, [(t.name, t.tensor) for t in tracked])
        if shared:  # (rather than the structure change it looks like)
            raise NamedError(f"fused_ema: {', '.join(shared)}; nothing was changed")
        if changes and self.on_mismatch == "error":
            raise changes.error(_RESYNC_HINT)
        # Changed, or partitioned by ZeRO-3 since the EMA was built (each rank keeps its slice).
        if changes or changes.partitioned:
            table = self._followed(tracked)
        return self.adopt(ema, model, table, tracked, schedule, (walk, names), snapshot, undos)

    def resync(self, ema, model: nn.Module, schedule, undos=None) -> None:
        tracked = self.tracked(model)
        shared = shared_with_ema(self.table.entries, [(t.name, t.tensor) for t in tracked])
        if shared:  # ema.resync(ema.module) would make the EMA average itself
            raise NamedError(f"fused_ema: {', '.join(shared)}; nothing was changed")
        self.adopt(ema, model, self._followed(tracked), tracked, schedule, undos=undos)

    def adopt(self, ema, model, table, tracked, schedule, walk=None, snapshot=False, undos=None):
        """Makes `table` the binding's, placed for `model`, with a plan for `walk`; builds
        everything first and changes the EMA only once nothing can fail. Returns the plan; a
        function that puts the previous state back goes into `undos` before the switch."""
        current = {n: t.tensor for t in tracked for n in t.names}
        meta = [e.name for e in table.entries if e.ema.is_meta and not current[e.name].is_meta]
        if meta:
            raise RuntimeError(
                f"fused_ema: {len(meta)} EMA tensors were made from a meta-device model and hold "
                f"no values (e.g. {meta[0]}); call ema.resync(model) once the model is "
                "materialised (model.to_empty(...) and its initialisation)"
            )
        # The reverse: a model tensor moved to meta (`.to("meta")`) has no values to average into
        # (or copy from) the EMA's, which the update would only find out after moving the step.
        lost = [e.name for e in table.entries if current[e.name].is_meta and not e.ema.is_meta]
        if lost:
            raise RuntimeError(
                f"fused_ema: {len(lost)} model tensors are on the meta device and hold no values "
                f"(e.g. {lost[0]}), where this EMA's hold values: materialise the model "
                "(model.to_empty(...) and its initialisation, or load its weights) first"
            )
        previous = (self.table, self.plan, self.module, self.model_ref)
        previous_place = schedule.step.device
        moves = []
        if self.policy.device is None:  # each EMA tensor follows its model tensor
            for e in table.entries:
                src = current[e.name]
                if is_dtensor(e.ema) or is_dtensor(src) or src.is_meta or zero3.is_zero3(src):
                    continue  # a shard (or ZeRO-3 partition) stays where it was made
                if e.ema.device != src.device:
                    moves.append((e.ema, e.ema.data, _normal(e.ema.data.to, src.device)))
        # What the table's entries follow now: rebind() moves them, an undo puts them back (the
        # old table's entries must keep following the old tensors, or identity matching breaks).
        bindings = [(e, e.bound) for e in table.entries]
        for tensor, _, moved in moves:
            tensor.data = moved
        try:
            table.rebind(tracked)
            plan = None
            if walk is not None:  # remembered before the switch: an interrupt there loses no undo
                plan = UpdatePlan(table, *walk, snapshot, self.seed)
                plan.remember(model, walk[0], self.with_buffers)
            schedule.place(self.schedule_device(table))
            module = self.module
            if table is not self.table or moves:
                module = self._build_module(ema, table.entries, model)
            model_ref = weakref.ref(model)
        except BaseException:
            for tensor, before, _ in moves:
                tensor.data = before
            for entry, bound in bindings:
                entry.bound = bound
            raise

        def undo():
            for tensor, before, _ in moves:
                tensor.data = before
            for entry, bound in bindings:
                entry.bound = bound
            self.table, self.plan, self.module, self.model_ref = previous
            schedule.place(previous_place)

        if undos is not None:
            undos.append(undo)  # before the switch: an interrupt from here on finds it
        self.table, self.plan, self.module, self.model_ref = table, plan, module, model_ref
        return plan

    def pairs_with(self, model: nn.Module) -> list:
        """(name, EMA tensor, model tensor) for every entry, matched by name and shape."""
        tracked = self.tracked(model)
        changes = self.table.changes(tracked)
        mismatch = changes.error("Call ema.resync(model) first.", replaced=False)
        if mismatch:  # tensors replaced under the same names are written by name
            raise mismatch
        if changes.partitioned:
            raise RuntimeError(
                f"fused_ema: DeepSpeed ZeRO-3 has partitioned {len(changes.partitioned)} "
                f"parameters (e.g. {changes.partitioned[0]}) since this EMA was built from the "
                "whole model: call ema.update(model) or ema.resync(model) first, after which each "
                "rank keeps its slice of the EMA"
            )
        current = {name: t.tensor for t in tracked for name in t.names}
        pairs = [(e.name, e.ema, current[e.name]) for e in self.table.entries]
        refuse_freed([(name, t) for name, _, t in pairs], "the model's")  # a copy would read it
        refuse_freed([(name, e) for name, e, _ in pairs], "the EMA's")
        return pairs

    def module_for(self, ema) -> nn.Module:
        if self.module is None:
            model = self.model_ref()
            if model is None:
                raise RuntimeError("ema.module: call ema.update(model) or ema.resync(model) first")
            self.module = self._build_module(ema, self.table.entries, model)
        return self.module

    def set_seed(self, seed) -> None:
        if seed != self.seed:
            self.seed, self.plan = seed, None

    # ------------------------------------------------------------------ copies and pickling

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "plan": None, "model_ref": unbound}
        if isinstance(self.module, SwappedModelView):
            state["module"] = None  # runs a live model: rebuilt from the next one
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for entry in self.table.entries:
            entry.bound = unbound  # bound again by name at the next update or resync

    def rehook(self, ema) -> None:
        """Points ema.module's forward check at `ema` (after a copy or unpickling)."""
        if self.module is not None:
            for hook in self.module._forward_pre_hooks.values():
                if isinstance(hook, EmaForwardCheck):
                    hook._ema = weakref.ref(ema)


# `fn(*args)` with autograd off, making normal tensors: an update or resync may make new ones.
_normal = outside_inference_mode(without_grad)
