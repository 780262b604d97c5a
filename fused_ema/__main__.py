"""`python -m fused_ema`: print what this installation compiled and runs (build_info); `--short`
prints one line. Other arguments: argparse's usage error, exit status 2."""

import argparse
import json
import sys

from .ops import build_info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fused_ema",
        description="Print what this installation of fused_ema compiled and runs (build_info).",
    )
    p.add_argument("--short", action="store_true", help="one line instead of the JSON")
    args = p.parse_args(argv)  # --help exits 0, an unknown argument exits 2 with the usage
    info = build_info()
    if args.short:
        archs = ",".join(info["cuda_archs"])
        cuda = f"CUDA kernel for {archs}" if info["cuda_kernel"] else "no CUDA"
        print(
            f"fused_ema {info['version']} (torch {info['torch_version']}): CPU kernel "
            f"[{info['cpu_isa']}], {cuda}"
        )
    else:
        print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
