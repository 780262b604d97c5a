"""The fused ops' Python entry points (lerp_, lerp_stochastic_, lerp_many_, bema_) and
build/CPU-path introspection; their fake kernels and metadata checks are in _ext/op_meta.py. The
checks that need every tensor run in C++ (csrc/lerp_plan.cpp), so a 20,000-tensor list costs no
Python loop."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from ._dist.dtensor import any_dtensor, shard_lists, shard_offset
from ._ext.loader import _C
from ._ext.op_meta import SUPPORTED_DTYPE_PAIRS as SUPPORTED_DTYPE_PAIRS  # public here
from ._version import __version__

Weight = float | torch.Tensor

# The prefixes of the ops' messages, as C++ writes them too.
_LERP_OP = "fused_ema.lerp_: "
_SR_OP = "fused_ema.lerp_stochastic_: "
_MANY_OP = "fused_ema.lerp_many_: "
_BEMA_OP = "fused_ema.bema_: "


def lerp_(
    ema_tensors: Sequence[torch.Tensor], src_tensors: Sequence[torch.Tensor], weight: Weight
) -> None:
    """In place, for every i: ``ema[i] += weight * (src[i] - ema[i])``, fused.

    One call updates any number of tensors: one parallel region on the CPU, one kernel launch
    per metadata batch and dtype pair on a GPU. A list may span devices and dtype pairs (see
    ``SUPPORTED_DTYPE_PAIRS``); each ``src[i]`` must be on the device of ``ema[i]`` and have its
    shape. ``weight`` is a float or a one-element float32/float64 tensor on the EMA's device (or
    the CPU), read by the kernel itself: no host sync, capturable in a CUDA graph. Results follow
    PyTorch's lerp formula in float (double for float64) and match ``torch._foreach_lerp_`` bit
    for bit on the CPU for same-dtype pairs. Bad input raises before anything is written.
    """
    src, ema = _aligned(_LERP_OP, ("src_tensors", src_tensors), ("ema_tensors", ema_tensors))
    # Numbers go to C++ as they are: it refuses a bool (and a non-finite weight) on every route.
    if isinstance(weight, torch.Tensor):
        op = torch.ops.fused_ema.lerp_.Tensor
    elif isinstance(weight, (float, int)):
        op = torch.ops.fused_ema.lerp_.default
        if isinstance(weight, int) and not isinstance(weight, bool):  # C++ refuses a bool
            weight = _float(weight, _LERP_OP, "weight")
    else:
        raise TypeError(f"{_LERP_OP}weight must be a float or a 0-dim tensor, got {_type(weight)}")
    (ema,), src, _ = _local(_LERP_OP, {"ema": ema}, src)
    try:
        op(ema, src, weight)
    except RuntimeError:
        _name_non_tensors(_LERP_OP, ema=ema, src=src)
        raise


_INT64_RANGE = 2**64
_INT64_MIN = -(2**63)


def lerp_stochastic_(
    ema_tensors: Sequence[torch.Tensor],
    src_tensors: Sequence[torch.Tensor],
    weight: Weight,
    *,
    seed: int,
    step: int | torch.Tensor,
    keys: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
) -> None:
    """``lerp_`` with bfloat16/float16 EMAs rounded stochastically, so that updates smaller than
    half a unit in the last place still move the EMA in expectation.

    Each result is PyTorch's lerp in float, rounded up or down at random with probability
    proportional to the distance (bfloat16: timm's scheme). float32/float64 EMAs in the lists get
    the plain ``lerp_``, so one call serves a whole model. The random bits of element ``e`` of
    tensor ``i`` depend only on ``(seed, step, keys[i], offsets[i] + e)`` (docs/ops.md), so
    results do not depend on threads, list order, devices or sharding: a shard passes the index
    of its first element in the full tensor as its offset (a DTensor sharded by rows, as FSDP2
    shards, adds its own shard's start). ``keys`` default to the list indices,
    ``offsets`` to 0. ``weight`` is a float or a one-element float32/float64 tensor, ``step`` an
    int or a one-element int64 tensor, each on the EMA's device or the CPU (read by the kernel:
    no host sync, capturable in a CUDA graph). Bad input raises before anything is written.
    """
    src, ema = _aligned(_SR_OP, ("src_tensors", src_tensors), ("ema_tensors", ema_tensors))
    if isinstance(weight, bool) or not isinstance(weight, (float, int, torch.Tensor)):
        raise TypeError(f"{_SR_OP}weight must be a float or a 0-dim tensor, got {_type(weight)}")
    if not isinstance(weight, torch.Tensor):
        weight = torch.tensor(_float(weight, _SR_OP, "weight"), dtype=torch.float64)
    step = _stochastic_step(step, _SR_OP)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{_SR_OP}seed must be an int, got {_type(seed)}")
    keys = list(range(len(ema))) if keys is None else _int_list(keys, _SR_OP, "keys")
    offsets = [0] * len(ema) if offsets is None else _int_list(offsets, _SR_OP, "offsets")
    (ema,), src, offsets = _local(_SR_OP, {"ema": ema}, src, offsets)
    try:
        torch.ops.fused_ema.lerp_stochastic_(
            ema, src, weight, step, _as_int64(seed, "seed"), keys, offsets
        )
    except RuntimeError:
        _name_non_tensors(_SR_OP, ema=ema, src=src)
        raise


def lerp_many_(
    emas: Sequence[Sequence[torch.Tensor]],
    src: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    *,
    seed: int | Sequence[int] | None = None,
    step: int | torch.Tensor | None = None,
    keys: Sequence[Sequence[int]] | None = None,
    offsets: Sequence[int] | None = None,
) -> None:
    """K EMAs of one model in one call: in place, for every track k and every i,
    ``emas[k][i] += weights[k] * (src[i] - emas[k][i])``, with each ``src[i]`` read once.

    ``emas`` holds K >= 1 tensor lists, each aligned with ``src`` as ``lerp_``'s ``ema_tensors``
    (any supported dtype pair, device, layout); ``weights`` holds one weight per track: K floats,
    or a 1-D float32/float64 tensor of K elements on the EMAs' device or the CPU (read by the
    kernel: no host sync, capturable in a CUDA graph). Track k ends bit for bit as
    ``lerp_(emas[k], src, weights[k])`` would leave it; a track whose weight is 0 is left as it
    is, untouched. EMAs of different tracks must not share memory, with each other or any src.

    With ``seed``, bfloat16/float16 EMAs are rounded stochastically: track k ends bit for bit as
    ``lerp_stochastic_(emas[k], src, weights[k], seed=seeds[k], step=step, keys=keys[k],
    offsets=offsets)``. ``seed`` is one int for every track or K ints, one per track; ``step`` an
    int or a one-element int64 tensor; ``keys`` K lists of N 32-bit ints, by default
    ``keys[k][i] = k * N + i`` (N = len(src)), so that every EMA tensor of every track has a
    random stream of its own under one seed (track 0's keys are ``lerp_stochastic_``'s default);
    ``offsets`` one list of N ints shared by the tracks (default 0; a DTensor adds its shard's
    start, as in ``lerp_stochastic_``). Bad input raises before anything is written.
    """
    if isinstance(emas, torch.Tensor):
        raise TypeError(f"{_MANY_OP}emas must be a sequence of K tensor lists, got {_type(emas)}")
    src, *tracks = _aligned(
        _MANY_OP, ("src", src), *((f"emas[{k}]", t) for k, t in enumerate(emas))
    )
    if not tracks:
        raise ValueError(f"{_MANY_OP}emas holds no track; pass K >= 1 lists of EMA tensors")
    weights = _weights(weights, len(tracks), _MANY_OP)
    if seed is None:
        if step is not None or keys is not None or offsets is not None:
            raise TypeError(f"{_MANY_OP}step, keys and offsets go with seed (stochastic rounding)")
    else:
        step = _stochastic_step(step, _MANY_OP)
        seeds = _track_seeds(seed, len(tracks))
        keys = _track_keys(keys, len(tracks), len(src))
        offsets = [0] * len(src) if offsets is None else _int_list(offsets, _MANY_OP, "offsets")
    tracks, src, offsets = _local(
        _MANY_OP, {f"emas[{k}]": t for k, t in enumerate(tracks)}, src, offsets
    )
    flat = [t for track in tracks for t in track]
    try:
        if seed is None:
            torch.ops.fused_ema.lerp_many_(flat, src, weights)
        else:
            torch.ops.fused_ema.lerp_many_stochastic_(
                flat, src, weights, step, seeds, keys, offsets
            )
    except RuntimeError:
        _name_non_tensors(_MANY_OP, src=src, **{f"emas[{k}]": t for k, t in enumerate(tracks)})
        raise


def _track_seeds(seed, count: int) -> list:
    """One int for every track, or one per track, as int64s."""
    seeds = [seed] * count if isinstance(seed, int) else seed
    if not isinstance(seeds, Sequence) or isinstance(seeds, str):
        raise TypeError(f"{_MANY_OP}seed must be an int or K ints, got {_type(seed)}")
    if len(seeds) != count:
        raise ValueError(f"{_MANY_OP}seed has {len(seeds)} entries but emas has {count} tracks")
    for k, s in enumerate(seeds):
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{_MANY_OP}seed[{k}] must be an int, got {_type(s)}")
    return [_as_int64(s, "seed", _MANY_OP) for s in seeds]


def _track_keys(keys, count: int, tensors: int) -> list:
    """K lists of N keys as one list, track after track (default: k * N + i)."""
    if keys is None:
        return list(range(count * tensors))
    if not hasattr(keys, "__len__"):
        raise TypeError(f"{_MANY_OP}keys must be K lists of N ints, got {_type(keys)}")
    if len(keys) != count:
        raise ValueError(f"{_MANY_OP}keys has {len(keys)} lists but emas has {count} tracks")
    flat = []
    for k, row in enumerate(keys):
        if not hasattr(row, "__len__"):
            raise TypeError(f"{_MANY_OP}keys[{k}] must be a list of N ints, got {_type(row)}")
        if len(row) != tensors:
            raise ValueError(f"{_MANY_OP}keys[{k}] has {len(row)} keys but src has {tensors}")
        flat += _int_list(row, _MANY_OP, f"keys[{k}]")
    return flat


def bema_(
    ema: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
) -> None:
    """BEMA (bias-corrected EMA, Block & Zhang 2025) of one model in one fused call, each
    ``src[i]`` read once. With ``weights = (beta, w0, alpha)``, in place, for every i:

    1. ``ema[i]`` becomes bit for bit what ``lerp_([ema[i]], [src[i]], beta)`` would write;
    2. ``theta0[i]`` what ``lerp_([theta0[i]], [src[i]], w0)`` would write (``w0 = 1`` copies
       ``src``: with ``beta = 1`` too, the reset of a BEMA);
    3. ``out[i] = ema[i] + alpha * (src[i] - theta0[i])`` from the new ``ema[i]`` and
       ``theta0[i]`` as stored, computed in float (double for float64 EMAs) as
       ``fma(alpha, src - theta0, ema)`` with ``src - theta0`` rounded once, then rounded once to
       the EMA dtype: the same bits on every device and CPU instruction set.

    A weight of 0 leaves its list untouched (``alpha = 0``: ``out`` is not written). ``ema[i]``,
    ``theta0[i]`` and ``out[i]`` share one dtype (the EMA's; ``(ema dtype, src dtype)`` one of
    ``SUPPORTED_DTYPE_PAIRS``), ``src[i]``'s shape and its device, and must not share memory with
    each other or with any src. ``weights`` is 3 floats, or a 1-D float32/float64 tensor of 3
    elements on the EMAs' device or the CPU (read by the kernel: no host sync, capturable in a
    CUDA graph). Bad input raises before anything is written.
    """
    src, *lists = _aligned(_BEMA_OP, ("src", src), ("ema", ema), ("theta0", theta0), ("out", out))
    weights = _weights(weights, 3, _BEMA_OP, ("beta", "w0", "alpha"))
    lists, src, _ = _local(_BEMA_OP, dict(zip(("ema", "theta0", "out"), lists)), src)
    try:
        torch.ops.fused_ema.bema_(*lists, src, weights)
    except RuntimeError:
        _name_non_tensors(_BEMA_OP, src=src, **dict(zip(("ema", "theta0", "out"), lists)))
        raise


def _weights(weights, count: int, op: str, names: tuple = ()) -> torch.Tensor:
    """lerp_many_'s weights, one per track, or bema_'s three (`names`): numbers as a float64
    tensor, a tensor as it is (C++ checks its dtype, shape, device and values)."""
    if isinstance(weights, torch.Tensor):
        if not names and weights.dim() == 1 and weights.numel() != count:
            raise ValueError(
                f"{op}weights has {weights.numel()} elements but emas has {count} tracks"
            )
        return weights
    floats = f"{count} floats ({', '.join(names)})" if names else "a list of K floats"
    if not isinstance(weights, (list, tuple)):
        raise TypeError(f"{op}weights must be {floats} or a 1-D tensor, got {_type(weights)}")
    if len(weights) != count:
        raise ValueError(
            f"{op}weights must be {floats}, got {len(weights)}"
            if names
            else f"{op}weights has {len(weights)} entries but emas has {count} tracks"
        )
    floats = []
    for k, w in enumerate(weights):
        name = f"weights[{k}]" + (f" ({names[k]})" if names else "")
        if isinstance(w, bool) or not isinstance(w, (float, int)):
            raise TypeError(f"{op}{name} must be a float, got {_type(w)}")
        floats.append(_float(w, op, name))
    return torch.tensor(floats, dtype=torch.float64)


def _stochastic_step(step, op: str) -> torch.Tensor:
    """lerp_stochastic_'s step: an int (as an int64 tensor) or a tensor as it is."""
    if isinstance(step, bool) or not isinstance(step, (int, torch.Tensor)):
        raise TypeError(f"{op}step must be an int or a 0-dim int64 tensor, got {_type(step)}")
    if not isinstance(step, torch.Tensor):
        step = torch.tensor(_as_int64(step, "step", op), dtype=torch.int64)
    return step


