"""Small deterministic modules and probes shared by the tests."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, features: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=g))


class Regressor(LightningModule):
    """A plain module: its own optimizer, no scheduler, nothing of lightning_tune in it."""

    def __init__(
        self,
        *,
        lr: float = 0.05,
        group_lrs: Sequence[float] | None = None,
        optimizer: str = "sgd",
        batch_size: int = 4,
        n: int = 64,
        val_losses: Sequence[float] | None = None,
        scheduler: bool = False,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr
        self.group_lrs = group_lrs
        self.optimizer_name = optimizer
        self.batch_size = batch_size
        self.n = n
        self.val_losses = list(val_losses) if val_losses is not None else None
        self.with_scheduler = scheduler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        if self.val_losses is not None:
            value = torch.tensor(self.val_losses[min(self.current_epoch, len(self.val_losses) - 1)])
        else:
            value = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", value, on_epoch=True, batch_size=len(x))

    def configure_optimizers(self) -> Any:
        if self.group_lrs is not None:
            params: Any = [
                {"params": self.net[0].parameters(), "lr": self.group_lrs[0]},
                {"params": self.net[2].parameters(), "lr": self.group_lrs[1]},
            ]
        else:
            params = self.parameters()
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=self.lr)
        if self.with_scheduler:
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5)}
        return opt

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(self.n), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(16, seed=1), batch_size=8)


class LRRecorder(Callback):
    """Records, at every real optimizer step, the LR (and momentum) of every parameter group it is about to use."""

    def __init__(self) -> None:
        self.lrs: list[list[float]] = []
        self.momenta: list[list[float]] = []
        self.batches: int = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        self.momenta.append(
            [float(g["betas"][0]) if "betas" in g else float(g.get("momentum", 0.0)) for g in optimizer.param_groups]
        )


def make_trainer(tmp_path: Any, callbacks: Sequence[Callback], **kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = {
        "default_root_dir": str(tmp_path),
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "deterministic": True,
    }
    defaults.update(kwargs)
    return Trainer(callbacks=list(callbacks), **defaults)


def fit(
    module: LightningModule,
    callbacks: Sequence[Callback],
    tmp_path: Any,
    *,
    ckpt_path: str | None = None,
    **kwargs: Any,
) -> Trainer:
    """``module`` fitted by :func:`make_trainer`'s Trainer, for one epoch unless ``kwargs`` say otherwise."""
    trainer = make_trainer(tmp_path, callbacks, **{"max_epochs": 1, **kwargs})
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def csv_rows(log_dir: str) -> list[dict[str, str]]:
    """Rows of the ``metrics.csv`` a ``CSVLogger`` wrote."""
    with open(Path(log_dir) / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


ROOT = Path(__file__).resolve().parents[1]


def launch_two_ranks(out: Path, *scenarios: str, timeout: float = 900) -> dict[str, list[Any]]:
    """Run ``scenarios`` of ``tests/scripts/two_ranks.py`` (all CPU ones if none) in one 2-process launch on CPU.

    Returns each scenario's two ranks' results; a launch that fails or hangs (killed with both ranks) fails the test.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "two_ranks.py"), str(out), *scenarios]
    proc = subprocess.Popen(
        command, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0 leads the session: its rank-1 child goes too
        output, _ = proc.communicate()
        raise AssertionError(f"the 2-process launch did not finish in {timeout} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, output[-4000:]
    ran = [path for path in sorted(out.iterdir()) if path.is_dir() and (not scenarios or path.name in scenarios)]
    return {path.name: [_read_rank(path / f"rank{rank}.json") for rank in (0, 1)] for path in ran}


def _read_rank(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else {"error": f"{path.name} was not written"}


def finish_ddp(out: Path, rank: int, payload: Any) -> None:
    """Write one rank's results, then wait for the other rank (the launch tears the gloo group down at its end)."""
    import torch.distributed as dist

    (out / f"rank{rank}.json").write_text(json.dumps(payload))
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def alarm(seconds: int = 10) -> Iterator[None]:
    """Fail the test, instead of hanging, when the block runs over ``seconds`` (main thread, POSIX)."""

    def expire(*_: object) -> None:
        raise AssertionError(f"over {seconds} s")  # not an OSError, which a command would report as a usage error

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
