"""Framework integrations of ModelEma: `fused_ema.integrations.lightning` (a Lightning Callback),
`fused_ema.integrations.transformers` (a Hugging Face TrainerCallback and its helpers) and
`fused_ema.integrations.accelerate` (checkpointing through accelerate, DeepSpeed ZeRO-3 included).

Nothing here is imported by `import fused_ema`: each submodule imports its framework only when it
is itself imported, so fused_ema never needs lightning or transformers installed.
"""

import importlib

__all__ = ["accelerate", "lightning", "transformers"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