def _float(value: float | int, op: str, name: str) -> float:
    """A Python number as a float for C++ to check; an int too large even for a float64 cannot
    fit a float32 either (float() would raise an OverflowError naming nothing)."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{op}{name} must fit a float32, got {value}") from None


def _int_list(values, op: str, name: str) -> list:
    """Keys or offsets as a list of int64s, refusing by index what is not one: a bool, a float
    or a str (int() would truncate 1.5 and parse "3"), an int beyond 64 bits. A list of ints is
    checked by C loops (map, min, max) and passed as it is: a 20,000-tensor call costs no Python
    loop."""
    if isinstance(values, str) or not hasattr(values, "__iter__"):
        raise TypeError(f"{op}{name} must be a sequence of ints, got {_type(values)}")
    values = values if isinstance(values, list) else list(values)
    if set(map(type, values)) <= {int} and (
        not values or (min(values) >= _INT64_MIN and max(values) < -_INT64_MIN)
    ):
        return values
    ints = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not hasattr(type(v), "__index__"):
            raise TypeError(f"{op}{name}[{i}] must be an int, got {_type(v)}")
        ints.append(operator.index(v))
        if not _INT64_MIN <= ints[-1] < -_INT64_MIN:
            raise ValueError(f"{op}{name}[{i}] is {ints[-1]}; it must fit an int64")
    return ints


def _as_int64(value: int, name: str, op: str = _SR_OP) -> int:
    """A 64-bit value given as a signed or unsigned int, as the int64 with the same bits."""
    if not _INT64_MIN <= value < _INT64_RANGE:
        raise ValueError(f"{op}{name} must fit in 64 bits, got {value}")
    return value - _INT64_RANGE if value > -_INT64_MIN - 1 else value


def _type(value) -> str:
    return type(value).__name__


def storage_shortfall(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes held, bytes needed) where `t`'s storage no longer holds every element it addresses
    (freed by untyped_storage().resize_(0), as FSDP frees parameters, or shrunk); None where it
    does or has no storage to check. The ops' C++ planner refuses the same (check_storage)."""
    if t.numel() == 0 or t.is_meta:  # a meta tensor has no memory to read
        return None
    try:
        held = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a subclass without a storage of its own
        return None
    reach = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    needed = (t.storage_offset() + reach + 1) * t.element_size()
    return (held, needed) if held < needed else None


