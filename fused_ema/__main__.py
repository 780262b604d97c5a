"""`python -m fused_ema`: print what this installation compiled and runs (build_info); `--short`
prints one line."""

import json
import sys

from .ops import build_info

info = build_info()
if "--short" in sys.argv[1:]:
    cuda = f"CUDA kernel for {','.join(info['cuda_archs'])}" if info["cuda_kernel"] else "no CUDA"
    print(
        f"fused_ema {info['version']} (torch {info['torch_version']}): CPU kernel "
        f"[{info['cpu_isa']}], {cuda}"
    )
else:
    print(json.dumps(info, indent=2))
