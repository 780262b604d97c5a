"""Files: a checkpoint path read onto the CPU (torch.load weights-only, safetensors, a
save_pretrained folder, whole or sharded), and atomic_write, the crash-safe write of every file
fused_ema writes (snapshots, the posthoc command's output, ema.pt)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path

import torch

from .errors import CheckpointError

PRETRAINED = "fused_ema: save_pretrained folder"  # read_source's wrapping of a folder
# The weights of a save_pretrained folder (diffusers, transformers), preferred first.
_WEIGHT_FILES = (
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.bin",
    "pytorch_model.bin",
)


def read_source(state, source: str) -> tuple[object, str]:
    """A load_state_dict argument: a checkpoint as it is, or a path: a file read onto the CPU (the
    EMA maps tensors to its own devices later), a directory as a save_pretrained folder (diffusers
    EMAModel.save_pretrained); with the name of where it came from, for errors. A file that
    cannot be read is a CheckpointError."""
    if not isinstance(state, (str, os.PathLike)):
        return state, source
    path = os.fspath(state)
    source = f"checkpoint file {path!r}"
    try:
        if os.path.isdir(path):
            return {PRETRAINED: read_pretrained_folder(path)}, source
        return _read_weights(path), source
    except Exception as err:
        raise CheckpointError([f"could not read it: {type(err).__name__}: {err}"], source) from err


def _read_weights(path: str) -> dict:
    """A safetensors file, or torch.load (weights only) of any other."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    # timm's training checkpoints hold its argparse.Namespace of arguments (as timm's own loader
    # allows): a plain attribute bag, no code.
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def read_pretrained_folder(path) -> dict:
    """config.json (where diffusers keeps the EMA's optimization_step) and the weights of a
    save_pretrained folder, whole or sharded (an *.index.json naming the shards)."""
    files = sorted(os.listdir(path))
    config = {}
    if "config.json" in files:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("config.json does not hold a JSON object")
    for name in _WEIGHT_FILES:
        if f"{name}.index.json" in files:
            with open(os.path.join(path, f"{name}.index.json")) as f:
                index = json.load(f)
            files_of = index.get("weight_map") if isinstance(index, dict) else None
            shards = list(files_of.values()) if isinstance(files_of, dict) else []
            if not shards or not all(
                isinstance(s, str) and os.path.basename(s) == s for s in shards
            ):
                raise ValueError(
                    f"{name}.index.json: its 'weight_map' should map names to shard files of the "
                    f"folder, got {files_of!r:.200}"
                )
            shards = sorted(set(shards))
        elif name in files:
            shards = [name]
        else:
            continue
        parts = [_read_weights(os.path.join(path, shard)) for shard in shards]
        return {"config": config, "weights": {k: v for part in parts for k, v in part.items()}}
    raise FileNotFoundError(
        f"no weights in the folder: expected one of {', '.join(_WEIGHT_FILES)} (or its "
        f"sharded .index.json), found {', '.join(files) or 'nothing'}"
    )


def atomic_write(path, write) -> None:
    """`write(temporary)` to a temporary file beside `path` (".{name}.tmp-..."), fsync'd, then
    os.replace'd onto `path` and the folder fsync'd: `path` is either absent, its old self, or
    complete. On an exception the temporary file is removed."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(str(temporary))
        _fsync(temporary, os.O_RDWR)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # (Windows cannot open a folder to sync it)
        _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
