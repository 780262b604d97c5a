"""A short CUDA workload for compute-sanitizer and ncu (.ci/gpu-checks.sh): lerp_, lerp_many_ (3
tracks) and bema_ over every dtype pair in both launch layouts on ragged, misaligned lists (a host
weight and a device one), lerp_stochastic_ and the schedule op, each result compared bit for bit
with the CPU kernel. --small: a few MB (fast under the sanitizer); --large: 64M-element tensors
(occupancy)."""

import argparse
import sys

import torch

import fused_ema

PACK_EDGES = [1, 7, 8, 9, 33, 1000, 4097, 65535, 65536, 65537, 2 * 65536 + 9]


def cuda_small_params(flag: bool) -> bool:
    """Keeps CUDA launches at 4 KB of parameters (or lets them take 32 KB); returns the previous
    setting. A test-only op (csrc/testing/; tests/testing_ops.py wraps it for the tests)."""
    return torch.ops.fused_ema_testing.cuda_small_params(int(bool(flag)))


def ragged(dtype, sizes, seed):
    """Views into one flat buffer, each starting 0-3 elements past the previous one's end."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(sum(sizes) + 4 * len(sizes), generator=g, dtype=torch.float64)
    buf = (buf * 4).to(dtype)
    views, at = [], 0
    for i, n in enumerate(sizes):
        views.append(buf[at + i % 4 : at + i % 4 + n])
        at += n + 4
    return views


def same_bits(a, b):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def check_pair(pair, sizes, seed, failures):
    ema_cpu, src_cpu = ragged(pair[0], sizes, seed), ragged(pair[1], sizes, seed + 1)
    for small in (False, True):
        previous = cuda_small_params(small)
        try:
            for weight in (0.3, 0.75):
                e_cpu = [t.clone() for t in ema_cpu]
                e_gpu = [t.cuda() for t in ema_cpu]
                s_gpu = [t.cuda() for t in src_cpu]
                fused_ema.lerp_(e_cpu, src_cpu, weight)
                w = torch.tensor(weight, device="cuda") if weight > 0.5 else weight
                fused_ema.lerp_(e_gpu, s_gpu, w)
                for i, (a, b) in enumerate(zip(e_cpu, e_gpu)):
                    if not same_bits(a, b.cpu()):
                        failures.append(f"lerp_ {pair} small={small} w={weight} tensor {i}")
            if pair[0] in (torch.bfloat16, torch.float16):
                e_cpu = [t.clone() for t in ema_cpu]
                e_gpu = [t.cuda() for t in ema_cpu]
                s_gpu = [t.cuda() for t in src_cpu]
                offsets = [4 * i + (i % 3) for i in range(len(sizes))]
                kwargs = dict(seed=7, keys=list(range(3, 3 + len(sizes))), offsets=offsets)
                fused_ema.lerp_stochastic_(e_cpu, src_cpu, 1e-3, step=11, **kwargs)
                step = torch.tensor(11, device="cuda")
                fused_ema.lerp_stochastic_(e_gpu, s_gpu, 1e-3, step=step, **kwargs)
                for i, (a, b) in enumerate(zip(e_cpu, e_gpu)):
                    if not same_bits(a, b.cpu()):
                        failures.append(f"lerp_stochastic_ {pair} small={small} tensor {i}")
        finally:
            cuda_small_params(previous)


def check_many_and_bema(pair, sizes, seed, failures, device="cuda"):
    """lerp_many_ over 3 tracks (each misaligned its own way) and bema_, against the CPU."""
    src_cpu = ragged(pair[1], sizes, seed)
    lists = [ragged(pair[0], sizes, seed + 1 + k) for k in range(3)]
    for small in (False, True):
        previous = cuda_small_params(small)
        try:
            for weights in ((0.3, 0.0, 0.75), (1.0, 1.0, 0.6)):
                want = [[t.clone() for t in lst] for lst in lists]
                got = [[t.to(device) for t in lst] for lst in lists]
                src = [t.to(device) for t in src_cpu]
                on_device = torch.tensor(weights, dtype=torch.float64, device=device)
                fused_ema.lerp_many_(want, src_cpu, list(weights))
                fused_ema.lerp_many_(got, src, on_device)
                compare(f"lerp_many_ {pair} small={small} w={weights}", want, got, failures)
                want = [[t.clone() for t in lst] for lst in lists]
                got = [[t.to(device) for t in lst] for lst in lists]
                fused_ema.bema_(*want, src_cpu, weights)
                fused_ema.bema_(*got, src, on_device)
                compare(f"bema_ {pair} small={small} w={weights}", want, got, failures)
        finally:
            cuda_small_params(previous)


def compare(what, want, got, failures):
    for k, (a_list, b_list) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if not same_bits(a, b.cpu()):
                failures.append(f"{what} list {k} tensor {i}")


def check_schedule(failures):
    config = torch.tensor(
        [0.999, 0.0, 1.0, 0.75, 3.0, 2.0, 1.0, 0.0] + [0.0] * 4, dtype=torch.float64
    )
    for device in ("cpu", "cuda"):
        step = torch.tensor(0, dtype=torch.int64, device=device)
        out = torch.zeros(2, dtype=torch.float64, device=device)
        rows = []
        for _ in range(12):
            torch.ops.fused_ema.ema_schedule_(step, out, config.to(device), True)
            rows.append(out.cpu().clone())
        if device == "cpu":
            want = torch.stack(rows)
        # CUDA's pow (the power warmup) is within 2 ulp, not glibc's bit for bit; the weight,
        # 1 - decay, carries that absolute error: allow a few ulp of 1.0
        elif not torch.allclose(torch.stack(rows), want, rtol=0, atol=1e-15):
            failures.append(f"ema_schedule_ differs between CPU and CUDA: {rows} vs {want}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--large", action="store_true")
    args = parser.parse_args()
    failures = []
    if args.large:
        # 64M elements a tensor: every SM busy, for ncu's achieved occupancy.
        for pair in fused_ema.SUPPORTED_DTYPE_PAIRS:
            ema = torch.randn(1 << 26, device="cuda").to(pair[0])
            src = torch.randn(1 << 26, device="cuda").to(pair[1])
            fused_ema.lerp_([ema], [src], 0.1)
            if pair[0] in (torch.bfloat16, torch.float16):
                fused_ema.lerp_stochastic_([ema], [src], 0.1, seed=1, step=1)
            others = [torch.randn(1 << 26, device="cuda").to(pair[0]) for _ in range(2)]
            fused_ema.lerp_many_([[ema], [others[0]], [others[1]]], [src], [0.1, 0.2, 0.3])
            fused_ema.bema_([ema], [others[0]], [others[1]], [src], (0.1, 0.0, 0.5))
        torch.cuda.synchronize()
        print("large workload done")
        return 0
    sizes = PACK_EDGES + [0, 3, 17] * 40  # 131 tensors: over one 4 KB launch
    for k, pair in enumerate(fused_ema.SUPPORTED_DTYPE_PAIRS):
        check_pair(pair, sizes, seed=10 * k, failures=failures)
        check_many_and_bema(pair, sizes, seed=10 * k + 5, failures=failures)
    check_schedule(failures)
    torch.cuda.synchronize()
    for line in failures[:40]:
        print("MISMATCH", line)
    print(f"workload: {len(failures)} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