def freed_tensors(named) -> list[str]:
    """Of (name, tensor) pairs, each plain tensor whose storage no longer holds its elements
    (storage_shortfall), named with what its storage holds."""
    found = []
    for name, t in named:
        short = storage_shortfall(t) if type(t) in (torch.Tensor, torch.nn.Parameter) else None
        if short is not None:
            found.append(
                f"{name} has no memory for its elements (its storage holds {short[0]} of the "
                f"{short[1]} bytes they need: freed, e.g. by untyped_storage().resize_(0)?)"
            )
    return found


def refuse_freed(named, whose: str) -> None:
    """A ValueError naming every freed tensor of `named` (freed_tensors), before anything reads
    it: torch's own ops would read the freed memory."""
    found = freed_tensors(named)
    if found:
        raise ValueError(f"fused_ema: {whose} {', '.join(found)}; nothing was changed")


def _aligned(op: str, *named: tuple) -> list[list[torch.Tensor]]:
    """The tensor sequences given as (argument name, sequence), src first, as lists, each as
    long as src."""
    lists = []
    for name, tensors in named:
        if isinstance(tensors, torch.Tensor):
            raise TypeError(f"{op}{name} must be a sequence of tensors, not a tensor")
        lists.append(tensors if isinstance(tensors, list) else list(tensors))
        if len(lists[-1]) != len(lists[0]):
            what = name.removesuffix("_tensors")
            raise ValueError(f"{op}{what} has {len(lists[-1])} tensors but src has {len(lists[0])}")
    return lists


