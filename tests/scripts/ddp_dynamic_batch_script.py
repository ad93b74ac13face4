"""Run by test_dynamic_batch_ddp.py: two CPU processes (gloo) under DynamicBatchSize, each with its own memory.

Rank 1's simulated device has less room per sample than rank 0's, and the first batch size only runs out of memory on
rank 1: both ranks must retry together and take every later decision on the worst rank's figures.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

import lightning_tune as lt
from tests.batch.test_dynamic_batch import Net, Record
from tests.helpers import finish_ddp


class Collectives(Callback):
    """Counts the barriers and Python-level all-reduces issued while training runs (DDP's gradient buckets are not)."""

    def __init__(self) -> None:
        self.counts = {"barrier": 0, "all_reduce": 0}
        self._originals: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        for name in self.counts:
            original = self._originals[name] = getattr(dist, name)

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)  # the later scenarios of the launch run in this process


def main(out: Path, *, with_callback: bool = True) -> None:
    memories = [lt.SimulatedMemory(10_000, 2_000, 100), lt.SimulatedMemory(10_000, 2_000, 150)]
    dyn = lt.DynamicBatchSize(adjust_every=2, multiple_of=4, probe=None)
    record = Record(dyn if with_callback else None)
    collectives = Collectives()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),  # the launch's first group: every scenario's timeout
        max_epochs=2,
        callbacks=[dyn, record, collectives] if with_callback else [record, collectives],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dyn.probe = memories[trainer.global_rank]
    model = Net(batch_size=64, n=1024)  # 64 samples: 8400 bytes on rank 0, 11600 (> 10000) on rank 1
    trainer.fit(model)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    payload = {
        "sizes": record.sizes,
        "seen": {str(k): v for k, v in record.seen.items()},
        "oom_recoveries": dyn.oom_recoveries,
        "local_ooms": dyn.probe.out_of_memory_errors,
        "weights": [p.detach().double().flatten().tolist() for p in model.parameters()],
        "checksum": checksum,
        "steps": trainer.global_step,
        "collectives": collectives.counts,
    }
    finish_ddp(out, trainer.global_rank, payload)
