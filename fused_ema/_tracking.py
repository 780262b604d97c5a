"""Which tensors of a model an EMA follows, under which names, and how a changed model is
matched to the EMA's entries: by tensor identity first (a module inserted or renamed keeps its
tensors' averages), then by name. Parameters (a tied parameter once, with all its names) and
persistent buffers are found the way ``named_parameters``/``state_dict`` do; DDP, DataParallel
and torch.compile wrappers are unwrapped and FSDP1 / activation-checkpoint name components dropped.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import re
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

PARAM = "param"
BUFFER = "buffer"

# Name components that wrappers insert between a module and its children.
_WRAPPER_COMPONENT = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")
# Prefixes a whole checkpoint may carry: DDP/DataParallel (module.), torch.compile (_orig_mod.).
_CHECKPOINT_PREFIXES = ("module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / torch.compile wrappers (any nesting)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        inner = _orig_mod(model)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _orig_mod(model: nn.Module):
    """model._orig_mod (torch.compile's wrapper keeps the model there) as getattr finds it, but
    for a plain module without raising and catching the AttributeError of nn.Module.__getattr__:
    that cost a few microseconds per update."""
    kind = type(model)
    if kind.__getattr__ is not nn.Module.__getattr__ or hasattr(kind, "_orig_mod"):
        return getattr(model, "_orig_mod", None)
    attributes = model.__dict__
    if "_orig_mod" in attributes:
        return attributes["_orig_mod"]
    for where in ("_parameters", "_buffers", "_modules"):  # nn.Module.__getattr__'s order
        found = attributes.get(where)
        if found is not None and "_orig_mod" in found:
            return found["_orig_mod"]
    return None


def clean_name(name: str) -> str:
    return _WRAPPER_COMPONENT.sub(r"\1", name)


def strip_checkpoint_prefixes(names) -> dict[str, str]:
    """Maps each checkpoint key to its name without a prefix that *every* key carries."""
    mapping = {name: clean_name(name) for name in names}
    changed = True
    while changed and mapping:
        changed = False
        for prefix in _CHECKPOINT_PREFIXES:
            if all(stripped.startswith(prefix) for stripped in mapping.values()):
                mapping = {key: stripped[len(prefix) :] for key, stripped in mapping.items()}
                changed = True
    return mapping


@dataclass
class Tracked:
    """One distinct tensor of the model: its names (tied weights have several) and kind."""

    names: list[str]
    kind: str
    tensor: torch.Tensor = field(repr=False)

    @property
    def name(self) -> str:
        return self.names[0]


def _modules(model: nn.Module):
    """(prefix, module) for every distinct module, in named_modules order, without the cost of
    building names for modules that have no tensors of their own."""
    seen = set()
    stack = [("", model)]
    while stack:
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield prefix, module
        children = [
            (f"{prefix}{name}.", child)
            for name, child in module._modules.items()
            if child is not None
        ]
        stack.extend(reversed(children))


def _persistent_buffers(module: nn.Module):
    skip = module._non_persistent_buffers_set
    return ((n, b) for n, b in module._buffers.items() if b is not None and n not in skip)


def named_tensors(model: nn.Module, with_buffers: bool = True) -> list[Tracked]:
    """Every distinct parameter, then every distinct persistent buffer, by first name."""
    by_id: dict[int, Tracked] = {}
    params: list[Tracked] = []
    buffers: list[Tracked] = []
    for prefix, module in _modules(model):
        items = [(n, p, PARAM) for n, p in module._parameters.items() if p is not None]
        if with_buffers:
            items += [(n, b, BUFFER) for n, b in _persistent_buffers(module)]
        for name, tensor, kind in items:
            full = clean_name(prefix + name)
            if id(tensor) in by_id:
                by_id[id(tensor)].names.append(full)
                continue
            entry = Tracked([full], kind, tensor)
            by_id[id(tensor)] = entry
            (params if kind == PARAM else buffers).append(entry)
    return params + buffers


def tensor_walk(model: nn.Module, with_buffers: bool = True) -> list:
    """The model's tensors (and None placeholders) in a fixed order, as cheaply as Python
    allows: compared by identity with the previous update's walk, it tells whether anything was
    added, removed or replaced. Shared modules are visited once, as named_modules does."""
    out: list = []
    extend = out.extend
    seen: set = set()
    mark = seen.add
    stack = [model]
    pop, push = stack.pop, stack.extend
    while stack:
        module = pop()
        if id(module) in seen:
            continue
        mark(id(module))
        extend(module._parameters.values())
        if with_buffers:
            skip = module._non_persistent_buffers_set
            buffers = module._buffers
            extend([b for n, b in buffers.items() if n not in skip] if skip else buffers.values())
        push([m for m in reversed(module._modules.values()) if m is not None])
    return out


# ---------------------------------------------------------------------- the EMA's entries


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


def check_name_patterns(what: str, value) -> tuple[str, ...]:
    """Name patterns (an exact name, a module name, or an fnmatch glob), validated: None, one
    string, or an iterable of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise ValueError(
            f"{what} must be a name, a module name or a glob, or a list of them; got "
            f"{type(value).__name__} {value!r}"
        ) from None
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(
                f"{what} must hold non-empty strings (names, module names or globs), got "
                f"{type(item).__name__} {item!r}"
            )
    return tuple(dict.fromkeys(items))


def prefix_patterns(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """Globs matching every name that starts with one of `prefixes` (ema-pytorch's
    ignore_startswith_names: plain string prefixes)."""
    return tuple(glob.escape(p) + "*" for p in prefixes)


class NameFilter:
    """Matches tensor names against patterns: a name equal to a pattern, under a module of that
    name ("head" matches "head.weight"), or matched by it as an fnmatch glob (*, ?, [...])."""

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = patterns
        self._exact = set(patterns)
        globs = [fnmatch.translate(p) for p in patterns if glob.has_magic(p)]
        self._glob = re.compile("|".join(globs)) if globs else None

    def __call__(self, name: str) -> bool:
        if name in self._exact:
            return True
        if self._glob is not None and self._glob.match(name):
            return True
        parts = name.split(".")
        return any(".".join(parts[:k]) in self._exact for k in range(1, len(parts)))

    def matches_any(self, names) -> bool:
        return bool(self.patterns) and any(self(n) for n in names)

    def unused(self, names) -> list[str]:
        """The patterns that match none of `names`."""
        unused = []
        for pattern in self.patterns:
            one = NameFilter((pattern,))
            if not any(one(n) for n in names):
                unused.append(pattern)
        return unused


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
    shard: object = None  # a _shard.ShardSpec: averaged tensors keep this rank's chunk only

    def filters(self) -> dict:
        """The name filters as state_dict() saves them."""
        return {"copy_names": list(self.copy), "ignore_names": list(self.ignore)}

    @functools.cached_property
    def copy_filter(self) -> NameFilter:
        return NameFilter(self.copy)

    @functools.cached_property
    def ignore_filter(self) -> NameFilter:
        return NameFilter(self.ignore)

    def select(self, tracked: list[Tracked], warn_unused: bool = False) -> list[Tracked]:
        """`tracked` without the tensors ignore_names leaves out."""
        if warn_unused:
            names = [n for t in tracked for n in t.names]
            for what, patterns in (("copy_names", self.copy), ("ignore_names", self.ignore)):
                unused = NameFilter(patterns).unused(names)
                if unused:
                    warnings.warn(
                        f"fused_ema: {what} {unused} match no parameter or buffer of the model "
                        f"(names look like {names[:3]})",
                        UserWarning,
                        stacklevel=4,
                    )
        if not self.ignore:
            return tracked
        return [t for t in tracked if not self.ignore_filter.matches_any(t.names)]

    def averages(self, t: torch.Tensor, kind: str, names=()) -> bool:
        if not t.is_floating_point() or (kind != PARAM and self.buffers != "average"):
            return False
        return not self.copy_filter.matches_any(names)

    def new_entry(self, tracked: Tracked, *, meta_ok: bool = True) -> Entry:
        from ._dtensor import check_averageable, is_dtensor

        t = tracked.tensor.detach()
        if t.is_complex() and tracked.kind == PARAM:
            raise ValueError(
                f"fused_ema: parameter {tracked.name} is {t.dtype}; the fused kernels average real "
                "floating-point tensors. Register it as two real parameters (torch.view_as_real) "
                "or as a buffer (buffers are copied)."
            )
        average = self.averages(t, tracked.kind, tracked.names)
        if not average:
            dtype = t.dtype
        elif self.dtype is not None:
            dtype = self.dtype
        else:
            dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        if is_dtensor(t):
            check_averageable(tracked.name, t)
            if self.device is not None and self.device != t.device:
                raise ValueError(
                    f"{tracked.name} is sharded (a DTensor on {t.device}); its EMA lives with its "
                    f"shard, so device={str(self.device)!r} cannot apply. Build the EMA with "
                    "device=None, and gather it with ema.full_state_dict() where needed."
                )
            device = t.device
        elif t.is_meta:
            if not meta_ok:
                raise ValueError(f"{tracked.name} is a meta tensor, which holds no values")
            device = t.device  # no values yet: resync(model) after materialising the model
        else:
            device = self.device if self.device is not None else t.device
        if self.shard is not None and average and t.dim() > 0 and not t.is_meta:
            ema = self.shard.new_ema(t, device, dtype)
        else:
            ema = t.to(device=device, dtype=dtype, copy=True)
        if tracked.kind == PARAM:
            ema = nn.Parameter(ema, requires_grad=False)
        return Entry(list(tracked.names), tracked.kind, ema, average, weakref.ref(tracked.tensor))


@dataclass
class Changes:
    """How a model's tensors differ from the EMA's entries (every list holds names)."""

    added: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    renamed: list = field(default_factory=list)  # "old -> new": the same tensor under a new name
    reshaped: list = field(default_factory=list)
    replaced: list = field(default_factory=list)  # a parameter name now holds another tensor

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.renamed or self.reshaped or self.replaced)


def _same_layout(entry: Entry, t: torch.Tensor) -> bool:
    from ._dtensor import same_layout

    return same_layout(entry.ema, t)


class EntryTable:
    """The EMA's entries and the index of their names. Never changed in place by a resync: a
    new table is built, so a failure half-way leaves the old one intact."""

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self.by_name = {name: e for e in entries for name in e.names}

    def names(self) -> list[str]:
        return [name for e in self.entries for name in e.names]

    def match(self, tracked: list[Tracked]) -> list[tuple[Tracked, Entry | None, str]]:
        """Pairs every model tensor with an entry: the entry bound to that very tensor object
        first (whatever its name now), then an unclaimed entry of the same name, kind and shape.
        Each pair carries how it was found: "same", "renamed", "reshaped" (same object, new
        shape), "replaced" (by name), "untied" (by name, entry already claimed) or "new"."""
        by_object = {}
        for e in self.entries:
            bound = e.bound()
            if bound is not None:
                by_object.setdefault(id(bound), e)
        claimed: dict[int, list] = {}  # entry id -> the names its claimer carries now
        found: dict[int, tuple[Entry, str]] = {}
        for k, t in enumerate(tracked):
            e = by_object.get(id(t.tensor))
            if e is None or e.bound() is not t.tensor or id(e) in claimed or e.kind != t.kind:
                continue
            claimed[id(e)] = t.names
            if not _same_layout(e, t.tensor) or (e.ema.is_meta and not t.tensor.is_meta):
                found[k] = (e, "reshaped")
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
                if not _same_layout(e, t.tensor) or (e.ema.is_meta and not t.tensor.is_meta):
                    found[k] = (e, "reshaped")
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
                old = ", ".join(e.names)
                out.renamed.append(f"{old} -> {', '.join(t.names)}")
            elif how == "reshaped":
                shape = "meta" if e.ema.is_meta else list(e.ema.shape)
                out.reshaped.append(f"{t.name} (EMA {shape}, model {list(t.tensor.shape)})")
            elif how in ("replaced", "untied") and t.kind == PARAM:
                out.replaced += [n for n in t.names if n in e.names] or t.names[:1]
                extra = [n for n in t.names if n not in e.names]
                out.added += extra
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
        weight starts from a copy of the average it shared, and removed entries go."""
        entries = []
        for t, e, how in self.match(tracked):
            if how in ("new", "reshaped"):
                entries.append(policy.new_entry(t, meta_ok=True))
                continue
            ema = e.ema
            if how == "untied":
                data = ema.detach().clone()
                ema = nn.Parameter(data, requires_grad=False) if t.kind == PARAM else data
            entries.append(Entry(list(t.names), t.kind, ema, e.average, weakref.ref(t.tensor)))
        return EntryTable(entries)

    def rebind(self, tracked: list[Tracked]) -> None:
        """Points every entry at the tensor object now carrying its first name."""
        for t in tracked:
            entry = self.by_name.get(t.name)
            if entry is not None:
                entry.bound = weakref.ref(t.tensor)


def name_filters(copy_names, ignore_names, no_ema_names, ignore_prefixes) -> tuple[tuple, tuple]:
    """ModelEma's (copy, ignore) name patterns, with ema-pytorch's spellings folded in:
    param_or_buffer_names_no_ema copies, ignore_startswith_names ignores by string prefix."""
    copy = check_name_patterns("copy_names", copy_names)
    copy += check_name_patterns("param_or_buffer_names_no_ema", no_ema_names)
    ignore = check_name_patterns("ignore_names", ignore_names)
    ignore += prefix_patterns(check_name_patterns("ignore_startswith_names", ignore_prefixes))
    return tuple(dict.fromkeys(copy)), tuple(dict.fromkeys(ignore))
