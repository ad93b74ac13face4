"""Write the checkpoints of ``tests/test_checkpoint_compat.py``: two tiny runs of commit 5d2ad38, saved mid-epoch.

The checkpoints pin the format a release wrote, so that later code keeps loading it: they are made once, by the code
of commit 5d2ad38, and never again. To make them anew (from the repository root; the second tree is the one whose
package is imported, since Python puts the working directory first):

    git worktree add --detach ../at-5d2ad38 5d2ad38
    mkdir -p ../at-5d2ad38/tests/data && cp tests/data/make_checkpoint_5d2ad38.py ../at-5d2ad38/tests/data/
    (cd ../at-5d2ad38 && python -m tests.data.make_checkpoint_5d2ad38 "$OLDPWD/tests/data")
    git worktree remove --force ../at-5d2ad38

Each case trains the whole run and saves one checkpoint mid-epoch, after several batch-size decisions; the steps after
the checkpoint are the reference a resumed run must reproduce. The script checks that it ran what :data:`EXPECTED`
records (the state at the checkpoint and every step after it), so a run on other code fails and keeps no checkpoint.

- ``samples``: tensor batches ``(x, y, index)``, shuffled, DataLoader batch 4 x ``accumulate_grad_batches`` 2.
  DynamicBatchSize (``keep="effective"``, a simulated device) grows the micro-batch from 4; ``WarmupCosine`` sets
  the LR and ``AdaptiveLROnPlateau`` halves it at the end of epoch 1 (its metric is constant); saved in epoch 2.
- ``tokens``: Hugging Face causal-LM batches (the library's collator: right padding, ``attention_mask``, -100
  labels) of long-tailed lengths, with each sample's ``index``. DynamicBatchSize budgets micro-batches in padded
  tokens and weighs the losses by label tokens; ``WarmupCosine`` with a warm-up ratio; saved in the only epoch.

Both runs have a ``ThroughputLatencyMonitor``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_tune as lt
from tests.hf_data import VOCAB, TokenDataset, lm_collator, long_tailed_lengths

COMMIT = "5d2ad38"
#: Per case: the run (samples, DataLoader batch, accumulation, epochs, the step saved after, the LR schedule), and what
#: it did: the state at the checkpoint and, by global step after the optimizer step, every later step of the epoch
#: saved in: (samples trained, by index, in order; the LR used; the micro-batch; the token budget).
EXPECTED: dict[str, dict[str, Any]] = {
    "samples": {
        "n": 48,
        "loader_batch": 4,
        "accumulate": 2,
        "epochs": 3,
        "save_at": 14,
        "warmup_steps": 3,
        "total_steps": 18,
        "peak_lr": 0.02,
        "min_lr": 0.001,
        "plateau_scale": 0.5,
        "state": {
            "global_step": 14,
            "epoch": 2,
            "batch_size": 6,
            "decisions": 7,
            "micro_batch_tokens": None,
            "consumed": 16,
            "lr": 0.002875000000000001,
            "seen": [2, 7, 8, 10, 11, 12, 15, 18, 19, 23, 26, 29, 31, 37, 39, 42],
        },
        "after": {
            15: ([41, 32, 36, 30, 25, 0, 1, 20], 0.0020716296197954252, 6, None),
            16: ([17, 22, 21, 4, 35, 40, 47, 44], 0.0014071692767190001, 6, None),
            17: ([28, 33, 34, 43, 9, 46, 16, 45], 0.0009106590761976453, 6, None),
            18: ([6, 24, 14, 13, 5, 38, 3, 27], 0.000603798896514423, 6, None),
        },
    },
    "tokens": {
        "n": 96,
        "loader_batch": 4,
        "accumulate": 2,
        "epochs": 1,
        "save_at": 7,
        "warmup_steps": 3,
        "total_steps": 12,
        "peak_lr": 0.05,
        "min_lr": 0.0,
        "plateau_scale": 1.0,
        "state": {
            "global_step": 7,
            "epoch": 0,
            "batch_size": 3,
            "decisions": 3,
            "micro_batch_tokens": 64,
            "consumed": 56,
            "lr": 0.037500000000000006,
            "seen": [
                1,
                3,
                6,
                8,
                9,
                11,
                12,
                13,
                16,
                18,
                21,
                22,
                23,
                24,
                25,
                27,
                32,
                35,
                40,
                42,
                44,
                46,
                49,
                51,
                52,
                53,
                55,
                56,
                57,
                59,
                62,
                64,
                66,
                67,
                68,
                69,
                70,
                71,
                73,
                75,
                76,
                78,
                79,
                80,
                81,
                82,
                83,
                84,
                85,
                87,
                90,
                91,
                92,
                93,
                94,
                95,
            ],
        },
        "after": {
            8: ([72, 20, 39, 89, 60, 88, 41, 43], 0.029341204441673263, 2, 64),
            9: ([38, 48, 0, 14, 31, 86, 28, 77], 0.020658795558326743, 4, 64),
            10: ([19, 29, 26, 30, 17, 45, 4, 37], 0.012500000000000006, 4, 64),
            11: ([33, 47, 10, 15, 74, 63, 5, 34], 0.005848888922025553, 4, 64),
            12: ([58, 50, 2, 7, 65, 54, 61, 36], 0.0015076844803522923, 4, 64),
        },
    },
}


def checkpoint_name(case: str) -> str:
    return f"dynamic_batch_{case}_{COMMIT}.ckpt"


# -- the data and the modules --------------------------------------------------------------------------------------
class Points(Dataset):
    """Regression samples with their index: ``(x, y, index)``."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = self.x.sum(1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Indexed(Dataset):
    """A tokenizer's output with the sample's index (kept by the collator as a 1-D ``index`` tensor)."""

    def __init__(self, inner: TokenDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.inner[i], "index": i}


