"""The EMA's entries and how a changed model is matched to them: by tensor identity first (a
module inserted or renamed keeps its tensors' averages), then by name. Which tensors a model has
is walk.py's job; which names are copied or left out, name_filters.py's."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .._dist import zero3
from .._dist.dtensor import check_averageable, is_dtensor, same_layout
from ..errors import StructureMismatchError
from ..ops import refuse_freed
from .name_filters import NameFilter
from .walk import PARAM, Tracked


def unbound():  # stands in for the weakref of an entry bound to no tensor yet (unpickled)
    return None


@dataclass
class Entry:
    """One distinct model tensor followed by the EMA, under all its names."""

    names: list[str]
    kind: str
    ema: torch.Tensor  # an nn.Parameter (requires_grad=False) for parameters
    average: bool  # lerp toward the model, or copy it (integer buffers, buffers="copy")
    bound: weakref.ref  # the model tensor object it follows

    @property
    def name(self) -> str:
        return self.names[0]

    def __getstate__(self) -> dict:
        # A copy follows the model by name until its next update binds it again.
        return {**self.__dict__, "bound": unbound}


@dataclass
class EntryPolicy:
    """How a model tensor becomes an EMA entry: where it lives, in which dtype, averaged, copied
    or left out. A tensor follows the rule of any of its names (tied weights have several):
    `ignore` before `copy` before averaging, as ema-pytorch checks them."""

    device: torch.device | None
    dtype: torch.dtype | None
    buffers: str
    copy: tuple = ()  # name patterns copied from the model at every update, not averaged
    ignore: tuple = ()  # name patterns left out of the EMA
    shard: object = None  # a _dist.shard.ShardSpec: averaged tensors keep this rank's chunk only

    def filters(self) -> dict:
        """The name filters as state_dict() saves them."""
        return {"copy_names": list(self.copy), "ignore_names": list(self.ignore)}

    def __post_init__(self):
        self.copy_filter, self.ignore_filter = NameFilter(self.copy), NameFilter(self.ignore)

    def select(self, tracked: list[Tracked], warn_unused: bool = False) -> list[Tracked]:
        """`tracked` without the tensors ignore_names leaves out."""
        if warn_unused:
            names = [n for t in tracked for n in t.names]
            for what, patterns in (("copy_names", self.copy), ("ignore_names", self.ignore)):
                if unused := NameFilter(patterns).unused(names):
                    warnings.warn(
                        f"fused_ema: {what} {unused} match no parameter or buffer of the model "
                        f"(names look like {names[:3]})",
                        UserWarning,
                        stacklevel=4,
                    )
        return [t for t in tracked if not self.ignore_filter.matches_any(t.names)]

    def new_entry(self, tracked: Tracked) -> Entry:
        """The EMA of one model tensor; for a ZeRO-3 parameter, of this rank's valid partition
        elements, flat (1-D)."""
        if nn.parameter.is_lazy(tracked.tensor):
            raise ValueError(
                f"fused_ema: {tracked.kind} {tracked.name} is uninitialized (a lazy module such as "
                "nn.LazyLinear): run one forward pass to materialize it before building the EMA or "
                "calling ema.resync(model)"
            )
        t = tracked.tensor.detach()
        if zero3.is_zero3(tracked.tensor):
            if self.shard is not None:
                raise ValueError(
                    f"fused_ema: {tracked.name} is partitioned by DeepSpeed ZeRO-3, and the EMA of "
                    "a ZeRO-3 model is partitioned with it: build it without shard="
                )
            t = zero3.partition(tracked.tensor).detach()
        refuse_freed([(tracked.name, t)], "the model's")  # the copy below would read it
        check_dense(tracked, t)
        if t.is_complex() and tracked.kind == PARAM:
            raise ValueError(
                f"fused_ema: parameter {tracked.name} is {t.dtype}; the fused kernels average real "
                "floating-point tensors. Register it as two real parameters (torch.view_as_real) "
                "or as a buffer (buffers are copied)."
            )
        # Averaged ones are kept in the policy's dtype, else float32 (float64 for float64 tensors).
        average = self.averages(tracked)
        dtype = average_dtype(t, self.dtype) if average else t.dtype
        if is_dtensor(t):
            check_averageable(tracked.name, t)
            if self.device is not None and self.device != t.device:
                raise ValueError(
                    f"{tracked.name} is sharded (a DTensor on {t.device}); its EMA lives with its "
                    f"shard, so device={str(self.device)!r} cannot apply. Build the EMA with "
                    "device=None, and gather it with ema.full_state_dict() where needed."
                )
        # A shard's EMA lives with it; a meta tensor's holds no values yet (resync(model) after
        # materialising the model).
        device = t.device if is_dtensor(t) or t.is_meta or self.device is None else self.device
        if self.shard is not None and average and t.dim() > 0 and not t.is_meta:
            ema = self.shard.new_ema(t, device, dtype)
        else:
            ema = t.to(device=device, dtype=dtype, copy=True)
        if tracked.kind == PARAM:
            ema = nn.Parameter(ema, requires_grad=False)
        return Entry(list(tracked.names), tracked.kind, ema, average, weakref.ref(tracked.tensor))

    def averages(self, tracked: Tracked) -> bool:
        """Whether `tracked` is averaged, not copied: a floating parameter (or buffer, with
        buffers="average") that copy_names, matched against its present names, leaves alone."""
        t = tracked.tensor
        copied = not t.is_floating_point() or (tracked.kind != PARAM and self.buffers != "average")
        return not copied and not self.copy_filter.matches_any(tracked.names)


@dataclass
class Changes:
    """How a model's tensors differ from the EMA's entries (every list holds names)."""

    added: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    renamed: list = field(default_factory=list)  # "old -> new": the same tensor under a new name
    reshaped: list = field(default_factory=list)
    replaced: list = field(default_factory=list)  # a parameter name now holds another tensor
    untied: list = field(default_factory=list)  # of those, names of a tie the model no longer has
    # Parameters that DeepSpeed ZeRO-3 partitioned after the EMA was built (deepspeed.initialize
    # or accelerator.prepare after ModelEma(model)): not a change, the EMA follows them as is.
    partitioned: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.renamed or self.reshaped or self.replaced)

    def error(self, hint: str, replaced: bool = True) -> StructureMismatchError:
        """The error that lists these changes (not the replaced tensors unless `replaced`)."""
        # A tie undone stays an error by name too: one EMA tensor cannot be written into (or
        # take values from) two model tensors, and writing only the first left the others as were.
        kept = self.replaced if replaced else self.untied
        return StructureMismatchError(
            self.added, self.removed, self.reshaped, kept, hint, self.renamed
        )


def average_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an EMA of dtype= `dtype` averages the floating tensor `t` in."""
    return dtype or (torch.float64 if t.dtype == torch.float64 else torch.float32)


