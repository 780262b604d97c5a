"""The EMA inside a parent module's state dict (a LightningModule attribute, a container): tensors
under the EMA's prefix ({prefix}weights.{name}, {prefix}step), written by the parent's state_dict()
and read back by its load_state_dict(), all or nothing; the format, schedule, rounding and buffer
mode go in the state dict's _metadata (docs/checkpoints.md)."""

from __future__ import annotations

from ..checkpoint import FORMAT, FORMAT_VERSION

WEIGHTS = "weights."
STEP = "step"
META_KEY = "fused_ema"


def write(own: dict, destination, prefix: str, keep_vars: bool, version) -> None:
    """Writes ema.state_dict()'s content (`own`) into `destination` under `prefix`."""
    for name, tensor in own["weights"].items():
        destination[prefix + WEIGHTS + name] = tensor if keep_vars else tensor.detach()
    destination[prefix + STEP] = own["step"]
    metadata = getattr(destination, "_metadata", None)
    if metadata is not None:
        metadata[prefix[:-1]] = {
            "version": version,
            META_KEY: {k: own[k] for k in ("format", "format_version", "schedule", "rounding")}
            | {"buffers": own["buffers"]},
        }


def read(state_dict, prefix: str, local_metadata) -> tuple[dict, list, list]:
    """fused_ema's own state dict rebuilt from the keys under `prefix`, with the keys that are
    missing and those that do not belong to the layout."""
    weights, step, missing, unexpected = {}, None, [], []
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if rest.startswith(WEIGHTS):
            weights[rest[len(WEIGHTS) :]] = value
        elif rest == STEP:
            step = value
        else:
            unexpected.append(key)
    if step is None:
        missing.append(prefix + STEP)
    own = {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": weights, "step": step}
    meta = (local_metadata or {}).get(META_KEY)
    if isinstance(meta, dict):
        own.update({k: meta[k] for k in ("format_version", "schedule", "rounding") if k in meta})
    elif meta is not None:
        own["format_version"] = meta  # reported by the parser as a format problem
    return own, missing, unexpected
