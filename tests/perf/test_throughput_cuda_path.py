"""ThroughputLatencyMonitor's CUDA path on the CPU: what would make the host wait, and the fit's peak VRAM.

A real Trainer runs on the CPU while the monitor sees ``cuda:0``: ``torch.cuda``'s events, streams and allocator
counters are stand-ins that model a GPU running behind the host (an event completes a few marks after it was
recorded, and reading its time earlier is an error, as on CUDA) and that count every call that would block the host
on a GPU (event and stream synchronisations, ``torch.cuda.synchronize``, ``.item()``, ``.cpu()``, ``.tolist()``,
``float()``/``int()`` of a tensor, a blocking ``.to("cpu")``), every allocator and driver read and every NVML query.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_tune as lt
from lightning_tune.batch import CudaMemory

GIB = 1 << 30
LAG = 3  # marks the stand-in GPU runs behind the host
PADDED, REAL = 16, 11  # tokens a sample is padded to, and real tokens in it


def _from_package() -> bool:
    return sys._getframe(2).f_globals.get("__name__", "").startswith("lightning_tune.")


class CpuNamedCuda(SingleDeviceStrategy):
    """Trains on the CPU, while the package's code (and only it) reads ``cuda:0`` as the training device."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"), accelerator=CPUAccelerator())

    @property
    def root_device(self) -> torch.device:
        named = sys._getframe(1).f_globals.get("__name__", "").startswith("lightning_tune.")
        return torch.device("cuda", 0) if named else torch.device("cpu")


