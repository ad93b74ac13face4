"""End-to-end demo: train :class:`~lightning_tune.demos.gpt.DemoGPT` on synthetic tokens with the pack's callbacks."""

from __future__ import annotations

import math
import os
import shlex
import time
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_tune as lt
from lightning_tune._validation import MAX_SEED, check_bool, check_int, check_writable_dir
from lightning_tune.demos.data import SyntheticTokenDataModule
from lightning_tune.demos.gpt import DemoGPT, GPTConfig
from lightning_tune.perf.devices import describe_device
from lightning_tune.vocab import auto_precision, canonical_precision, check_precision_device

#: Learning rate of the demo model; the warmup-cosine schedule decays it to a tenth.
DEMO_LR = 3e-3
#: Sequences in the demo's training split: also the largest batch it can make.
TRAIN_SEQUENCES = 4096
#: The most optimizer steps a demo runs (about half a day on two CPU cores).
MAX_STEPS = 1_000_000
#: The device the demo simulates when there is no GPU: 1 GiB, 600 MiB of it fixed.
SIMULATED_TOTAL_BYTES = 1 << 30
SIMULATED_FIXED_BYTES = 600 << 20


@dataclass(frozen=True)
class DemoSummary:
    """What a :func:`run_demo` run did.

    Args:
        start_loss: Mean training loss over the first few steps (nats/token).
        final_loss: Mean training loss over the last few steps (nats/token).
        entropy_floor: Lowest loss any model can reach on the synthetic data (nats/token).
        steps: Optimizer steps taken.
        seconds: Wall time of ``Trainer.fit`` (training and validation), in seconds.
        samples_per_sec: Training sequences processed per second of that wall time (by this process).
        log_dir: Directory holding this run's TensorBoard event files.
        device: The device trained on, e.g. ``"2 x cuda:0 (NVIDIA H100 80GB HBM3)"`` or ``"cpu (<CPU>, 2 threads)"``.
        perf: Whole-run figures of :class:`~lightning_tune.ThroughputLatencyMonitor` (``samples_per_sec``,
            ``tokens_per_sec``, ``step_ms_p50`` ..., ``data_wait_frac``, and on a GPU ``vram_peak_gib``, ``mfu``).
        batch: What :class:`~lightning_tune.DynamicBatchSize` did: ``start`` and ``final`` micro-batch sizes,
            ``oom_recoveries``, ``simulated`` (True off a GPU) and ``device_gib``; empty when it did not run.
    """

    start_loss: float
    final_loss: float
    entropy_floor: float
    steps: int
    seconds: float
    samples_per_sec: float
    log_dir: str
    device: str
    perf: Mapping[str, float] = field(default_factory=dict)
    batch: Mapping[str, Any] = field(default_factory=dict)

    @property
    def loss_drop(self) -> float:
        """Fraction by which the training loss fell, ``1 - final_loss / start_loss`` (0.6 means 60 % lower)."""
        return 1.0 - self.final_loss / self.start_loss if self.start_loss > 0 else 0.0

    @property
    def tensorboard_command(self) -> str:
        """Shell command that opens TensorBoard on all runs next to this one."""
        return f"tensorboard --logdir {shlex.quote(str(Path(self.log_dir).parent))}"