def _name_non_tensors(op: str, **lists) -> None:
    """After an op refused its arguments: a list item that is no tensor (the schema's own error
    names neither the list nor the index) raises a TypeError naming both. Only on that path, so
    a call that succeeds pays nothing for it."""
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}{name}[{i}] must be a tensor, got {_type(t)}") from None


def _local(op: str, named: dict, src: list, offsets: list | None = None) -> tuple:
    """(lists, src, offsets): the lists of `named` (by their names in op's errors) and src with
    DTensors as their local shards (lerp is elementwise: each rank updating its own shard is the
    whole update), `offsets` (one per src tensor, unless its length is wrong: C++ reports that)
    moved on by the index of each shard's first element in its full tensor (the first list's).
    Plain tensors' lists come back as they are."""
    lists = list(named.values())
    if not (any_dtensor(src) or any(any_dtensor(tensors) for tensors in lists)):
        return lists, src, offsets
    first = next(iter(named))
    if offsets is not None and len(offsets) == len(src):
        offsets = [
            o + shard_offset(e, f"{op}{first}[{i}]")
            for i, (o, e) in enumerate(zip(offsets, lists[0]))
        ]
    shards = [shard_lists(tensors, src, op, name) for name, tensors in named.items()]
    return [tensors for tensors, _ in shards], shards[0][1], offsets


