"""A run under DynamicBatchSize stopped anywhere and resumed from any checkpoint Lightning writes is the whole run.

Each row resumes a two-epoch run from one of its checkpoints and compares every step after it with the
uninterrupted run: the samples in the order trained, the LR, the micro-batch, and the final weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, ModelCheckpoint

import lightning_tune as lt
from lightning_tune.batch.sampler import ResizableBatchSampler
from tests.batch.test_dynamic_batch import Net, fit, sim
from tests.batch.test_dynamic_batch_varlen import LM, tiny_gpt2
from tests.hf_data import TokenDataset, lm_collator, long_tailed_lengths

N, LOADER_BATCH, ACCUMULATE, EPOCHS = 64, 4, 2, 2  # 8 optimizer steps of 8 samples per epoch
Step = tuple[int, list[int], float, int]  # epoch, samples in the order trained, LR, micro-batch
# Bytes a sample in a 10 kB device with 2 kB fixed. At 1000 the micro-batch moves from the DataLoader's 4 towards 7.
# At 2500 the first step runs out of memory at 4 and goes on at 2: with keep="none" (steps of 2 x 2 samples) epoch 0
# has 15 steps and epoch 1 has 16.
PER_SAMPLE = {"effective": 1000, "lr": 1000, "none": 2500}


class Trace(Callback):
    """Every optimizer step's epoch, samples (by index, in order), LR and micro-batch, by global step."""

    def __init__(self, dyn: lt.DynamicBatchSize) -> None:
        self.dyn, self.lr = dyn, 0.0
        self.steps: dict[int, Step] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self.lr = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.dyn.batch_size is not None
        self.steps[trainer.global_step] = (trainer.current_epoch, batch[2].tolist(), self.lr, self.dyn.batch_size)


def run(
    shuffle: bool, keep: str, root: Path, *, ckpt_path: Path | None = None, max_batch_size: int | None = None
) -> tuple[Trace, Net, list[str]]:
    """Fit two epochs (with a checkpoint after every step and every epoch, unless resuming from ``ckpt_path``)."""
    dyn = lt.DynamicBatchSize(
        adjust_every=5,
        multiple_of=2,
        keep=keep,
        max_batch_size=max_batch_size,
        probe=sim(per_sample=PER_SAMPLE[keep]),  # type: ignore[arg-type]
    )
    trace, model = Trace(dyn), Net(batch_size=LOADER_BATCH, n=N, shuffle=shuffle)
    callbacks: list[Callback] = [dyn, lt.WarmupCosine(warmup_ratio=0.25, min_lr=1e-3), trace]
    if ckpt_path is None:
        callbacks += [
            ModelCheckpoint(dirpath=root / "step", every_n_train_steps=1, save_top_k=-1),
            ModelCheckpoint(dirpath=root / "epoch", save_top_k=-1),  # at each epoch's end, after its last step's
        ]
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            model,
            callbacks,
            root,
            max_epochs=EPOCHS,
            accumulate_grad_batches=ACCUMULATE,
            enable_checkpointing=ckpt_path is None,
            ckpt_path=ckpt_path,
        )
    return trace, model, [str(w.message) for w in caught if "DynamicBatchSize" in str(w.message)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool, str], tuple[Trace, Net, Path]]:
    """The uninterrupted run of each configuration, once, with its checkpoints."""
    done: dict[tuple[bool, str], tuple[Trace, Net, Path]] = {}

    def get(shuffle: bool, keep: str) -> tuple[Trace, Net, Path]:
        if (shuffle, keep) not in done:
            root = tmp_path_factory.mktemp(f"whole-{shuffle}-{keep}")
            trace, model, _ = run(shuffle, keep, root)
            done[shuffle, keep] = trace, model, root
        return done[shuffle, keep]

    return get


