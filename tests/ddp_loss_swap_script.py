"""Run by test_loss_swap.py: two CPU processes (gloo) fine-tune a small Llama with and without the loss swap."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_tune as lt  # noqa: E402
from tests.helpers import finish_ddp  # noqa: E402
from tests.test_loss_swap import collated, llama, padded_batch  # noqa: E402


class CausalLM(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = llama().train()
        self.kept_logits: list[bool] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)
        self.kept_logits.append("logits" in out)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(swap: bool) -> CausalLM:
    module = CausalLM()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        callbacks=[lt.LossSwap("chunked", verbose=False)] if swap else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    batches = [padded_batch(), collated([10, 10]), collated([3, 11, 6]), collated([8, 8])]
    trainer.fit(module, DataLoader(batches, batch_size=None, shuffle=False))
    return module


def main(out: Path) -> None:
    plain, swapped = fit(False), fit(True)
    difference = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), swapped.parameters(), strict=True))
    checksum = float(sum(p.detach().double().sum() for p in swapped.parameters()))
    payload = {
        "difference": difference,
        "checksum": checksum,
        "kept_logits": [plain.kept_logits, swapped.kept_logits],
        "restored": "forward" not in vars(swapped.model),
    }
    finish_ddp(out, swapped.trainer.global_rank, payload)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
