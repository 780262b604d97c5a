"""Framework integrations of ModelEma: `lightning` (a Lightning Callback), `transformers` (a Hugging
Face TrainerCallback and its helpers) and `accelerate` (checkpointing, DeepSpeed ZeRO-3 included).
`import fused_ema` imports none of them, and each imports its framework only when it is itself
imported, so fused_ema never needs lightning or transformers installed."""

import importlib

__all__ = ["accelerate", "lightning", "transformers"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
