"""Give an existing LightningModule a warm-up + cosine schedule and plateau LR drops without editing it.

``LitClassifier`` below stands for a module you already have: its ``configure_optimizers`` returns a bare optimizer
and it knows nothing about lightning_tune. The only change is the ``callbacks=[...]`` list given to the Trainer.

Run it (about 10-20 s on a laptop CPU), then look at the learning rate (``tune/lr``, logged by the schedule; no
``LearningRateMonitor`` needed) and the losses in TensorBoard::

    python examples/add_to_existing_module.py
    tensorboard --logdir lightning_logs
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_tune as lt


# --- an existing module, left exactly as it was -------------------------------------------------------------------
class LitClassifier(pl.LightningModule):
    def __init__(self, in_features: int = 32, num_classes: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_features, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(dim=-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


# --- some data: labels from a fixed random "teacher" network -------------------------------------------------------
def make_loaders(
    *, n_train: int = 8192, n_val: int = 1024, in_features: int = 32, seed: int = 0
) -> tuple[DataLoader[tuple[Tensor, ...]], DataLoader[tuple[Tensor, ...]]]:
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(in_features, 4, generator=gen)
    x = torch.randn(n_train + n_val, in_features, generator=gen)
    y = (torch.tanh(x) @ teacher + 0.3 * torch.randn(n_train + n_val, 4, generator=gen)).argmax(dim=-1)
    train = TensorDataset(x[:n_train], y[:n_train])
    val = TensorDataset(x[n_train:], y[n_train:])
    return DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=256)


def main(*, max_epochs: int = 6, root_dir: str = ".") -> dict[str, float]:
    pl.seed_everything(0, verbose=False)
    train_loader, val_loader = make_loaders()
    model = LitClassifier()

    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="auto",
        devices=1,
        default_root_dir=root_dir,
        log_every_n_steps=10,
        enable_checkpointing=False,
        # The only change: the pack's callbacks. The module's own optimizer (SGD, lr=0.05) is kept; its LR becomes
        # the peak of the schedule, and a plateau in val_loss halves it on top of the schedule.
        callbacks=[
            lt.WarmupCosine(warmup_ratio=0.1, min_lr=1e-3),
            lt.AdaptiveLROnPlateau(monitor="val_loss", patience=2),
        ],
    )
    trainer.fit(model, train_loader, val_loader)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    print(f"val_loss {metrics['val_loss']:.3f}  val_acc {metrics['val_acc']:.3f}  (logs: {trainer.log_dir})")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--root-dir", default=".", help="directory that receives lightning_logs/")
    args = parser.parse_args()
    main(max_epochs=args.max_epochs, root_dir=args.root_dir)