class StandInGpu:
    """``torch.cuda`` as the monitor uses it: events, streams, the caching allocator's counters and the driver."""

    def __init__(self) -> None:
        self.recorded = 0  # marks recorded so far; a mark's device time is its number, in ms
        self.completed = 0  # marks completed by a wait
        self.seen = 0  # the newest mark the host has seen complete
        self.events_made = 0
        self.queries = 0
        self.blocking: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.allocated = self.reserved = GIB
        self.peak = 100 * GIB  # earlier work of the process
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False, **_: Any) -> None:
                gpu.events_made += 1
                self.at = 0

            def record(self, stream: Any = None) -> None:
                gpu.recorded += 1
                self.at = gpu.recorded

            def query(self) -> bool:
                gpu.queries += 1
                if self.done:
                    gpu.seen = max(gpu.seen, self.at)
                return self.done

            @property
            def done(self) -> bool:
                return 0 < self.at <= max(gpu.recorded - LAG, gpu.completed)

            def synchronize(self) -> None:
                gpu.blocking["Event.synchronize"] += 1
                gpu.completed = gpu.seen = max(gpu.completed, self.at)

            def wait(self, stream: Any = None) -> None:
                gpu.blocking["Event.wait"] += 1

            def elapsed_time(self, end: Event) -> float:
                if not (self.done and end.done):
                    raise RuntimeError("CUDA error: device not ready")
                return float(end.at - self.at)

        class Stream:
            def synchronize(self) -> None:
                gpu.blocking["Stream.synchronize"] += 1

        self.Event, self.stream = Event, Stream()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        self.reads["memory_stats"] += 1
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak,
            "num_alloc_retries": 0,
        }

    def use(self, allocated: int) -> None:
        """The training step holds ``allocated`` bytes for a while."""
        self.allocated = self.reserved = allocated
        self.peak = max(self.peak, allocated)

    @contextmanager
    def installed(self) -> Iterator[StandInGpu]:
        def read(name: str, value: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.reads[name] += 1
                return value()

            return call

        def blocking(name: str, original: Any) -> Any:
            def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                to_host = name != "to" or (args[:1] == ("cpu",) and not kwargs.get("non_blocking", False))
                if to_host and _from_package():
                    self.blocking[f"Tensor.{name}"] += 1
                return original(tensor, *args, **kwargs)

            return call

        def sync(device: Any = None) -> None:
            self.blocking["torch.cuda.synchronize"] += 1

        def reset(device: Any = None) -> None:
            self.peak = self.allocated

        class Nvml:
            def __init__(self, device: torch.device) -> None:
                pass

            def sample(nvml) -> dict[str, float]:  # noqa: N805
                self.reads["nvml"] += 1
                return {"gpu_util_pct": 50.0, "gpu_mem_bw_pct": 20.0}

        cuda = "torch.cuda."
        patches = [
            mock.patch(cuda + "is_available", return_value=True),
            mock.patch(cuda + "Event", self.Event),
            mock.patch(cuda + "current_stream", return_value=self.stream),
            mock.patch(cuda + "synchronize", sync),
            mock.patch(cuda + "memory_stats", self.memory_stats),
            mock.patch(cuda + "memory_allocated", read("memory_allocated", lambda: self.allocated)),
            mock.patch(cuda + "memory_reserved", read("memory_reserved", lambda: self.reserved)),
            mock.patch(cuda + "max_memory_allocated", read("max_memory_allocated", lambda: self.peak)),
            mock.patch(cuda + "max_memory_reserved", read("max_memory_reserved", lambda: self.peak)),
            mock.patch(cuda + "mem_get_info", read("mem_get_info", lambda: (80 * GIB - self.reserved, 80 * GIB))),
            mock.patch(cuda + "reset_peak_memory_stats", reset),
            mock.patch("lightning_tune.callbacks.throughput.NvmlSampler", Nvml),
        ]
        for name in ("item", "cpu", "tolist", "__float__", "__int__", "to"):
            patches.append(mock.patch.object(torch.Tensor, name, blocking(name, getattr(torch.Tensor, name))))
        with ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            yield self


class Padded(Dataset):
    """Hugging Face collator-like samples: token ids, an attention mask with padding, -100 labels."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(PADDED) < REAL).long()
        ids = (torch.arange(PADDED) * 7 + index) % 32 * mask
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


class Tagger(LightningModule):
    def __init__(self, gpu: StandInGpu, uses: dict[int, int] | None = None) -> None:
        super().__init__()
        self.gpu, self.uses = gpu, uses or {}
        self.emb, self.head = nn.Embedding(32, 8), nn.Linear(8, 32)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.gpu.use(self.uses.get(self.global_step, GIB))
        logits = self.head(self.emb(batch["input_ids"]))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Padded(), batch_size=4)


class PerStep(Callback):
    """After the monitor's hooks of each step: what the step cost, and whether the monitor logged at it."""

    def __init__(self, gpu: StandInGpu, monitor: lt.ThroughputLatencyMonitor) -> None:
        self.gpu, self.monitor = gpu, monitor
        self.steps: list[dict[str, Any]] = []
        self._snapshot()

    def _snapshot(self) -> None:
        self._before = (Counter(self.gpu.blocking), Counter(self.gpu.reads), self.gpu.queries, self.gpu.seen)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        blocking, reads, queries, seen = self._before
        self.steps.append(
            {
                "logged": self.monitor._last_logged_step == trainer.global_step,
                "blocking": self.gpu.blocking - blocking,
                "reads": self.gpu.reads - reads,
                "queries": self.gpu.queries - queries,
                "pending": self.gpu.recorded - seen,
            }
        )
        self._snapshot()


def _fit(tmp_path: Path, gpu: StandInGpu, monitor: lt.ThroughputLatencyMonitor, steps: int, **kw: Any) -> PerStep:
    per_step = PerStep(gpu, monitor)
    trainer = Trainer(
        strategy=CpuNamedCuda(),
        callbacks=[monitor, per_step, *kw.pop("callbacks", [])],
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Tagger(gpu, kw.pop("uses", None)))
    return per_step


def test_no_step_makes_the_host_wait_for_the_gpu(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4, flops_per_batch=1e6, peak_flops=1e12)
    with StandInGpu().installed() as gpu:
        began = time.monotonic()
        per_step = _fit(tmp_path, gpu, monitor, steps=24)
        seconds = time.monotonic() - began
    logged = [s for s in per_step.steps if s["logged"]]
    assert len(per_step.steps) == 24 and len(logged) == 6
    for step in per_step.steps:
        assert sum(step["blocking"].values()) == 0, step
        if not step["logged"]:
            assert step["queries"] == 0 and not step["reads"], step
    for step in logged:
        # at most one query per pending mark (taken, and not yet seen complete), the allocator read once (torch's
        # memory_allocated() & co. each read all of memory_stats() again)
        assert step["queries"] <= step["pending"], step
        assert step["reads"]["memory_stats"] <= 1 and sum(step["reads"].values()) <= 3, step
    driver = sum(s["reads"]["mem_get_info"] for s in per_step.steps)
    assert sum(s["reads"]["nvml"] for s in per_step.steps) == driver <= 1 + seconds  # at most once a second
    assert gpu.events_made <= 2 * (2 * 4 + LAG)  # events are reused, not made per mark
    # the end of the fit waits once, and then every step is in, with the figures the device timed
    assert gpu.blocking == Counter({"Event.synchronize": 1})
    summary = monitor.summary
    assert summary["steps"] == 24 and summary["step_ms_p50"] == summary["step_ms_max"] == 1.0  # one ms a mark
    assert summary["data_wait_frac"] == 0.5
    assert summary["tokens_per_sec"] == pytest.approx(4 * REAL / 0.002)  # mask-counted: padding left out


def test_the_peak_vram_is_the_fits_across_interval_resets_and_not_the_previous_fits(tmp_path: Path) -> None:
    class IntervalReset(Callback):
        """DynamicBatchSize's probe starting a new measurement interval, between two logging steps."""

        def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 5:
                CudaMemory("cuda:0").reset_peak()

    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4, flops_per_batch=1e6, peak_flops=1e12)
    with StandInGpu().installed() as gpu:
        # the process peaked at 100 GiB before this fit; the fit at 6 GiB (step 3), then an interval reset
        _fit(tmp_path, gpu, monitor, steps=12, uses={3: 6 * GIB, 9: 3 * GIB}, callbacks=[IntervalReset()])
        assert monitor.summary["vram_peak_gib"] == 6.0
        _fit(tmp_path, gpu, monitor, steps=8, uses={2: 2 * GIB})  # a second fit in the same process
        assert monitor.summary["vram_peak_gib"] == 2.0
