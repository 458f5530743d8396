"""Bring your own model: a plain PyTorch module under strategy="pd2bw" (2 CPU processes, Lightning launches them).

python examples/plain_module.py
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

import lightning_pd2bw  # noqa: F401  (registers strategy="pd2bw")


class Regressor(pl.LightningModule):
    def configure_model(self):  # built on the meta device; each stage initialises only its own layers
        if not hasattr(self, "layers"):
            self.layers = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def pipeline_layers(self):
        self.configure_model()
        return list(self.layers)

    def pipeline_inputs(self, batch):
        return batch["x"]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output.squeeze(-1), batch["y"])

    def training_step(self, batch, batch_idx):  # Lightning requires it; pd2bw runs the pipeline instead
        return self.pipeline_loss(self.layers(self.pipeline_inputs(batch)), batch)  # (used by strategy="auto")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data():
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    rows = [{"x": row, "y": row[:4].sum()} for row in x]
    return torch.utils.data.DataLoader(rows, batch_size=16, drop_last=True)


if __name__ == "__main__":
    trainer = pl.Trainer(strategy="pd2bw", accelerator="cpu", devices=2, max_steps=40, logger=False)
    trainer.fit(Regressor(), data())
    print(f"final train_loss {trainer.callback_metrics['train_loss'].item():.4f}")
