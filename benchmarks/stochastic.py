"""CPU cost of a stochastically rounded bfloat16 EMA update: fused_ema.lerp_stochastic_ against the
plain fused_ema.lerp_ (round to nearest) and timm 1.0.31's scheme in torch ops, interleaved.

    python -m benchmarks.stochastic                 # 4M elements in 16 tensors, 15 rounds
    python -m benchmarks.stochastic --elements 16777216 --tensors 64 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fused_ema

from .timing import interleaved, synchronizer

DECAY = 0.9999
RANDOM_BITS = 16
KEEP_HIGH_HALF = -(1 << RANDOM_BITS)  # 0xFFFF0000 as an int32


def timm_stochastic_update(ema: list[torch.Tensor], src: list[torch.Tensor], decay: float):
    """timm's bfloat16 EMA step with stochastic rounding, in torch ops: average in float32, add 16
    random bits below the bfloat16 half, truncate, copy back."""
    ema32 = torch.cat([e.reshape(-1) for e in ema]).float()
    src32 = torch.cat([s.reshape(-1) for s in src]).float()
    ema32.mul_(decay).add_(src32, alpha=1.0 - decay)
    bits = ema32.view(torch.int32)
    bits.add_(torch.randint(0, 1 << RANDOM_BITS, bits.shape, dtype=torch.int32))
    bits.bitwise_and_(KEEP_HIGH_HALF)
    rounded = ema32.to(torch.bfloat16)  # exact: the low half is zero
    for e, part in zip(ema, rounded.split([e.numel() for e in ema])):
        e.copy_(part.view_as(e))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    size = args.elements // args.tensors
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(size, generator=g).to(torch.bfloat16) for _ in range(args.tensors)]
    emas = {name: [s.clone() for s in src] for name in ("stochastic", "plain", "timm")}
    weight = torch.tensor(1.0 - DECAY, dtype=torch.float64)
    step = [0]

    def stochastic():
        step[0] += 1
        fused_ema.lerp_stochastic_(emas["stochastic"], src, weight, seed=0, step=step[0])

    steps = {
        "fused_ema.lerp_stochastic_": stochastic,
        "fused_ema.lerp_ (nearest)": lambda: fused_ema.lerp_(emas["plain"], src, 1.0 - DECAY),
        "timm 1.0.31 scheme": lambda: timm_stochastic_update(emas["timm"], src, DECAY),
    }
    samples = interleaved(steps, args.rounds, reps=3, sync=synchronizer("cpu"))
    n = size * args.tensors
    medians = {name: statistics.median(times) for name, times in samples.items()}
    print(
        f"{n:,} bfloat16 elements in {args.tensors} tensors, {torch.get_num_threads()} threads, "
        f"cpu isa {fused_ema.cpu_isa()}"
    )
    ours = medians["fused_ema.lerp_stochastic_"]
    for name, seconds in medians.items():
        print(f"  {name:28s} {seconds / n * 1e9:7.2f} ns/element   {seconds / ours:6.2f}x ours")


if __name__ == "__main__":
    main()
