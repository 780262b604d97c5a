"""Small models and a training step for the ModelEma tests: fresh random data every step, real
optimizer updates, a BatchNorm (float buffers plus the integer num_batches_tracked), an embedding
tied to the output head."""

import torch
from torch import nn


class TiedNet(nn.Module):
    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU())
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(1.5))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)) * self.scale)


def small_mlp(dtype=torch.float32, device="cpu"):
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(
        device=device, dtype=dtype
    )


def train_step(model, optimizer, generator=None, device="cpu"):
    """One optimizer step on random data, whatever the model."""
    model.train()
    if isinstance(model, TiedNet):
        tokens = torch.randint(0, model.embed.num_embeddings, (32,), generator=generator)
        out = model(tokens.to(device))
    else:
        first = next(m for m in model.modules() if isinstance(m, nn.Linear))
        dtype = first.weight.dtype
        x = torch.randn(32, first.in_features, generator=generator).to(device=device, dtype=dtype)
        out = model(x)
    loss = out.float().square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def trained(model, steps, seed=0):
    """`model` after `steps` SGD steps on random data drawn from `seed`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        train_step(model, opt, g)
    return model


def float_state(module):
    """name -> tensor for floating entries of a state dict (what an EMA averages)."""
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}
