"""`python -m fused_ema`: print what this installation compiled and runs (build_info)."""

import json

from .ops import build_info

print(json.dumps(build_info(), indent=2))