def check_dense(tracked: Tracked, t: torch.Tensor | None = None) -> None:
    """Refuses, by name, a sparse (or other non-strided) model tensor: the kernels read dense."""
    t = tracked.tensor if t is None else t
    if t.layout != torch.strided:
        raise ValueError(
            f"fused_ema: {tracked.kind} {tracked.name} is a {t.layout} tensor; the EMA holds "
            f"dense (strided) tensors. Leave it out: ignore_names=[{tracked.name!r}]"
        )


def _kind(t: torch.Tensor) -> int:
    """0 integer or bool, 1 real floating point, 2 complex: a tensor of one kind cannot stand for
    another's (averaging an integer, or casting a complex value to a real EMA, is lossy)."""
    return 2 if t.is_complex() else int(t.is_floating_point())


def _layout_change(entry: Entry, t: torch.Tensor) -> str | None:
    """None while the entry's layout fits `t`; else "partitioned" when it holds the whole EMA of a
    parameter that ZeRO-3 has partitioned since (each rank keeps its slice of it), or "reshaped"
    (a meta EMA of a tensor materialised since too, or a tensor whose values changed kind:
    `p.data = ` a complex tensor, an integer buffer replaced by a float one)."""
    fits = zero3.same_layout if zero3.is_zero3(t) else same_layout
    meta = entry.ema.is_meta and not t.is_meta
    if fits(entry.ema, t) and not meta and _kind(entry.ema) == _kind(t):
        return None
    whole = zero3.is_zero3(t) and not entry.ema.is_meta and entry.ema.shape == t.ds_shape
    return "partitioned" if whole else "reshaped"