class _LossTracker(Callback):
    """Record the training losses of the first and last ``window`` steps, and the samples trained on.

    Losses are kept as detached tensors and read only at the end, so tracking adds no device synchronisation.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.first: list[torch.Tensor] = []
        self.last: deque[torch.Tensor] = deque(maxlen=window)
        self.samples = 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            value = loss.detach()
            if len(self.first) < self.window:
                self.first.append(value)
            self.last.append(value)
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        if isinstance(inputs, torch.Tensor):
            self.samples += int(inputs.shape[0])

    @staticmethod
    def mean(values: Sequence[torch.Tensor]) -> float:
        """Mean of recorded losses, NaN when none were recorded."""
        return float(torch.stack(list(values)).float().mean()) if values else math.nan


def run_demo(
    *,
    max_steps: int = 300,
    batch_size: int = 32,
    accelerator: str = "auto",
    devices: int | str = 1,
    precision: str = "auto",
    seed: int = 0,
    default_root_dir: str | os.PathLike[str] = ".",
    enable_progress_bar: bool = True,
    extra_callbacks: Sequence[Callback] = (),
) -> DemoSummary:
    """Train a small GPT on synthetic tokens with the pack's callbacks and summarise it: ``fit_demo(prepare_demo())``.

    The arguments are those of :func:`prepare_demo`, which describes the run, each argument and its errors.
    """
    return fit_demo(prepare_demo(**locals()))  # the arguments, and only they, are the local names here


@dataclass(frozen=True)
class DemoRun:
    """Everything :func:`fit_demo` needs; built (and validated) by :func:`prepare_demo`."""

    trainer: pl.Trainer
    model: DemoGPT
    datamodule: SyntheticTokenDataModule
    tracker: _LossTracker
    monitor: lt.ThroughputLatencyMonitor
    dynamic: lt.DynamicBatchSize | None
    logger: TensorBoardLogger


def prepare_demo(
    *,
    max_steps: int = 300,
    batch_size: int = 32,
    accelerator: str = "auto",
    devices: int | str = 1,
    precision: str = "auto",
    seed: int = 0,
    default_root_dir: str | os.PathLike[str] = ".",
    enable_progress_bar: bool = True,
    extra_callbacks: Sequence[Callback] = (),
) -> DemoRun:
    """Validate the arguments and build the demo's Trainer, model and data; :func:`fit_demo` trains them.

    A small GPT on synthetic Markov-chain tokens under ``WarmupCosine`` and ``AdaptiveLROnPlateau`` (``docs/cli.md``
    says what the run does); TensorBoard logs go to ``<default_root_dir>/lightning_logs/version_N``.

    Args:
        max_steps: Optimizer steps to train, in ``[1, MAX_STEPS]`` (a million).
        batch_size: Sequences (of 64 tokens) per batch, in ``[1, TRAIN_SEQUENCES]`` (4096, the training split).
        accelerator: Lightning accelerator name (``"auto"``, ``"cpu"``, ``"gpu"``, ``"cuda"``, ``"mps"``).
        devices: Lightning ``devices`` (a count, ``"auto"`` or a device list such as ``"0,1"``).
        precision: Lightning precision or an alias such as ``"bf16"``; ``"auto"`` is decided for the device as
            ``docs/cli.md`` says. ``"16-mixed"`` needs a CUDA GPU.
        seed: Global seed (model init, data, shuffling), in ``[0, 2**32 - 1]``.
        default_root_dir: Directory under which ``lightning_logs`` is created: not empty, through no existing file,
            and made (and written to once) here, so that one that cannot be is refused before training.
        enable_progress_bar: Show Lightning's progress bar and model summary.
        extra_callbacks: More callbacks to add to the Trainer (e.g. other callbacks of the pack).

    Raises:
        TypeError: If an argument has the wrong type or ``extra_callbacks`` holds something that is not a Callback.
        ValueError: If an argument is out of range, the precision cannot train on the device (``"16-mixed"`` on a
            CPU) or ``default_root_dir`` cannot be made or written.
        lightning.fabric.utilities.exceptions.MisconfigurationException: If Lightning rejects the
            accelerator/devices/precision combination (e.g. ``accelerator="gpu"`` on a machine without one).

    Example:
        >>> import tempfile
        >>> demo = prepare_demo(max_steps=1, batch_size=2, accelerator="cpu", default_root_dir=tempfile.mkdtemp())
        >>> demo.trainer.precision, demo.datamodule.batch_size  # "auto" on a CPU
        ('32-true', 2)
    """
    check_int("max_steps", max_steps, minimum=1, maximum=MAX_STEPS)
    check_int("batch_size", batch_size, minimum=1)
    if batch_size > TRAIN_SEQUENCES:
        raise ValueError(
            f"`batch_size` must be at most {TRAIN_SEQUENCES} (the sequences of the demo's training split), "
            f"got {batch_size!r}"
        )
    check_int("seed", seed, minimum=0, maximum=MAX_SEED)
    check_bool("enable_progress_bar", enable_progress_bar)
    if not isinstance(accelerator, str):
        raise TypeError(f"`accelerator` must be a string such as 'auto' or 'cpu', got {accelerator!r}")
    if isinstance(devices, bool) or not isinstance(devices, (int, str)):
        raise TypeError(f"`devices` must be an integer or a string such as 'auto', got {devices!r}")
    precision = canonical_precision(precision)
    _check_root_dir(default_root_dir)
    callbacks = list(extra_callbacks)
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise TypeError(f"`extra_callbacks` must hold Lightning Callbacks, got {callback!r}")

    pl.seed_everything(seed, workers=True, verbose=False)
    config = GPTConfig()
    datamodule = SyntheticTokenDataModule(
        batch_size,
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        train_sequences=TRAIN_SEQUENCES,
        val_sequences=128,
        seed=seed,
    )
    model = DemoGPT(config, lr=DEMO_LR)
    tracker = _LossTracker(window=max(1, min(10, max_steps // 5)))
    monitor = lt.ThroughputLatencyMonitor()
    on_cuda = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    if precision == "auto":
        precision = auto_precision("cuda" if on_cuda else "cpu")
    if accelerator == "cpu" or not (on_cuda or accelerator == "mps" or torch.backends.mps.is_available()):
        check_precision_device(precision, "cpu")  # Lightning would only warn and train in bf16-mixed
    # On a GPU against its memory; elsewhere against a simulated 1 GiB device sized so that the requested batch does
    # not fit: the run shows an out-of-memory error recovered, a probe, and the batch settling under the 90 % target.
    # A batch of 1 cannot be shown shrinking.
    dynamic = None
    if on_cuda:
        dynamic = lt.DynamicBatchSize(target_vram=0.9, adjust_every=10, multiple_of=4)
    elif batch_size >= 2:
        per_sample = math.ceil((SIMULATED_TOTAL_BYTES - SIMULATED_FIXED_BYTES) / (0.8 * batch_size))
        memory = lt.SimulatedMemory(SIMULATED_TOTAL_BYTES, SIMULATED_FIXED_BYTES, per_sample)
        dynamic = lt.DynamicBatchSize(target_vram=0.9, adjust_every=10, multiple_of=4, probe=memory)
    root = os.fspath(default_root_dir)
    logger = TensorBoardLogger(save_dir=root, name="lightning_logs", default_hp_metric=False)
    # A one-step run has no room for a warm-up (the schedule needs warm-up < total steps).
    warmup: dict[str, Any] = {"warmup_ratio": 0.1} if max_steps > 1 else {"warmup_steps": 0}
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        precision=precision,  # type: ignore[arg-type]
        max_steps=max_steps,
        val_check_interval=max(1, max_steps // 5),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=max(1, min(10, max_steps // 20)),
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=enable_progress_bar,
        enable_model_summary=enable_progress_bar,
        default_root_dir=root,
        callbacks=[
            lt.WarmupCosine(**warmup, min_lr=DEMO_LR / 10),
            lt.AdaptiveLROnPlateau(monitor="val_loss", patience=2),
            monitor,
            tracker,
            *([dynamic] if dynamic is not None else []),
            *callbacks,
        ],
    )
    return DemoRun(trainer, model, datamodule, tracker, monitor, dynamic, logger)


def _check_root_dir(root: Any) -> None:
    """Refuse a log directory that is not a path, is empty, or runs through an existing file."""
    if isinstance(root, bool) or not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"`default_root_dir` must be a path, got {root!r} ({type(root).__name__})")
    text = os.fspath(root)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"`default_root_dir` must be a directory path (use '.' for the current one), got {text!r}")
    path = Path(text)
    existing = next((part for part in (path, *path.parents) if part.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"`default_root_dir` {text!r} cannot be a directory: {str(existing)!r} is a file")
    # made now, so that a directory that cannot hold the logs fails before training and not in the logger
    check_writable_dir(path, f"`default_root_dir` {text!r} cannot hold the logs")


def cpu_threads(current: int) -> int:
    """The intra-op threads the demo trains with on a CPU: ``current``, less the cores busy over the last minute.

    Its matrices are small, so a thread sharing a core costs far more than it brings (on two loaded cores, 50 steps
    took 46.5 s with one thread and 400 s with two). ``OMP_NUM_THREADS`` overrides it. At least 1.
    """
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "getloadavg"):
        return current
    idle = (os.cpu_count() or 1) - int(os.getloadavg()[0])
    return max(1, min(current, idle))


def fit_demo(run: DemoRun) -> DemoSummary:
    """Train a demo built by :func:`prepare_demo` and summarise it.

    On a CPU it trains with :func:`cpu_threads` threads unless ``OMP_NUM_THREADS`` is set.
    """
    root = run.trainer.strategy.root_device
    threads = torch.get_num_threads()
    if root.type == "cpu":
        torch.set_num_threads(cpu_threads(threads))
    try:
        with warnings.catch_warnings():
            # The data is generated in memory, so worker processes would only add start-up cost.
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            start = time.perf_counter()
            run.trainer.fit(run.model, datamodule=run.datamodule)
            seconds = time.perf_counter() - start
            device = describe_device(root)  # names the threads it trained with
    finally:
        torch.set_num_threads(threads)
    batch = {}
    dynamic = run.dynamic
    if dynamic is not None and dynamic.batch_size is not None and dynamic.probe is not None:
        batch = {
            "start": run.datamodule.batch_size,
            "final": dynamic.batch_size,
            "oom_recoveries": dynamic.oom_recoveries,
            "simulated": isinstance(dynamic.probe, lt.SimulatedMemory),
            "device_gib": dynamic.probe.total_bytes() / (1 << 30),
        }
    tracker, devices = run.tracker, run.trainer.num_devices
    return DemoSummary(
        start_loss=tracker.mean(tracker.first),
        final_loss=tracker.mean(tracker.last),
        entropy_floor=run.datamodule.entropy_floor,
        steps=int(run.trainer.global_step),
        seconds=seconds,
        samples_per_sec=tracker.samples / seconds if seconds > 0 else math.nan,
        log_dir=str(run.logger.log_dir),
        device=(f"{devices} x " if devices > 1 else "") + device,
        perf=dict(run.monitor.summary),
        batch=batch,
    )
