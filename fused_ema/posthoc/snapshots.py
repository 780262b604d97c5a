"""The post-hoc EMA snapshot files (names, tensors, metadata: docs/posthoc.md), one safetensors file
per (snapshot index, tracked EMA): their readers, and PostHocEma's writer (Snapshots). A damaged
file under a snapshot's name is an error naming it, never skipped: the crash-safe writer leaves
none, and leaving it out would change every synthesis silently."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .._ext.worker import SNAPSHOTS, Dropped, Job
from .._files import atomic_write
from .profiles import gamma_to_sigma_rel

FORMAT = "fused_ema.posthoc/1"
NAME = re.compile(r"^(\d{6,})-ema(\d+)\.safetensors$")
EMA_PYTORCH_NAME = re.compile(r"^(\d+)\.(\d+)\.pt$")  # its PostHocEMA's files (migrate.py)
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
    return {name: _host_copy(t, snapshot_dtype) for name, t in state.items()}


def _host_copy(t: torch.Tensor, dtype: torch.dtype | None, non_blocking: bool = False):
    """A contiguous CPU copy of t, in dtype if floating-point (None: its own); from CUDA with
    non_blocking, into pinned memory in stream order (torch's to() pins it)."""
    dtype = dtype if dtype is not None and t.is_floating_point() else None
    return t.detach().to("cpu", dtype, non_blocking, True, memory_format=torch.contiguous_format)


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


def write_snapshot(path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Writes one snapshot file crash-safely (checkpoint.atomic_write: the temporary file is a dot
    name that no reader lists). `metadata` is checked first as a reader checks it
    (snapshot_metadata builds it): against the file's name and `tensors`."""
    from safetensors.torch import save_file

    path = Path(path)
    _, _, dtypes, _ = parse_metadata(path, dict(metadata), list(tensors))
    _check_kinds(path, dtypes, {n: t.is_floating_point() for n, t in tensors.items()})
    atomic_write(path, lambda tmp: save_file(dict(tensors), tmp, metadata=dict(metadata)))


def clean_temporary_files(snapshot_dir) -> list[Path]:
    """Removes the temporary files that writers killed mid-write left in snapshot_dir, and returns
    them. For a writer starting up: a writer still running in that folder would lose its file."""
    found = os.scandir(snapshot_dir)
    removed = sorted(Path(e.path) for e in found if TEMPORARY.match(e.name) and e.is_file())
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


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


@contextmanager
def _read(path: Path):
    """A snapshot's open safetensors handle and parse_metadata of it, while the context lasts."""
    from safetensors import SafetensorError, safe_open

    try:
        opened = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise SnapshotError(f"{path}: not a readable safetensors file ({err})") from None
    with opened as handle:
        yield handle, parse_metadata(path, handle.metadata(), list(handle.keys()))


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
        with _read(path) as (_, parsed):
            found.append(parsed[0])
    return sorted(found)


def _step_of(path: Path) -> int | None:
    """The update count of the snapshot at `path`; None where it is missing or unreadable."""
    try:
        with _read(path) as (_, parsed):
            return parsed[0].step
    except (FileNotFoundError, SnapshotError):
        return None


def next_index(snapshot_dir) -> int:
    """The index the next snapshot of a run writing to snapshot_dir takes: one past the highest
    snapshot file name there (0 for none or no folder). Reads file names only."""
    try:
        found = [int(m[1]) for e in os.scandir(snapshot_dir) if (m := NAME.match(e.name))]
    except FileNotFoundError:
        return 0
    return max(found, default=-1) + 1


def _check_kinds(path: Path, dtypes: Mapping[str, torch.dtype], stored: Mapping[str, bool]) -> None:
    """Only floating-point tensors are stored in the snapshot dtype: one stored floating-point
    whose EMA's dtype is not (or the reverse) is damaged (it would be cast or averaged)."""
    wrong = sorted(n for n, floating in stored.items() if floating != dtypes[n].is_floating_point)
    if wrong:
        raise SnapshotError(
            f"{path}: stored tensors whose kind (floating-point or not) is not that of the EMA's "
            f"dtype its metadata gives: {', '.join(wrong[:5])}"
        )


@contextmanager
def open_snapshot(info: SnapshotInfo) -> Iterator[SnapshotContents]:
    """The contents of a fused_ema snapshot, open while the context lasts (tensors read lazily)."""
    with _read(info.path) as (handle, (_, names, dtypes, averaged)):
        slices = {name: handle.get_slice(name) for name in names}
        stored = {name: t.get_dtype().startswith(("F", "BF")) for name, t in slices.items()}
        _check_kinds(info.path, dtypes, stored)
        shapes = {name: tuple(t.get_shape()) for name, t in slices.items()}
        yield SnapshotContents(names, dtypes, shapes, averaged, handle.get_tensor)


class Snapshots:
    """When PostHocEma snapshots its EMAs, where to, and how: the folder checks (a fresh run never
    overwrites another's snapshots; a resumed one continues its numbering), then each snapshot
    staged into host tensors of the snapshot dtype and written by the snapshot worker. An update
    waits only for the staging; a worker's error is raised by the next call."""

    def __init__(self, folder, every: int, dtype: torch.dtype | None):
        self.folder = None if folder is None else Path(folder)
        self.every = every
        self.dtype = dtype
        self.next_index = 0  # the index of the next snapshot
        self.last_step: int | None = 0  # of the last snapshot taken (0: none; None: not known)
        self.resumed = False  # restored from a checkpoint: may replace later snapshots
        self.checked = False  # the folder has been checked for another run's snapshots
        self._staging: Job | None = None  # the last snapshot's staging: wait_staged() waits
        self._not_staged = None  # (index, last_step) to go back to: its update failed
        self._written: list[Job] = []

    def due(self, t: int | None) -> bool:
        """Whether the update count `t` (None: not known yet) takes a snapshot."""
        return self.folder is not None and t is not None and t > 0 and t % self.every == 0

    def check_folder(self) -> None:
        """A fresh PostHocEma never overwrites another run's snapshots (checked by the rank that
        writes them: the others may already see its files)."""
        if self.checked or not writing_rank():
            return
        # Another PostHocEma's queued snapshots on disk first: counted, their temporary files not
        # removed mid-write.
        SNAPSHOTS.drain()
        self.folder.mkdir(parents=True, exist_ok=True)
        clean_temporary_files(self.folder)  # left by a writer killed mid-write
        found = next_index(self.folder)
        if found > self.next_index and not self.resumed:
            raise RuntimeError(
                f"fused_ema.PostHocEma: {str(self.folder)!r} already holds {found} snapshots "
                "of another run; pass an empty snapshot_dir, or load this run's checkpoint "
                "(load_state_dict) to continue its numbering"
            )
        if any(EMA_PYTORCH_NAME.match(e.name) for e in os.scandir(self.folder)):
            raise RuntimeError(
                f"fused_ema.PostHocEma: {str(self.folder)!r} holds ema-pytorch PostHocEMA "
                "checkpoints, which synthesis could no longer read beside this run's snapshots; "
                "pass another snapshot_dir"
            )
        if self.resumed and self.last_step is None and self.next_index:
            self.last_step = _step_of(snapshot_path(self.folder, self.next_index - 1, 0))
        self.checked = True

    def take(self, tracks, gammas, t: int) -> None:
        """Snapshot `next_index` of every track at update count `t` (the folder checked first),
        its tensors staged first: CUDA ones copied now into pinned memory in stream order, CPU
        ones on the worker once the leader's non_blocking update still writing them is done.
        Two jobs of the snapshot worker, in order: the staging, then the files."""
        self.check_folder()
        wait_for = tracks[0]._updater.runner.job()
        index = self.next_index  # moved on only once the snapshot is taken
        files, events = [], []
        for k, track in enumerate(tracks):
            entries, tensors = track._binding.table.entries, None
            if track._binding.policy.shard is not None:  # gathered on rank 0 (a collective)
                tensors = track.full_state_dict(rank=0, cpu_offload=False) or None
            elif writing_rank():
                tensors = {name: e.ema.detach() for e in entries for name in e.names}
            if tensors is None:
                continue  # another rank writes
            copied = [
                n for e in entries if not e.average for n in e.names if e.ema.is_floating_point()
            ]
            metadata = snapshot_metadata(
                step=t,
                gamma=gammas[k],
                index=index,
                ema_index=k,
                names=list(tensors),
                dtypes={n: v.dtype for n, v in tensors.items()},
                copied=copied,
            )
            pinned, on_cpu = {}, {}  # the CPU tensors are staged on the worker
            for name, tensor in tensors.items():
                if tensor.device.type != "cuda":
                    on_cpu[name] = tensor
                    continue
                pinned[name] = _host_copy(tensor, self.dtype, non_blocking=True)
                events.append(torch.cuda.Event())
                events[-1].record(torch.cuda.current_stream(tensor.device))
            files.append((snapshot_path(self.folder, index, k), pinned, on_cpu, metadata))
        if not files:
            self.next_index, self.last_step = index + 1, t
            return
        # (no raise_failure here: an update that took this snapshot has already changed the EMAs,
        # and an earlier write's failure would lose this snapshot; the next call raises it)
        self.wait_staged()
        host: list = []
        before = (index, self.last_step)

        def stage() -> None:
            # On the worker: the CPU tensors copied out of the EMA into `host`, unless the update
            # they come from failed (it wrote nothing, its error reaches the caller, and the
            # update count it would have reached takes this snapshot when reached again).
            if wait_for is None or wait_for.wait() is None:
                for path, pinned, on_cpu, metadata in files:
                    host.append(
                        (path, {**pinned, **snapshot_tensors(on_cpu, self.dtype)}, metadata)
                    )
            else:
                self._not_staged = before

        def write() -> None:
            if staging.wait() is not None:  # (run before it, unless a second thread took it)
                if isinstance(staging.error, Dropped):
                    return  # the call that took the snapshot was interrupted: nothing to write
                raise staging.error
            for event in events:
                event.synchronize()
            done: list[Path] = []
            for path, tensors, metadata in host:
                try:
                    write_snapshot(path, tensors, metadata)
                    done.append(path)
                except Exception as err:  # named: the writer's own message names a temporary
                    for written in done:  # a snapshot is all its EMAs' files or none
                        written.unlink(missing_ok=True)
                    raise OSError(
                        f"{path} (update count {t}): {type(err).__name__}: {err}"
                    ) from err

        staging, writing = Job(stage), Job(write)
        try:
            self._staging = staging
            self._written.append(writing)
            SNAPSHOTS.put(staging)
            SNAPSHOTS.put(writing)
            self.next_index, self.last_step = index + 1, t  # (not where interrupted)
        except BaseException:
            # Interrupted: what the worker has not begun is taken back (a dropped staging makes
            # its write a no-op), so no staging is left that nobody will run; a write it has
            # begun makes this snapshot taken.
            for job in (staging, writing):
                if job.claim():
                    job.drop("the call that took this snapshot was interrupted")
                elif job is writing:
                    self.next_index, self.last_step = index + 1, t
            if self.last_step != t:  # the interrupt tells the caller: no later failure to raise
                self._written = [j for j in self._written if j is not writing]
            raise

    def wait_staged(self) -> None:
        """Before the EMA changes: the last snapshot's tensors have been copied out of it."""
        if self._staging is not None:
            self._staging.wait()
        if getattr(self, "_not_staged", None) is not None:  # (absent in older pickles)
            self.next_index, self.last_step = self._not_staged
            self._not_staged = None

    def flush(self) -> None:
        """Waits until every snapshot taken is on disk; raises the first failure."""
        for job in self._written:
            job.wait()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raises the error of a snapshot that could not be written (once), dropping those done."""
        done = [j for j in self._written if j.done()]
        self._written = [j for j in self._written if j not in done]  # (one may finish meanwhile)
        for job in done:
            if job.error is not None:
                raise RuntimeError(
                    f"fused_ema: a PostHocEma snapshot was not written: {job.error}"
                ) from job.error

    def __getstate__(self) -> dict:  # (a copy: the snapshots taken so far on disk first)
        self.flush()
        return {**self.__dict__, "checked": False, "_staging": None, "_written": []}


def writing_rank() -> bool:
    """Under torch.distributed, rank 0 writes the snapshots (every rank holds the same EMAs)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
