"""The prelude of the documentation's examples: tests/test_docs_examples.py runs it before the
first block of each page (README.md and docs/*.md), so `model`, `optimizer`, `loader`, `loss_fn`,
`train_step` and `evaluate` exist there: a tiny regression model and its data on the CPU."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fused_ema  # noqa: F401  (the examples use it without importing it again)

torch.manual_seed(0)
device = torch.device("cpu")
model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
inputs = torch.randn(256, 8)
loader = DataLoader(TensorDataset(inputs, inputs.sum(1, keepdim=True)), batch_size=32)
loss_fn = nn.functional.mse_loss


def train_step(model, batch):
    """One AdamW step of the prelude's `optimizer` (which holds the prelude's model)."""
    x, y = batch
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


@torch.no_grad()
def evaluate(model):
    """The mean loss over `loader` in eval mode; the module's mode is put back afterwards."""
    was_training = model.training
    model.eval()
    loss = sum(loss_fn(model(x), y).item() for x, y in loader) / len(loader)
    model.train(was_training)
    return loss
