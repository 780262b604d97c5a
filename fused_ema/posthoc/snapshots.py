"""The post-hoc EMA snapshot format (file names, tensors, metadata: docs/posthoc.md), shared by the
writer (PostHocEma) and the readers: one safetensors file per (snapshot index, tracked EMA). A
damaged file under a snapshot's name is an error naming it, never skipped: the crash-safe writer
leaves none, and leaving it out would change every synthesis silently."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import atomic_write
from .profiles import gamma_to_sigma_rel

FORMAT = "fused_ema.posthoc/1"
NAME = re.compile(r"^(\d{6,})-ema(\d+)\.safetensors$")
TEMPORARY = re.compile(r"^\.\d{6,}-ema\d+\.safetensors\.tmp-")  # see write_snapshot
KEYS = ("format", "step", "gamma", "sigma_rel", "index", "ema_index", "names", "dtypes")


class SnapshotError(ValueError):
    """A post-hoc EMA snapshot (or a folder of them) that cannot be read or used; names the file."""


@dataclass(frozen=True, order=True)
class SnapshotInfo:
    """One snapshot, from its header: the EMA of index `ema_index` after `step` updates."""

    index: int
    ema_index: int
    step: int
    gamma: float
    sigma_rel: float
    path: Path
    source: str = "fused_ema"  # or "ema-pytorch" (migrate.py): who reads its tensors


@dataclass
class SnapshotContents:
    """An open snapshot: its names in order, the EMA's own dtype and the shape of each, the names
    it averages (the others are copied), and get, which reads one tensor (as stored)."""

    names: list[str]
    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, ...]]
    averaged: frozenset[str]
    get: Callable[[str], torch.Tensor]


def snapshot_path(snapshot_dir, index: int, ema_index: int) -> Path:
    return Path(snapshot_dir) / f"{index:06d}-ema{ema_index}.safetensors"


def snapshot_metadata(
    *,
    index: int,
    ema_index: int,
    step: int,
    gamma: float,
    names: Sequence[str],
    dtypes: Mapping[str, torch.dtype | str],
    sigma_rel: float | None = None,
    copied: Sequence[str] = (),
) -> dict[str, str]:
    """The metadata of a snapshot: `names` in order, `dtypes` the EMA's own (not the snapshot's),
    `copied` the floating-point names the EMA copies from the model instead of averaging;
    sigma_rel defaults to gamma_to_sigma_rel(gamma)."""
    copied = frozenset(copied)
    return {
        "format": FORMAT,
        "step": str(step),
        "gamma": repr(float(gamma)),
        "sigma_rel": repr(gamma_to_sigma_rel(gamma) if sigma_rel is None else float(sigma_rel)),
        "index": str(index),
        "ema_index": str(ema_index),
        "names": json.dumps(list(names)),
        "dtypes": json.dumps({n: str(dtypes[n]).removeprefix("torch.") for n in names}),
        "copied": json.dumps([n for n in names if n in copied]),
    }


def snapshot_tensors(
    state: Mapping[str, torch.Tensor], snapshot_dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The tensors to store: CPU copies, floating-point ones in snapshot_dtype (None: their own)."""
    return {
        name: t.detach().to(
            "cpu",
            dtype=snapshot_dtype if snapshot_dtype is not None and t.is_floating_point() else None,
            copy=True,
            memory_format=torch.contiguous_format,
        )
        for name, t in state.items()
    }


def save_snapshot(
    snapshot_dir,
    state: Mapping[str, torch.Tensor],
    *,
    index: int,
    ema_index: int,
    step: int,
    gamma: float,
    snapshot_dtype: torch.dtype | None = torch.float16,
    copied: Sequence[str] = (),
) -> Path:
    """Writes the snapshot of one tracked EMA (`state`: its tensors by name, in its own dtypes;
    `copied`: the floating-point ones it copies rather than averages) crash-safely to
    snapshot_path(snapshot_dir, index, ema_index) and returns that path."""
    path = snapshot_path(snapshot_dir, index, ema_index)
    metadata = snapshot_metadata(
        index=index,
        ema_index=ema_index,
        step=step,
        gamma=gamma,
        names=list(state),
        dtypes={name: t.dtype for name, t in state.items()},
        copied=copied,
    )
    write_snapshot(path, snapshot_tensors(state, snapshot_dtype), metadata)
    return path


