"""Run by test_pack.py: two CPU processes (gloo), a Llama trained by DynamicBatchSize packed (under DDP, trimmed too).

``main(out, strategy=...)`` with ``ddp`` or ``fsdp2`` (``ModelParallelStrategy``, the module sharding itself in
``configure_model``). Under DDP both fits run the same steps through an injected out-of-memory error; under FSDP2 none
is injected (on a CPU, recovering from one fails inside torch's own ``reset_iter_state``, packed or not).
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard

import lightning_tune as lt
from tests.batch.test_pack import CausalLM, small_device
from tests.helpers import finish_ddp


class Sharded(CausalLM):
    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, ModelParallelStrategy) or isinstance(self.model, FSDPModule):
            return
        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def full(tensor: torch.Tensor) -> list[float]:
    """The whole parameter: a DTensor's gathered (FSDP2), the tensor otherwise (DDP)."""
    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return whole.detach().flatten().tolist()


def train(pack: bool, out: Path, strategy: str) -> tuple[Trainer, Sharded, lt.DynamicBatchSize]:
    module = Sharded(batch_size=4)
    module.dataset.samples = module.dataset.samples * 2  # 2 ranks x 2 steps of 16 samples
    roomy = lt.SimulatedMemory(total_bytes=1 << 30, fixed_bytes=1 << 20, bytes_per_sample=1)
    probe = small_device() if strategy == "ddp" else roomy
    dyn = lt.DynamicBatchSize(probe=probe, pack=pack, loss_weight="tokens")
    parallel = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=60))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=parallel if strategy == "fsdp2" else "ddp",
        max_epochs=1,
        accumulate_grad_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[dyn],
        default_root_dir=str(out),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DynamicBatchSize: out of memory")
        trainer.fit(module)
    return trainer, module, dyn


def main(out: Path, *, strategy: str) -> None:
    trimmed = train(False, out, strategy)[1] if strategy == "ddp" else None
    trainer, packed, dyn = train(True, out, strategy)
    payload = {
        "packed": [full(p) for p in packed.parameters()],
        "trimmed": [] if trimmed is None else [full(p) for p in trimmed.parameters()],
        "oom": dyn.oom_recoveries,
        "packed_calls": packed.packed,
        "steps": trainer.global_step,
    }
    finish_ddp(out, trainer.global_rank, payload)
