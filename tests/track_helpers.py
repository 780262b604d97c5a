"""The small model and training loop the PostHocEma and Bema tests share: a BatchNorm MLP (float
buffers and an integer one) trained by SGD with momentum on fresh random batches, calling
on_step(t) after each optimizer step."""

import torch
from torch import nn


def net(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    return model.to(device=device, dtype=dtype)


def train(model, steps, on_step, seed=1, device="cpu", first=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for t in range(first, first + steps):
        x = torch.randn(32, 12, generator=g).to(device=device, dtype=dtype)
        y = torch.randn(32, 3, generator=g).to(device=device, dtype=dtype)
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        on_step(t)


FUSED_OPS = ("lerp_", "lerp_stochastic_", "lerp_many_", "lerp_many_stochastic_", "bema_")


def fused_passes(fn) -> list:
    """The passes of the fused ops that fn() makes, in order, by the names their drivers give the
    profiler (fused_ema::bema_, ...): a prepared update runs them with no Python call to spy on."""
    names = {f"fused_ema::{op}" for op in FUSED_OPS}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name.split("::")[1] for e in prof.events() if e.name in names]
