"""The EMA as a whole: its constructor options, checkpoints (its own state dict, inside a
parent's), moving it to another device or dtype (ema.to()) and its health (ema.stats())."""
