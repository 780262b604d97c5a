"""Which tensors of a model an EMA follows and under which names: parameters (a tied parameter
once, with all its names) and persistent buffers, found the way ``named_parameters``/``state_dict``
do; DDP, DataParallel and torch.compile wrappers unwrapped, FSDP1 / activation-checkpoint name
components dropped."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .._ext.loader import _C

PARAM = "param"
BUFFER = "buffer"

# Name components that wrappers insert between a module and its children.
_WRAPPER_COMPONENT = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")
# Prefixes a whole checkpoint may carry: DDP/DataParallel (module.), torch.compile (_orig_mod.).
_CHECKPOINT_PREFIXES = ("module.", "_orig_mod.")
_PARALLEL_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / DeepSpeed engine / torch.compile wrappers (any
    nesting)."""
    if not isinstance(model, nn.Module):  # else an AttributeError on its __dict__, naming nothing
        raise TypeError(f"fused_ema: the model must be an nn.Module, got {type(model).__name__}")
    while True:
        if isinstance(model, _PARALLEL_WRAPPERS) or _is_deepspeed_engine(model):
            model = model.module
        elif (inner := _orig_mod(model)) is not None:
            model = inner
        else:
            return model


def _is_deepspeed_engine(model: nn.Module) -> bool:
    """deepspeed.initialize's engine (also what accelerate's prepare returns under DeepSpeed),
    which holds the model as .module; told by its class's module so that deepspeed is not
    imported."""
    return type(model).__module__.startswith("deepspeed.") and isinstance(
        model.__dict__.get("_modules", {}).get("module"), nn.Module
    )


def _orig_mod(model: nn.Module) -> nn.Module | None:
    """model._orig_mod (torch.compile's wrapper keeps the model there) if getattr finds a module
    there, else None; for a plain module without raising and catching the AttributeError of
    nn.Module.__getattr__: that cost a few microseconds per update."""
    kind, attributes = type(model), model.__dict__
    if kind.__getattr__ is not nn.Module.__getattr__ or hasattr(kind, "_orig_mod"):
        inner = getattr(model, "_orig_mod", None)
    elif "_orig_mod" in attributes:
        inner = attributes["_orig_mod"]
    else:
        # nn.Module.__getattr__ looks in _parameters and _buffers before _modules, but nn.Module
        # refuses a parameter or buffer under a submodule's name (and the reverse).
        inner = (attributes.get("_modules") or {}).get("_orig_mod")
    return inner if isinstance(inner, nn.Module) else None


def clean_name(name: str) -> str:
    return _WRAPPER_COMPONENT.sub(r"\1", name)


def checkpoint_prefix_levels(names) -> list[dict[str, str]]:
    """Each checkpoint key's name as written, then with one more wrapper prefix that every key
    carries removed at each level (DDP over torch.compile: `module._orig_mod.`): a model whose
    own child is called `module` keeps that component, so the caller picks the level."""
    mapping = {name: clean_name(name) for name in names}
    levels = [mapping]
    while mapping:
        prefix = next(
            (p for p in _CHECKPOINT_PREFIXES if all(n.startswith(p) for n in mapping.values())),
            None,
        )
        if prefix is None:
            break
        mapping = {key: stripped[len(prefix) :] for key, stripped in mapping.items()}
        levels.append(mapping)
    return levels


@dataclass
class Tracked:
    """One distinct tensor of the model: its names (tied weights have several) and kind."""

    names: list[str]
    kind: str
    tensor: torch.Tensor = field(repr=False)

    @property
    def name(self) -> str:
        return self.names[0]


def named_tensors(model: nn.Module, with_buffers: bool = True) -> list[Tracked]:
    """Every distinct parameter, then every distinct persistent buffer, by first name: the walk
    (_C.named_walk, the one definition of which tensors a model has, under which names and in
    which order) with ties gathered under the first name. A module registered under several
    names (nn.ModuleList([block] * 4)) gives its tensors every name state_dict() gives them."""
    by_id: dict[int, Tracked] = {}
    params: list[Tracked] = []
    buffers: list[Tracked] = []
    for name, tensor, is_param in _C.named_walk(model, with_buffers, True):
        if tensor is None:
            continue
        full = clean_name(name)
        if id(tensor) in by_id:
            by_id[id(tensor)].names.append(full)
            continue
        entry = Tracked([full], PARAM if is_param else BUFFER, tensor)
        by_id[id(tensor)] = entry
        (params if is_param else buffers).append(entry)
    return params + buffers


def tensor_walk(model: nn.Module, with_buffers: bool = True) -> list:
    """_C.tensor_walk's list written in Python, for torch.compile to trace (a compiled program
    cannot call into the extension to read the model): the values a compiled update averages
    toward. The op it feeds checks them against the C walk of the live model, and
    tests/test_walk.py holds the two equal on random module trees."""
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


def walk_agrees(values: list, walk: list) -> bool:
    """Whether a compiled program's values line up with the walk: None where it holds None, else a
    tensor of the item's dtype, layout, device and shape (a program passes plain tensors where the
    model holds parameters, so the type is left out)."""
    return len(values) == len(walk) and all(
        v is t is None
        or (v is not None and t is not None)
        and (v.dtype, v.layout, v.device, v.shape) == (t.dtype, t.layout, t.device, t.shape)
        for v, t in zip(values, walk)
    )
