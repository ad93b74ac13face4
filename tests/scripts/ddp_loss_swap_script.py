"""Run by test_loss_swap.py: two CPU processes (gloo) fine-tune small causal LMs with and without the loss swap.

``main(out)``, in one launch: under DDP a Llama without the swap and with ``LossSwap``; under
FSDP2 (``ModelParallelStrategy``, the module sharding itself in ``configure_model`` with ``fully_shard``) a Llama whose
untied ``lm_head`` is a unit of its own (its weight gathered in the head's forward and freed after it) without the
swap, with ``LossSwap`` (swapped before ``configure_model``) and with ``TunePlugin(loss=...)`` (swapped after it), and
a Gemma with tied embeddings (the head's weight is the root's) without the swap and with ``LossSwap``. Each rank
writes to ``<out>/rank<r>.json``, per run compared, its losses and the largest gap between its part (its shard under
FSDP2) of the gradients at every step and of the final weights, or the error a run raised.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader

import lightning_tune as lt
from tests.helpers import finish_ddp
from tests.swaps.test_loss_swap import collated, gemma, llama, padded_batch


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: the shard of a DTensor (FSDP2), the whole tensor otherwise (DDP)."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


class CausalLM(LightningModule):
    def __init__(self, factory: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = factory().train()
        self.kept_logits: list[bool] = []
        self.losses: list[float] = []
        self.grads: list[list[torch.Tensor]] = []
        self.head_own_unit = False

    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, ModelParallelStrategy) or isinstance(self.model, FSDPModule):
            return
        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        if not self.model.config.tie_word_embeddings:
            fully_shard(self.model.lm_head, mesh=mesh)
            self.head_own_unit = True
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)
        self.kept_logits.append("logits" in out)
        self.losses.append(out.loss.item())
        return out.loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grads.append([local(p.grad) for p in self.parameters()])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(strategy: str, factory: Callable[[], nn.Module], swap: str | None) -> CausalLM:
    module = CausalLM(factory)
    timeout = timedelta(seconds=60)  # a rank left waiting fails within a minute
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timeout)
        if strategy == "ddp"
        else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout),
        max_steps=2,
        callbacks=[lt.LossSwap("chunked", chunk_size=5, verbose=False)] if swap == "callback" else [],
        plugins=[lt.TunePlugin("32-true", loss="chunked")] if swap == "plugin" else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    batches = [padded_batch(), collated([10, 10]), collated([3, 11, 6]), collated([8, 8])]
    trainer.fit(module, DataLoader(batches, batch_size=None, shuffle=False))
    return module


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def compare(plain: CausalLM, swapped: CausalLM) -> dict[str, Any]:
    return {
        "kept_logits": [plain.kept_logits, swapped.kept_logits],
        "losses": [plain.losses, swapped.losses],
        "grads": max(difference(a, b) for a, b in zip(plain.grads, swapped.grads, strict=True)),
        "steps": [len(plain.grads), len(swapped.grads)],
        "weights": difference([local(p) for p in plain.parameters()], [local(p) for p in swapped.parameters()]),
        "checksum": float(sum(local(p).double().sum() for p in swapped.parameters())),
        "restored": "forward" not in vars(swapped.model) and "forward" not in vars(swapped.model.lm_head),
        "head_own_unit": swapped.head_own_unit,
    }


def main(out: Path) -> None:
    payload: dict[str, Any] = {}

    def cell(name: str, strategy: str, factory: Callable[[], nn.Module], swaps: tuple[str, ...]) -> int:
        try:
            plain = fit(strategy, factory, None)
            for swap in swaps:
                payload[f"{strategy}/{name}-{swap}"] = compare(plain, fit(strategy, factory, swap))
            return plain.trainer.global_rank
        except Exception:  # noqa: BLE001 - the test reports it; the other cells still run
            error = {"error": traceback.format_exc()[-3000:]}
            payload.update(
                {f"{strategy}/{name}-{swap}": error for swap in swaps if f"{strategy}/{name}-{swap}" not in payload}
            )
            return int(os.environ.get("LOCAL_RANK", 0))

    cell("llama", "ddp", llama, ("callback",))
    cell("llama", "fsdp2", llama, ("callback", "plugin"))
    rank = cell("gemma-tied", "fsdp2", gemma, ("callback",))
    finish_ddp(out, rank, payload)
