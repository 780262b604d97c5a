"""accelerate's checkpointing of an EMA that also holds under DeepSpeed ZeRO-3, where each rank's
state_dict() holds its own partitions but save_state() writes one file for all: WholeCheckpoint(ema)
saves the EMA whole and gives each process its partition back on load (docs/integrations.md).
Without ZeRO-3 it is the EMA's own state_dict. Imports nothing of accelerate."""

from __future__ import annotations

from ._common import whole_state_dict

__all__ = ["WholeCheckpoint"]


class WholeCheckpoint:
    """What to register for checkpointing in place of a ModelEma, PostHocEma or Bema:
    ``accelerator.register_for_checkpointing(WholeCheckpoint(ema))``."""

    def __init__(self, ema):
        if not (callable(getattr(ema, "state_dict", None)) and hasattr(ema, "load_state_dict")):
            raise TypeError(
                "WholeCheckpoint wraps a fused_ema.ModelEma, PostHocEma or Bema, got "
                f"{type(ema).__name__}"
            )
        self.ema = ema

    def state_dict(self) -> dict:
        """The EMA's state dict, ZeRO-3 partitions gathered whole: a collective, which every
        process makes (accelerate's save_state calls this on each)."""
        return whole_state_dict(self.ema)

    def load_state_dict(self, state: dict):
        """Restores the EMA, all or nothing; under ZeRO-3 each rank takes its partition."""
        return self.ema.load_state_dict(state)