def build_info() -> dict:
    """What this installation compiled and runs: versions, kernels, CPU paths, CUDA archs."""
    kernels = _C.devices_with_kernels()
    return {
        "version": __version__,
        "torch_version": torch.__version__,
        "torch_version_built": _C.TORCH_VERSION_BUILT,
        "cpu_kernel": "cpu" in kernels,
        "cpu_isas_compiled": list(_C.COMPILED_CPU_ISAS),
        "cpu_isas_available": list(_C.available_cpu_isas()),
        "cpu_isa": _C.cpu_isa(),
        "cuda_kernel": "cuda" in kernels,
        "cuda_archs": list(_C.CUDA_ARCHS),
        "cuda_version_built": _C.CUDA_VERSION_BUILT,
        "cuda_available": torch.cuda.is_available(),
    }


def cpu_isa() -> str:
    """The CPU instruction set the kernels use now: "avx512", "avx2" or "default"."""
    return _C.cpu_isa()


def set_cpu_isa(isa: str) -> str:
    """Selects the CPU instruction set for later calls and returns the previous one.

    The initial choice is the best this CPU and build support, or ``FUSED_EMA_CPU_ISA``. Every
    path gives bit-identical results; this exists to check that, and to compare their speed.
    """
    previous = _C.cpu_isa()
    _C.set_cpu_isa(isa)
    return previous