class EntryTable:
    """The EMA's entries and the index of their names. Never changed in place by a resync: a
    new table is built, so a failure half-way leaves the old one intact."""

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self.by_name = {name: e for e in entries for name in e.names}

    def match(self, tracked: list[Tracked]) -> list[tuple[Tracked, Entry | None, str]]:
        """Pairs every model tensor with an entry: the entry bound to that very tensor object
        first (whatever its name now), then an unclaimed entry of the same name, kind and shape.
        Each pair carries how it was found: "same", "renamed", "reshaped" (same object, new
        shape), "partitioned" (by ZeRO-3 since), "replaced" (by name), "untied" (by name, entry
        already claimed) or "new"."""
        by_object = {id(e.bound()): e for e in reversed(self.entries)}  # the first entry bound
        claimed: dict[int, list] = {}  # entry id -> the names its claimer carries now
        found: dict[int, tuple[Entry, str]] = {}
        for k, t in enumerate(tracked):
            e = by_object.get(id(t.tensor))
            if e is None or e.bound() is not t.tensor or id(e) in claimed or e.kind != t.kind:
                continue
            claimed[id(e)] = t.names
            if change := _layout_change(e, t.tensor):
                found[k] = (e, change)
            elif set(t.names) != set(e.names):
                found[k] = (e, "renamed")
            else:
                found[k] = (e, "same")
        for k, t in enumerate(tracked):
            if k in found:
                continue
            for name in t.names:
                e = self.by_name.get(name)
                if e is None or e.kind != t.kind:
                    continue
                if id(e) in claimed and not set(claimed[id(e)]) & set(e.names):
                    continue  # its tensor moved to another name: this one is new
                if change := _layout_change(e, t.tensor):
                    found[k] = (e, change)
                elif id(e) in claimed:
                    found[k] = (e, "untied")
                elif e.bound is unbound:
                    found[k] = (e, "same")  # never bound (unpickled): names are all there is
                else:
                    found[k] = (e, "replaced")
                claimed.setdefault(id(e), t.names)
                break
        return [(t, *found.get(k, (None, "new"))) for k, t in enumerate(tracked)]

    def changes(self, tracked: list[Tracked]) -> Changes:
        """What on_mismatch="error" reports. Buffers that are new objects under the same name and
        shape (model.to(), .float()) are followed, not reported."""
        out = Changes()
        claimed, renamed = set(), set()
        for t, e, how in self.match(tracked):
            if e is not None:
                claimed.add(id(e))
            if how == "new":
                out.added += t.names
            elif how == "renamed":
                renamed.add(id(e))
                out.renamed.append(f"{', '.join(e.names)} -> {', '.join(t.names)}")
            elif how == "reshaped":
                shape = "meta" if e.ema.is_meta else list(e.ema.shape)
                model = list(t.tensor.shape)
                if shape == model:  # same shape, another kind of values
                    shape, model = (f"{x.dtype} {model}" for x in (e.ema, t.tensor))
                out.reshaped.append(f"{t.name} (EMA {shape}, model {model})")
            elif how == "partitioned":
                out.partitioned += t.names
            elif how in ("replaced", "untied") and t.kind == PARAM:
                out.replaced += [n for n in t.names if n in e.names] or t.names[:1]
                out.added += [n for n in t.names if n not in e.names]
            if how == "untied":
                out.untied += [n for n in t.names if n in e.names] or t.names[:1]
        out.removed = [n for e in self.entries if id(e) not in claimed for n in e.names]
        # names an entry had that its tensor no longer carries (a tie was undone)
        current = {n for t in tracked for n in t.names}
        for e in self.entries:
            if id(e) in claimed and id(e) not in renamed:
                out.removed += [n for n in e.names if n not in current]
        return out

    def followed(self, tracked: list[Tracked], policy: EntryPolicy) -> EntryTable:
        """A table that follows `tracked` (ema.resync): matched entries keep their average under
        the tensor's current names, reshaped and new tensors start from the model, an untied
        weight starts from a copy of the average it shared, a parameter ZeRO-3 partitioned keeps
        this rank's slice of its average (every rank holds the whole one: no collective), and
        removed entries go. One that copy_names now rules otherwise under its present names
        (renamed into or out of a pattern, or tied to a name in one) starts anew, as in a new
        EMA."""
        entries = []
        for t, e, how in self.match(tracked):
            if how in ("new", "reshaped") or policy.averages(t) != e.average:
                entries.append(policy.new_entry(t))
                continue
            ema = e.ema
            if how in ("untied", "partitioned"):
                data = ema.detach()
                if how == "partitioned":
                    data = zero3.take_partition(data, t.tensor)
                data = data.clone()
                ema = nn.Parameter(data, requires_grad=False) if t.kind == PARAM else data
            entries.append(Entry(list(t.names), t.kind, ema, e.average, weakref.ref(t.tensor)))
        return EntryTable(entries)

    def rebind(self, tracked: list[Tracked]) -> None:
        """Points every entry at the tensor object now carrying its first name."""
        for t in tracked:
            entry = self.by_name.get(t.name)
            if entry is not None:
                entry.bound = weakref.ref(t.tensor)