def checkpoint(root: Path, trace: Trace, where: str) -> tuple[Path, int]:
    """The checkpoint file for ``where`` and the global step it was taken at."""
    last_of_epoch_0 = max(step for step, (epoch, *_) in trace.steps.items() if epoch == 0)
    step, folder = {
        "step-at-epoch-end": (last_of_epoch_0, "step"),  # by step, at the epoch's last step (saved in the batch end)
        "mid-epoch": (5, "step"),
        "epoch-end": (last_of_epoch_0, "epoch"),  # by epoch, at its end
    }[where]
    path = root / folder / f"epoch={trace.steps[step][0]}-step={step}.ckpt"
    assert path.exists(), sorted(p.name for p in (root / folder).iterdir())
    return path, step


def weights(model: Net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


ROWS = [
    pytest.param(where, shuffle, keep, id=f"{where}-{'shuffled' if shuffle else 'in-order'}-keep-{keep}")
    for keep, shuffles, wheres in (
        ("effective", (False, True), ("step-at-epoch-end", "mid-epoch", "epoch-end")),
        ("lr", (True,), ("step-at-epoch-end", "mid-epoch")),
        ("none", (True,), ("step-at-epoch-end",)),  # the next epoch has more steps than the one saved
    )
    for shuffle in shuffles
    for where in wheres
]


@pytest.mark.parametrize(("where", "shuffle", "keep"), ROWS)
def test_a_resumed_run_is_the_uninterrupted_run(
    tmp_path: Path, whole: Callable[[bool, str], tuple[Trace, Net, Path]], where: str, shuffle: bool, keep: str
) -> None:
    full, full_model, root = whole(shuffle, keep)
    assert {size for *_, size in full.steps.values()} != {LOADER_BATCH}  # the micro-batch did change
    assert len({lr for _, _, lr, _ in full.steps.values()}) > 8  # and the LR
    path, step = checkpoint(root, full, where)
    resumed, model, messages = run(shuffle, keep, tmp_path, ckpt_path=path)
    assert not messages
    expected = {s: v for s, v in full.steps.items() if s > step}
    assert list(resumed.steps) == list(expected)  # no step lost or repeated (the epoch after the checkpoint too)
    for s, (epoch, samples, lr, size) in expected.items():
        assert resumed.steps[s][:2] == (epoch, samples), f"step {s}: other samples or order"
        assert resumed.steps[s][2:] == pytest.approx((lr, size), rel=1e-12), f"step {s}: other LR or micro-batch"
    for ours, theirs in zip(weights(model), weights(full_model), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_a_new_max_batch_size_is_honoured_and_said(
    tmp_path: Path, whole: Callable[[bool, str], tuple[Trace, Net, Path]]
) -> None:
    full, full_model, root = whole(True, "effective")
    path, step = checkpoint(root, full, "mid-epoch")
    assert full.steps[step][3] > 2
    resumed, model, messages = run(True, "effective", tmp_path, ckpt_path=path, max_batch_size=2)
    assert messages == [
        "DynamicBatchSize: resumed with other arguments than the checkpoint's, which are used from here on: "
        f"max_batch_size None -> 2; micro-batch {full.steps[step][3]} -> 2"
    ]
    assert {size for *_, size in resumed.steps.values()} == {2}
    expected = {s: v for s, v in full.steps.items() if s > step}
    assert [v[:3] for v in resumed.steps.values()] == [v[:3] for v in expected.values()]  # samples, order, LR
    for ours, theirs in zip(weights(model), weights(full_model), strict=True):  # the same steps, cut finer
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*max_val.*", "ignore:.*steps_per_trial.*")
@pytest.mark.slow
def test_batch_size_finder_picks_the_starting_micro_batch(tmp_path: Path) -> None:
    """Lightning's BatchSizeFinder saves a checkpoint before its trials and restores it after them, mid-setup."""
    lengths = long_tailed_lengths(32, median=8, max_len=32, seed=2)
    module = LM(tiny_gpt2(64), TokenDataset(lengths), lm_collator(), batch_size=2)
    probe = lt.SimulatedMemory(
        total_bytes=60_000_000, fixed_bytes=8_000_000, bytes_per_sample=1, bytes_per_token=20_000
    )
    dyn = lt.DynamicBatchSize(loss_weight="tokens", adjust_every=100, probe=probe)
    finder = BatchSizeFinder(mode="power", max_trials=3, steps_per_trial=1)

    class First(Callback):
        sizes: list[int | None] = []

        def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.sizes.append(dyn.batch_size)

    first = First()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, [finder, dyn, first], tmp_path, accumulate_grad_batches=4, max_steps=1)
    assert not [w for w in caught if "DynamicBatchSize" in str(w.message)], [str(w.message) for w in caught]
    assert finder.optimal_batch_size == 2 * 2**2  # no memory limit on the CPU: three trials, 2, 4 and 8
    assert first.sizes[0] == finder.optimal_batch_size  # its pick is the first micro-batch
    assert dyn.effective_batch_size == 4 * finder.optimal_batch_size  # and the DataLoader batch held


def test_a_changed_keep_and_target_are_used_and_said(tmp_path: Path) -> None:
    def dyn(**kwargs: Any) -> lt.DynamicBatchSize:
        return lt.DynamicBatchSize(adjust_every=2, multiple_of=2, probe=sim(per_sample=1000), **kwargs)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = dyn(keep="lr")
    fit(Net(batch_size=4, n=N), [first, ckpt], tmp_path, max_steps=4, enable_checkpointing=True)
    second = dyn(keep="none", target_vram=0.5)
    lrs: list[float] = []

    class LR(Callback):
        def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
            lrs.append(optimizer.param_groups[0]["lr"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
        assert torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"][0]["lr"] != 0.05
        fit(Net(batch_size=4, n=N), [second, LR()], tmp_path, max_steps=8, ckpt_path=path)
    said = [str(w.message) for w in caught if "DynamicBatchSize: resumed" in str(w.message)]
    assert len(said) == 1 and "target_vram 0.9 -> 0.5, keep 'lr' -> 'none'" in said[0], said
    assert lrs == [0.05] * 4  # the LR the optimizer was configured with, no longer scaled to the batch


def test_a_seeded_sampler_draws_each_epoch_as_torch_does_from_seed_plus_epoch() -> None:
    own = torch.Generator().manual_seed(7)
    inner = torch.utils.data.RandomSampler(range(20), generator=own)
    batches = ResizableBatchSampler(inner, batch_size=3, seed=1000)
    state = own.get_state()
    for epoch in (0, 1, 5):
        batches.set_epoch(epoch)
        reference = torch.utils.data.RandomSampler(range(20), generator=torch.Generator().manual_seed(1000 + epoch))
        drawn = []
        for i, batch in enumerate(batches):
            drawn += batch
            batches.batch_size = 2 + i % 3  # resized mid-epoch: the same order
        assert drawn == list(reference)
    assert torch.equal(own.get_state(), state)  # the sampler's own generator is left as it was
    with pytest.raises(ValueError, match="`seed` must be"):
        ResizableBatchSampler(inner, batch_size=3, seed=-1)


def test_a_checkpoint_saved_before_the_epoch_was_recorded_does_not_skip_the_next_epoch(
    tmp_path: Path, whole: Callable[[bool, str], tuple[Trace, Net, Path]]
) -> None:
    """A checkpoint written by an earlier version (no ``epoch`` in the state) at an epoch's last step."""
    full, _, root = whole(False, "effective")
    path, step = checkpoint(root, full, "step-at-epoch-end")
    ckpt = torch.load(path, weights_only=False)
    (key,) = (k for k in ckpt["callbacks"] if k.startswith("DynamicBatchSize"))
    for name in ("epoch", "seed", "arguments"):
        ckpt["callbacks"][key].pop(name, None)
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    resumed, _, _ = run(False, "effective", tmp_path / "run", ckpt_path=old)
    expected = {s: v for s, v in full.steps.items() if s > step}
    assert list(resumed.steps) == list(expected)  # the whole second epoch is trained
    assert [resumed.steps[s][:2] for s in expected] == [v[:2] for v in expected.values()]
