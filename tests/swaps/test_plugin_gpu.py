"""The FSDP and DeepSpeed cells of docs/multi_gpu.md, on one CUDA GPU (Lightning refuses both strategies on CPU).

Skipped without a GPU (``pytest.mark.gpu``); the DeepSpeed tests also need ``pip install 'lightning-tune[deepspeed]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from lightning_tune.lr import warmup_cosine_lr
from tests.helpers import LRRecorder, csv_rows

pytestmark = pytest.mark.gpu

SMALL = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)


def _data() -> SyntheticTokenDataModule:
    # 32 sequences, batch 8: 4 optimizer steps per epoch
    return SyntheticTokenDataModule(8, seq_len=32, vocab_size=SMALL.vocab_size, train_sequences=32, seed=0)


def _fit(
    tmp_path: Path, strategy: Any, plugin: lt.TunePlugin, *, epochs: int, ckpt: Path | None = None
) -> tuple[Trainer, LRRecorder]:
    recorder = LRRecorder()
    callbacks: list[Callback] = [
        lt.WarmupCosine(warmup_steps=2, total_steps=8, min_lr=1e-4),
        lt.AdaptiveLROnPlateau(patience=5),
        lt.ThroughputLatencyMonitor(log_every_n_steps=2),
        lt.ActivationCheckpointing(verbose=False),
        recorder,
    ]
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        plugins=[plugin],
        callbacks=callbacks,
        max_epochs=epochs,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name="csv"),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(DemoGPT(SMALL, lr=1e-2), datamodule=_data(), ckpt_path=ckpt)
    return trainer, recorder


def _expected_lrs() -> list[float]:
    return [warmup_cosine_lr(s, base_lr=1e-2, warmup_steps=2, total_steps=8, min_lr=1e-4) for s in range(8)]


def _perf_rows(trainer: Trainer) -> list[dict[str, str]]:
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    return [row for row in csv_rows(trainer.logger.log_dir) if row.get("perf/train/samples_per_sec")]


def test_gpu_fsdp_callbacks_plugin_and_resume(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_tune.demos.gpt import Block

    def strategy() -> FSDPStrategy:
        return FSDPStrategy(auto_wrap_policy={Block})

    # 8-bit state on FSDP's flat parameters, attention swapped before wrapping
    pytest.importorskip("bitsandbytes")
    plugin = lt.TunePlugin("bf16-mixed", optimizer="adamw8bit", attention="sdpa")
    trainer, recorder = _fit(tmp_path / "8bit", strategy(), plugin, epochs=1)
    assert type(plugin.inner) is FSDPPrecision and type(trainer.optimizers[0]).__name__ == "AdamW8bit"
    assert plugin.attention_swap is None  # undone at teardown
    assert [lr[0] for lr in recorder.lrs] == pytest.approx(_expected_lrs()[:4])

    # resume: the schedule and the training state continue as in one uninterrupted run
    def fused() -> lt.TunePlugin:
        return lt.TunePlugin("bf16-mixed", optimizer="adamw_fused", attention="sdpa")

    whole, whole_lrs = _fit(tmp_path / "whole", strategy(), fused(), epochs=2)
    first, first_lrs = _fit(tmp_path / "first", strategy(), fused(), epochs=1)
    first.save_checkpoint(tmp_path / "fsdp.ckpt")
    resumed, resumed_lrs = _fit(tmp_path / "resumed", strategy(), fused(), epochs=2, ckpt=tmp_path / "fsdp.ckpt")
    assert resumed.global_step == whole.global_step == 8
    assert np.array(first_lrs.lrs + resumed_lrs.lrs) == pytest.approx(np.array(whole_lrs.lrs))  # step x group
    assert [lr[0] for lr in whole_lrs.lrs] == pytest.approx(_expected_lrs())
    assert [int(row["step"]) for row in _perf_rows(whole)] == [1, 3, 5, 7]


def _deepspeed_plan_strategy() -> Any:
    pytest.importorskip("deepspeed")
    from lightning_tune.plan import measure_memory, plan_zero

    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(size, SMALL.seq_len, dtype=torch.long)
        return ids, ids

    estimate = measure_memory(DemoGPT(SMALL), batch, precision="bf16-mixed")
    total = torch.cuda.get_device_properties(0).total_memory
    plan = plan_zero(estimate, gpu_memory_bytes=total, num_gpus=1, batch_size=8)
    return lt.deepspeed_strategy(plan)


def test_gpu_deepspeed_from_a_plan(tmp_path: Path) -> None:
    plugin = lt.TunePlugin("bf16-mixed", attention="sdpa")
    whole, whole_lrs = _fit(tmp_path / "whole", _deepspeed_plan_strategy(), plugin, epochs=2)
    assert type(plugin.inner) is DeepSpeedPrecision
    assert [lr[0] for lr in whole_lrs.lrs] == pytest.approx(_expected_lrs())
    assert [int(row["step"]) for row in _perf_rows(whole)] == [1, 3, 5, 7]

    first, first_lrs = _fit(tmp_path / "first", _deepspeed_plan_strategy(), lt.TunePlugin("bf16-mixed"), epochs=1)
    first.save_checkpoint(tmp_path / "deepspeed.ckpt")
    resumed, resumed_lrs = _fit(
        tmp_path / "resumed",
        _deepspeed_plan_strategy(),
        lt.TunePlugin("bf16-mixed"),
        epochs=2,
        ckpt=tmp_path / "deepspeed.ckpt",
    )
    assert resumed.global_step == 8
    assert np.array(first_lrs.lrs + resumed_lrs.lrs) == pytest.approx(np.array(whole_lrs.lrs))  # step x group


def test_gpu_deepspeed_refusals_name_the_reason(tmp_path: Path) -> None:
    plugin = lt.TunePlugin("bf16-mixed", optimizer="adamw_fused")
    with pytest.raises(MisconfigurationException, match="Set the optimizer in DeepSpeed's config"):
        _fit(tmp_path / "optimizer", _deepspeed_plan_strategy(), plugin, epochs=1)
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        strategy=_deepspeed_plan_strategy(),
        plugins=[lt.TunePlugin("bf16-mixed")],
        callbacks=[lt.DynamicBatchSize()],
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
    )
    with pytest.raises(MisconfigurationException, match="DeepSpeed"):
        trainer.fit(DemoGPT(SMALL), datamodule=_data())
