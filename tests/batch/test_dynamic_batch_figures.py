"""What a user reads off a DynamicBatchSize run: the logged loss, the padding, the micro-batch rate, the OOM messages.

Each figure is checked through a real Trainer against the run without the cut or against a hand count.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune import keys
from tests.helpers import fit
from tests.hf_data import VOCAB, TokenDataset, lm_collator, long_tailed_lengths


class Memory(Logger):
    """Keeps each logged row with its step."""

    name, version = "memory", 0  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def series(self, key: str) -> list[tuple[int | None, float]]:
        return [(step, row[key]) for step, row in self.rows if key in row]


class TokenLM(LightningModule):
    """An embedding LM with Hugging Face's token-mean loss (labels -100 ignored); records each batch it runs."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.dataset, self.batch_size = dataset, batch_size
        self.real = self.padded = 0
        self.runs: list[int] = []  # samples of each training_step call
        self.seen: list[tuple[int, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.emb(batch["input_ids"]))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        if batch["input_ids"].device.type != "meta":  # not the monitor's FLOP count on a meta copy
            mask = batch["attention_mask"]
            self.real, self.padded = self.real + int(mask.sum()), self.padded + mask.numel()
            self.runs.append(len(mask))
            self.seen += [tuple(ids[m.bool()].tolist()) for ids, m in zip(batch["input_ids"], mask, strict=True)]
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("label_tokens", (batch["labels"] != -100).sum().float(), reduce_fx="sum")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, collate_fn=lm_collator())


def roomy() -> lt.SimulatedMemory:
    return lt.SimulatedMemory(total_bytes=1 << 40, fixed_bytes=1 << 20, bytes_per_sample=1)


def test_logged_loss_and_metrics_are_the_steps_as_in_the_uncut_run(tmp_path: Path) -> None:
    data = TokenDataset(long_tailed_lengths(64, median=24, max_len=128, seed=3))
    uncut, cut = TokenLM(data, batch_size=32), TokenLM(data, batch_size=8)
    uncut_log, cut_log = Memory(), Memory()
    fit(uncut, [], tmp_path, logger=uncut_log, log_every_n_steps=1)
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000, loss_weight="tokens")
    fit(cut, [dyn], tmp_path, logger=cut_log, log_every_n_steps=1, accumulate_grad_batches=4)
    assert len(cut.runs) > 2 * len(uncut.runs)  # the steps did run as several micro-batches, shortest last
    for key in ("train_loss_step", "label_tokens", "train_loss_epoch"):
        want, got = uncut_log.series(key), cut_log.series(key)
        assert [step for step, _ in got] == [step for step, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5), key
    # the step's token mean, counted by hand from the first step's batch with the module's initial weights
    first = lm_collator()([data[i] for i in range(32)])
    torch.manual_seed(0)
    emb, head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
    logits = head(emb(first["input_ids"])).flatten(0, 1)
    nll = nn.functional.cross_entropy(logits, first["labels"].flatten(), reduction="none")
    labelled = first["labels"].flatten() != -100
    assert cut_log.series("train_loss_step")[0][1] == pytest.approx(float(nll[labelled].mean()), rel=1e-5)
    assert cut_log.series("label_tokens")[0][1] == int(labelled.sum())


def test_padding_is_trimmed_without_a_memory_target(tmp_path: Path) -> None:
    lengths = long_tailed_lengths(64, median=32, max_len=256, seed=5)
    data = TokenDataset(lengths)
    fixed = TokenLM(data, batch_size=8)
    fit(fixed, [], tmp_path, logger=False, accumulate_grad_batches=8)
    trimmed, logger = TokenLM(data, batch_size=8), Memory()
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=1, gpu_stats=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(trimmed, [lt.DynamicBatchSize(), monitor], tmp_path, logger=logger, accumulate_grad_batches=8)
    collated = 1 - fixed.real / fixed.padded  # the DataLoader's batches of 8, each padded to its longest
    share = 1 - trimmed.real / trimmed.padded
    assert trimmed.real == fixed.real == sum(lengths)
    assert share < 0.5 * collated, (share, collated)
    assert collections.Counter(trimmed.seen) == collections.Counter(fixed.seen)  # every sample once
    logged = logger.series(keys.PADDING_FRAC)
    assert len(logged) == 1 and logged[0][1] == pytest.approx(share)  # the one step of 64 samples
    said = [str(w.message) for w in caught if "no device memory to target" in str(w.message)]
    assert len(said) == 1 and "padding is still trimmed" in said[0]


class CountSteps(Callback):
    """Counts by hand the micro-batches (training_step calls) and samples of each optimizer step."""

    def __init__(self, module: TokenLM) -> None:
        self.module, self.per_step = module, []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.per_step.append((len(self.module.runs), sum(self.module.runs)))


def test_batches_per_sec_counts_micro_batches(tmp_path: Path) -> None:
    module, logger = TokenLM(TokenDataset(long_tailed_lengths(128, median=32, max_len=256, seed=6)), 8), Memory()
    count = CountSteps(module)
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4, gpu_stats=False)
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000)
    fit(module, [dyn, monitor, count], tmp_path, logger=logger, accumulate_grad_batches=4)
    micro_batches, samples = count.per_step[-1]
    assert micro_batches > 4 and samples == 128  # 4 steps of 32 samples, cut in several micro-batches
    (_, batches), (_, per_sec) = logger.series(keys.BATCHES_PER_SEC)[0], logger.series(keys.SAMPLES_PER_SEC)[0]
    # one logging interval of all four steps: the rates share its seconds, so their ratio is the counts'
    assert batches / per_sec == pytest.approx(micro_batches / samples, rel=1e-9)


def test_out_of_memory_messages_name_their_unit(tmp_path: Path) -> None:
    probe = lt.SimulatedMemory(total_bytes=20_000_000, fixed_bytes=2_000_000, bytes_per_sample=1, bytes_per_token=6000)
    dyn = lt.DynamicBatchSize(target_vram=0.9, probe=probe, adjust_every=1000)
    module = TokenLM(TokenDataset([1000] * 8 + [8] * 24), batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, [dyn], tmp_path, logger=False, accumulate_grad_batches=4, max_steps=1)
    texts = [str(w.message) for w in caught if "out of memory at" in str(w.message)]
    assert texts and dyn.oom_recoveries == len(texts)
    assert all(
        text.startswith("DynamicBatchSize: out of memory at a micro-batch of ")
        and " padded tokens (simulated out of memory: micro-batch of " in text
        and text.endswith(" padded tokens")
        for text in texts
    ), texts