def atomic_save(path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """safetensors.torch.save_file of `tensors` and `metadata` to `path`, crash-safely
    (checkpoint.atomic_write: the temporary file is a dot name that no reader lists)."""
    from safetensors.torch import save_file

    atomic_write(
        path, lambda temporary: save_file(dict(tensors), temporary, metadata=dict(metadata))
    )


def write_snapshot(path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Writes one snapshot file crash-safely (atomic_save). `metadata` is checked first as a
    reader checks it (snapshot_metadata builds it): against the file's name and `tensors`."""
    path = Path(path)
    parse_metadata(path, dict(metadata), list(tensors))
    atomic_save(path, tensors, metadata)


def clean_temporary_files(snapshot_dir) -> list[Path]:
    """Removes the temporary files that writers killed mid-write left in snapshot_dir, and returns
    them. For a writer starting up: a writer still running in that folder would lose its file."""
    removed = []
    for entry in os.scandir(snapshot_dir):
        if TEMPORARY.match(entry.name) and entry.is_file():
            Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
    return sorted(removed)


def _whole(path: Path, key: str, text: str, minimum: int) -> int:
    if not re.fullmatch(r"\d+", text) or int(text) < minimum:
        raise SnapshotError(
            f"{path}: metadata {key!r} should be an integer >= {minimum}, got {text!r}"
        )
    return int(text)


def parse_metadata(
    path: Path, metadata: dict | None, keys: list[str]
) -> tuple[SnapshotInfo, list[str], dict[str, torch.dtype], frozenset[str]]:
    """(SnapshotInfo, names, the EMA's dtypes by name, the names averaged) from a snapshot's
    metadata, checked against its file name and the tensor names `keys` in the file;
    SnapshotError naming `path` if wrong."""
    match = NAME.match(path.name)
    if not match:
        raise SnapshotError(f"{path}: not a snapshot name (expected NNNNNN-emaK.safetensors)")
    metadata = metadata or {}
    if metadata.get("format") != FORMAT:
        raise SnapshotError(
            f"{path}: not a fused_ema post-hoc EMA snapshot (metadata format is "
            f"{metadata.get('format')!r}, expected {FORMAT!r})"
        )
    missing = [key for key in KEYS if not isinstance(metadata.get(key), str)]
    if missing:
        raise SnapshotError(f"{path}: metadata lacks {', '.join(missing)}")
    index = _whole(path, "index", metadata["index"], 0)
    ema_index = _whole(path, "ema_index", metadata["ema_index"], 0)
    if (index, ema_index) != (int(match[1]), int(match[2])):
        raise SnapshotError(
            f"{path}: its metadata says snapshot {index} of EMA {ema_index}, its name otherwise"
        )
    step = _whole(path, "step", metadata["step"], 1)
    try:
        gamma, sigma_rel = float(metadata["gamma"]), float(metadata["sigma_rel"])
        names, dtypes = json.loads(metadata["names"]), json.loads(metadata["dtypes"])
        dtypes = {name: getattr(torch, dtypes[name]) for name in names}
        if not all(isinstance(d, torch.dtype) for d in dtypes.values()):
            raise TypeError("not a torch dtype")
        copied = set(json.loads(metadata.get("copied", "[]")))
        if not copied <= set(names):
            raise ValueError("copied names that are not among its names")
        expected = gamma_to_sigma_rel(gamma)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise SnapshotError(
            f"{path}: unreadable metadata (gamma, sigma_rel, names, dtypes, copied): {err}"
        ) from None
    if abs(sigma_rel - expected) > 1e-9 * expected:
        raise SnapshotError(f"{path}: sigma_rel {sigma_rel!r} is not that of gamma {gamma!r}")
    if sorted(names) != sorted(keys) or len(set(names)) != len(names):
        raise SnapshotError(
            f"{path}: its tensors ({len(keys)}) are not the names its metadata lists ({len(names)})"
        )
    info = SnapshotInfo(index, ema_index, step, gamma, sigma_rel, path)
    averaged = frozenset(n for n in names if dtypes[n].is_floating_point and n not in copied)
    return info, names, dtypes, averaged


def _read_header(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise SnapshotError(f"{path}: not a readable safetensors file ({err})") from None
    return handle


def list_snapshots(snapshot_dir) -> list[SnapshotInfo]:
    """The snapshots in snapshot_dir, sorted by (index, ema_index), read from their headers only.
    Other files (temporary files of writers, anything else) are ignored; a file with a snapshot's
    name that is not a valid snapshot raises SnapshotError naming it."""
    snapshot_dir = Path(snapshot_dir)
    if not snapshot_dir.is_dir():
        raise FileNotFoundError(f"no snapshot folder {snapshot_dir}")
    found = []
    for path in sorted(
        snapshot_dir / e.name for e in os.scandir(snapshot_dir) if NAME.match(e.name)
    ):
        with _read_header(path) as handle:
            found.append(parse_metadata(path, handle.metadata(), list(handle.keys()))[0])
    return sorted(found)


def next_index(snapshot_dir) -> int:
    """The index the next snapshot of a run writing to snapshot_dir takes: one past the highest
    snapshot file name there (0 for none or no folder). Reads file names only."""
    try:
        found = [int(m[1]) for e in os.scandir(snapshot_dir) if (m := NAME.match(e.name))]
    except FileNotFoundError:
        return 0
    return max(found, default=-1) + 1


@contextmanager
def open_snapshot(info: SnapshotInfo) -> Iterator[SnapshotContents]:
    """The contents of a fused_ema snapshot, open while the context lasts (tensors read lazily)."""
    with _read_header(info.path) as handle:
        _, names, dtypes, averaged = parse_metadata(
            info.path, handle.metadata(), list(handle.keys())
        )
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
        yield SnapshotContents(names, dtypes, shapes, averaged, handle.get_tensor)