class Regression(LightningModule):
    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.case = case

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        self.log("plateau_metric", 1.0, on_step=False, on_epoch=True)  # never improves: one reduction per epoch end
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.case["peak_lr"])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Points(self.case["n"]), batch_size=self.case["loader_batch"], shuffle=True)


class TinyLM(LightningModule):
    """Embedding and output layer; the loss is the token mean over shifted labels, as a causal LM's."""

    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.case = case

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.case["peak_lr"])

    def train_dataloader(self) -> DataLoader:
        lengths = long_tailed_lengths(self.case["n"], median=12, sigma=0.8, max_len=64, seed=3)
        return DataLoader(
            Indexed(TokenDataset(lengths)), batch_size=self.case["loader_batch"], shuffle=True, collate_fn=lm_collator()
        )


# -- the callbacks, as both the run and its resumption configure them ----------------------------------------------
def callbacks(case: str) -> list[Callback]:
    """DynamicBatchSize, the schedule (and plateau), the monitor, in that order."""
    spec = EXPECTED[case]
    if case == "samples":
        probe = lt.SimulatedMemory(total_bytes=10_000, fixed_bytes=2_000, bytes_per_sample=1_000)
        dyn = lt.DynamicBatchSize(keep="effective", adjust_every=2, multiple_of=2, probe=probe)
        return [
            dyn,
            lt.WarmupCosine(warmup_steps=spec["warmup_steps"], min_lr=spec["min_lr"]),
            lt.AdaptiveLROnPlateau(monitor="plateau_metric", patience=0, factor=spec["plateau_scale"], min_lr=0.0),
            lt.ThroughputLatencyMonitor(window=4, log_every_n_steps=2),
        ]
    probe = lt.SimulatedMemory(total_bytes=400_000, fixed_bytes=40_000, bytes_per_sample=1, bytes_per_token=4_000)
    dyn = lt.DynamicBatchSize(keep="effective", adjust_every=2, loss_weight="tokens", label_shift=1, probe=probe)
    return [
        dyn,
        lt.WarmupCosine(warmup_ratio=spec["warmup_steps"] / spec["total_steps"]),
        lt.ThroughputLatencyMonitor(window=4, log_every_n_steps=2),
    ]


def module(case: str) -> LightningModule:
    return (Regression if case == "samples" else TinyLM)(EXPECTED[case])


def trainer(case: str, root: Path, extra: list[Callback]) -> Trainer:
    spec = EXPECTED[case]
    return Trainer(
        default_root_dir=root,
        callbacks=[*callbacks(case), *extra],
        max_epochs=spec["epochs"],
        accumulate_grad_batches=spec["accumulate"],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
    )


def sample_indices(batch: Any) -> list[int]:
    return (batch["index"] if isinstance(batch, Mapping) else batch[2]).tolist()


class Trace(Callback):
    """Every optimizer step, by global step after it: samples (by index, in order), LR used, micro-batch, budget."""

    def __init__(self) -> None:
        self.lr = 0.0
        self.steps: dict[int, tuple[list[int], float, int | None, int | None]] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self.lr = float(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        dyn = trainer.callbacks[0]  # type: ignore[attr-defined]
        self.steps[trainer.global_step] = (sample_indices(batch), self.lr, dyn.batch_size, dyn.micro_batch_tokens)


def cosine_lr(spec: dict[str, Any], step: int) -> float:
    """``WarmupCosine``'s documented LR of optimizer ``step`` (0-based), times the plateau's reduction."""
    peak, floor, warmup, total = spec["peak_lr"], spec["min_lr"], spec["warmup_steps"], spec["total_steps"]
    if step < warmup:
        return peak * step / warmup
    progress = min(step - warmup, total - warmup) / (total - warmup)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# -- making them ---------------------------------------------------------------------------------------------------
class SaveAt(Callback):
    """Save a checkpoint at the end of a given optimizer step, and the state a resumed run must show."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path
        self.state: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        trainer.save_checkpoint(self.path)
        dyn = trainer.callbacks[0]  # type: ignore[attr-defined]
        self.state = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "batch_size": dyn.batch_size,
            "decisions": dyn.decisions,
            "micro_batch_tokens": dyn.micro_batch_tokens,
            "consumed": dyn._consumed,
        }


def make(case: str, out: Path) -> None:
    spec = EXPECTED[case]
    path = out / checkpoint_name(case)
    save, trace = SaveAt(spec["save_at"], path), Trace()
    torch.manual_seed(0)
    trainer(case, out, [trace, save]).fit(module(case))
    epoch = save.state["epoch"]
    per_epoch = len(trace.steps) // spec["epochs"]
    seen = [i for s, v in trace.steps.items() if epoch * per_epoch < s <= spec["save_at"] for i in v[0]]
    state = {**save.state, "lr": trace.steps[spec["save_at"]][1], "seen": sorted(seen)}
    after = {s: v for s, v in trace.steps.items() if spec["save_at"] < s <= (epoch + 1) * per_epoch}
    print(f"{case!r}: state={state!r},\n  after={after!r},\n  {path.stat().st_size} bytes")
    if (spec["state"], spec["after"]) != (state, after):
        path.unlink()
        raise SystemExit(f"{case}: this run differs from EXPECTED (its checkpoint deleted); is this commit {COMMIT}?")


if __name__ == "__main__":
    if not Path(lt.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        raise SystemExit(f"run from the root of a worktree at {COMMIT}: lightning_tune is imported from {lt.__file__}")
    for name in EXPECTED:
        make(name, Path(sys.argv[1]))
