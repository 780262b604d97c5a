"""One Lightning run under strategy="ddp" with 2 CPU processes, started by Lightning's own launcher
(this script is run again for rank 1). `straight` trains 2 epochs and checkpoints each; `resume`
continues from the first. Each rank saves its EMA, the model, and the reference EMA."""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from integration_reference import ReferenceEma, snapshot
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fused_ema.integrations.lightning import EMACallback

DECAY = 0.9


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.reference = ReferenceEma(DECAY)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.reference.add(self)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)  # 2 batches per rank and epoch


def main(mode: str, out: Path) -> None:
    torch.set_num_threads(1)
    model, callback = Net(), EMACallback(decay=DECAY)
    checkpoints = L.callbacks.ModelCheckpoint(
        dirpath=out / "ddp_ckpt", filename="{epoch}", save_top_k=-1, monitor="val_loss"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        callbacks=[callback, checkpoints] if mode == "straight" else [callback],
    )
    ckpt = out / "ddp_ckpt" / "epoch=0.ckpt" if mode == "resume" else None
    try:
        trainer.fit(model, loader(1), loader(2), ckpt_path=ckpt)
    except OSError as err:  # the launcher could not start the second process
        print(f"could not spawn the DDP processes: {err}")
        sys.exit(3)
    torch.save(
        {
            "global_step": trainer.global_step,
            "ema": callback.ema.state_dict(),
            "model": snapshot(model),
            "reference": model.reference.weights,
        },
        out / f"{mode}_rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
