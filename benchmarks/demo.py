"""A short demo of fused_ema.lerp_ against torch._foreach_lerp_: both update the same parameter
lists, interleaved, and the table shows median times and the speed-up."""

import argparse
import statistics
import time

import torch

import fused_ema


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def scenario(name, count, numel, ema_dtype, src_dtype):
    ema = [torch.randn(numel, dtype=ema_dtype) for _ in range(count)]
    src = [torch.randn(numel).to(src_dtype) for _ in range(count)]
    return name, ema, src


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(
        f"fused_ema {fused_ema.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU path {fused_ema.cpu_isa()}"
    )
    scenarios = [
        scenario("20,000 x 1,000 float32", 20_000, 1_000, torch.float32, torch.float32),
        scenario("4 x 10M float32", 4, 10_000_000, torch.float32, torch.float32),
        scenario("float32 EMA of bf16, 50M", 50, 1_000_000, torch.float32, torch.bfloat16),
    ]
    print(f"{'scenario':28} {'foreach_lerp_ ms':>17} {'fused_ema ms':>13} {'speed-up':>9}")
    for name, ema, src in scenarios:

        def foreach(ema=ema, src=src):
            same = src if src[0].dtype == ema[0].dtype else [s.to(ema[0].dtype) for s in src]
            torch._foreach_lerp_(ema, same, 1e-3)

        def fused(ema=ema, src=src):
            fused_ema.lerp_(ema, src, 1e-3)

        rounds = {"foreach": [], "fused": []}
        for _ in range(3):  # interleaved rounds
            rounds["foreach"] += timed(foreach, args.repeats)
            rounds["fused"] += timed(fused, args.repeats)
        ref, ours = (statistics.median(rounds[k]) * 1e3 for k in ("foreach", "fused"))
        print(f"{name:28} {ref:17.2f} {ours:13.2f} {ref / ours:8.2f}x")


if __name__ == "__main__":
    main()
