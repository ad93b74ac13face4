"""DynamicBatchSize sizes validation, test and predict batches to memory, and no out-of-memory error ends them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchmetrics
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_tune import DynamicBatchSize, SimulatedMemory
from lightning_tune.batch import BatchSizeController
from tests.helpers import make_trainer

VOCAB, LENGTH = 11, 6


def tokens(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    return TensorDataset(ids, (ids * 3 + 1) % VOCAB, torch.arange(n))


def injected_oom(samples: int) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({samples} samples, injected)")


class Tagger(LightningModule):
    """A per-token classifier; its evaluation steps run out of memory above ``fail_above`` samples."""

    def __init__(self, *, fail_above: int | None = None, val_batch: int = 16, lr: float = 0.2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)
        self.fail_above, self.val_batch, self.lr = fail_above, val_batch, lr
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=VOCAB)
        self.ppl = torchmetrics.text.Perplexity()
        self.seen: list[int] = []  # samples of each evaluation step call

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, target, _ = batch
        return nn.functional.cross_entropy(self(ids).flatten(0, 1), target.flatten())

    def _evaluate(self, batch: Any) -> torch.Tensor:
        ids, target, _ = batch
        self.seen.append(len(ids))
        if self.fail_above is not None and len(ids) > self.fail_above:
            raise injected_oom(len(ids))
        logits = self(ids)
        per_sample = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none").mean(1)
        self.log("val_loss", per_sample.mean(), on_epoch=True)
        self.acc.update(logits.argmax(-1), target)
        self.ppl.update(logits, target)
        self.log("val_acc", self.acc, on_epoch=True)
        self.log("val_ppl", self.ppl, on_epoch=True)
        return logits

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        ids, _, index = batch
        self.seen.append(len(ids))
        if self.fail_above is not None and len(ids) > self.fail_above:
            raise injected_oom(len(ids))
        return {"index": index, "logits": self(ids)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tokens(64, 0), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(tokens(203, 1), batch_size=self.val_batch)

    test_dataloader = val_dataloader

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(tokens(203, 2), batch_size=self.val_batch)


class Indices(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch_and_epoch")
        self.batches: list[list[int]] = []
        self.epoch: list[list[int]] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, *args: Any) -> None:
        assert prediction["index"].tolist() == list(batch_indices)  # the writer's indices are the batch's samples
        self.batches.append(list(batch_indices))

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        self.epoch = [list(b) for b in batch_indices[0]]


def finetune(**kwargs: Any) -> SimulatedMemory:
    """A device priced like a fine-tune: weights, gradients and AdamW state fixed; activations 3x cheaper without
    gradients (nothing kept for a backward)."""
    return SimulatedMemory(total_bytes=1000, fixed_bytes=400, bytes_per_sample=20, eval_bytes_per_sample=6, **kwargs)


def sizing(**kwargs: Any) -> DynamicBatchSize:
    return DynamicBatchSize(probe=finetune(), adjust_every=2, **kwargs)


def figures(trainer: Any) -> dict[str, float]:
    return {k: float(trainer.callback_metrics[k]) for k in ("val_loss", "val_acc", "val_ppl")}


@pytest.mark.parametrize(
    ("fail_above", "val_batch"),
    [
        pytest.param(None, 16, id="fits"),
        pytest.param(24, 16, id="grown-into-ooms"),
        pytest.param(24, 48, id="loader-batch-too-large"),
    ],
)
def test_validate_and_test_equal_the_loaders_batch(tmp_path: Any, fail_above: int | None, val_batch: int) -> None:
    plain = make_trainer(tmp_path, [], limit_val_batches=1.0, limit_test_batches=1.0)
    plain.validate(Tagger(), verbose=False)
    reference = figures(plain)
    callback = sizing()
    trainer = make_trainer(tmp_path, [callback], limit_val_batches=1.0, limit_test_batches=1.0)
    module = Tagger(fail_above=fail_above, val_batch=val_batch)
    with pytest.warns(UserWarning, match="out of memory evaluating") if fail_above else contextlib.nullcontext():
        trainer.validate(module, verbose=False)
    assert figures(trainer) == pytest.approx(reference, rel=1e-6, abs=1e-6)
    size = callback.metrics["tune/eval_batch_size"]
    assert size > 16 if fail_above is None else size <= fail_above  # grown above the loader's batch, or below the OOMs
    ran = [n for n in module.seen if fail_above is None or n <= fail_above]
    assert sum(ran) == 203  # each sample once
    trainer.test(module, verbose=False)
    assert figures(trainer) == pytest.approx(reference, rel=1e-6, abs=1e-6)


def test_fit_checkpoint_and_early_stopping_equal_the_plain_run(tmp_path: Any) -> None:
    def run(callbacks: list[Any], module: Tagger) -> tuple[Any, ModelCheckpoint, EarlyStopping]:
        checkpoint = ModelCheckpoint(dirpath=tmp_path / str(len(callbacks)), monitor="val_loss")
        stopping = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.2)
        trainer = make_trainer(
            tmp_path,
            [*callbacks, checkpoint, stopping],
            limit_val_batches=1.0,
            max_epochs=12,
            enable_checkpointing=True,
        )
        trainer.fit(module)
        return trainer, checkpoint, stopping

    plain, checkpoint, stopping = run([], Tagger(lr=0.5))
    callback = sizing()
    module = Tagger(lr=0.5, fail_above=40)
    with pytest.warns(UserWarning, match="out of memory evaluating"):
        sized, sized_checkpoint, sized_stopping = run([callback], module)
    assert float(sized_checkpoint.best_model_score) == pytest.approx(float(checkpoint.best_model_score), rel=1e-6)
    assert 0 < sized_stopping.stopped_epoch == stopping.stopped_epoch
    assert figures(sized) == pytest.approx(figures(plain), rel=1e-6, abs=1e-6)
    assert callback.step.evaluation["fit"].size > 16
    state = callback.state_dict()
    assert state["evaluation"]["fit"]["size"] == callback.step.evaluation["fit"].size
    assert state["arguments"]["size_eval"] is True


def test_predict_returns_every_sample_once_in_order(tmp_path: Any) -> None:
    plain = make_trainer(tmp_path, [])
    expected = plain.predict(Tagger())
    writer = Indices()
    callback = sizing()
    module = Tagger(fail_above=40)
    with pytest.warns(UserWarning, match="out of memory evaluating"):
        got = make_trainer(tmp_path, [callback, writer]).predict(module)
    assert got is not None and expected is not None
    assert torch.cat([p["index"] for p in got]).tolist() == list(range(203))
    logits = torch.cat([p["logits"] for p in got])
    torch.testing.assert_close(logits, torch.cat([p["logits"] for p in expected]))
    assert writer.epoch == writer.batches and [i for b in writer.batches for i in b] == list(range(203))
    assert len(got) == len(writer.batches) < len(expected)  # fewer, larger batches: one output per batch
    assert callback.metrics["tune/eval_batch_size"] > 16


def test_eval_batch_settles_above_training_micro_batch(tmp_path: Any) -> None:
    """Training holds 24 samples (400 + 20 x 24 <= 900); evaluation, 6 bytes a sample, 80 (400 + 6 x 80 <= 900)."""
    probe = finetune()

    class Big(Tagger):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(tokens(256, 0), batch_size=64)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(tokens(512, 1), batch_size=16)

    class Record(Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int | None, int]] = []  # decisions, size, simulated failures so far

        def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            sizer = callback.step.evaluation["fit"]
            self.seen.append((sizer.decisions, sizer.size, probe.out_of_memory_errors))

    callback, record = DynamicBatchSize(probe=probe, adjust_every=2), Record()
    make_trainer(tmp_path, [callback, record], limit_val_batches=1.0, max_epochs=2).fit(Big())
    final = callback.step.evaluation["fit"].size
    assert callback.batch_size == 24 and final is not None and final >= 1.8 * callback.batch_size
    settled = next(i for i, (_, size, _) in enumerate(record.seen) if all(s == final for _, s, _ in record.seen[i:]))
    decisions, _, failures = record.seen[settled]
    assert decisions <= 2  # from the training figures: one jump, one fitted line that holds
    assert record.seen[-1][2] == failures and callback.step.evaluation["fit"].oom_recoveries == 0


@pytest.mark.parametrize("limit", [pytest.param(5, id="int"), pytest.param(0.5, id="fraction")])
def test_limited_loaders_keep_their_batch(tmp_path: Any, limit: float) -> None:
    plain = make_trainer(tmp_path, [], limit_val_batches=limit)
    plain.validate(Tagger(), verbose=False)
    callback = sizing()
    trainer = make_trainer(tmp_path, [callback], limit_val_batches=limit)
    trainer.validate(Tagger(), verbose=False)
    assert figures(trainer) == pytest.approx(figures(plain), rel=1e-6, abs=1e-6)
    assert callback.metrics["tune/eval_batch_size"] == 16


def test_size_eval_false_leaves_evaluation_alone(tmp_path: Any) -> None:
    callback = sizing(size_eval=False)
    module = Tagger(fail_above=24, val_batch=32)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        make_trainer(tmp_path, [callback], limit_val_batches=1.0).validate(module, verbose=False)
    assert "tune/eval_batch_size" not in callback.metrics


def test_size_eval_is_checked() -> None:
    with pytest.raises(TypeError, match="`size_eval` must be True or False, got 'yes'"):
        DynamicBatchSize(size_eval="yes")  # type: ignore[arg-type]


def test_resumed_fit_starts_evaluation_at_the_saved_size(tmp_path: Any) -> None:
    first = sizing()
    trainer = make_trainer(tmp_path, [first], limit_val_batches=1.0, max_epochs=1, enable_checkpointing=True)
    trainer.fit(Tagger())
    saved = first.step.evaluation["fit"].size
    assert saved is not None and saved > 16
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    resumed, module = sizing(), Tagger()
    make_trainer(tmp_path, [resumed], limit_val_batches=1.0, max_epochs=2).fit(module, ckpt_path=path)
    assert module.seen[0] == saved  # its first evaluation batch
    changed = sizing(size_eval=False)
    with pytest.warns(UserWarning, match="size_eval True -> False"):
        make_trainer(tmp_path, [changed], limit_val_batches=1.0, max_epochs=2).fit(Tagger(), ckpt_path=path)


def test_sizer_cuts_a_failing_batch_once_per_sample() -> None:
    from lightning_tune.batch.evaluate import EvalSizer

    probe = finetune()
    controller = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=8)
    sizer = EvalSizer(controller, probe, lambda: (1000, 900.0), warn=lambda text: None)
    sizer.begin(loader_batch=120, samples=120, agree=list)
    seen: list[list[int]] = []
    with torch.no_grad():  # 120 x 6 + 400 > 1000: the probe fails the whole batch
        out = sizer.run(torch.arange(120), lambda piece: seen.append(piece.tolist()) or piece * 2)
    assert [i for piece in seen for i in piece] == list(range(120)) and out.tolist() == list(range(0, 240, 2))
    assert sizer.oom_recoveries == 1 and sizer.piece == 56


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        pytest.param([object(), object()], r"output \(object\)", id="object"),
        pytest.param([{"a": "x"}, {"a": "y"}], r"output\['a'\] \(str\)", id="nested"),
    ],
)
def test_join_refuses_what_it_cannot_join(outputs: list[Any], message: str) -> None:
    from lightning_tune.batch.evaluate import join_outputs

    with pytest.raises(TypeError, match=message):
        join_outputs(outputs, [1, 1])


def test_private_lightning_names_are_where_they_were() -> None:
    """The evaluation loops' loader, fetcher and results, and predict's index wrapper (Lightning 2.4 to 2.6)."""
    from lightning.pytorch.loops import _EvaluationLoop, _PredictionLoop
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    for loop in (_EvaluationLoop, _PredictionLoop):  # attributes their constructors set
        assert {"_combined_loader", "_data_fetcher"} <= set(loop.__init__.__code__.co_names)
    assert "_batch_sampler" in _IndexBatchSamplerWrapper.__init__.__code__.co_names
    assert {"batch", "batch_size"} <= set(_ResultCollection.__init__.__code__.co_names)


@pytest.mark.slow
def test_two_processes_agree_and_equal_the_plain_run(two_ranks: Callable[[str], list[Any]]) -> None:
    ranks, plain = two_ranks("eval_sized"), two_ranks("eval_plain")
    assert ranks[0]["sizes"] == ranks[1]["sizes"] and ranks[0]["eval_sizes"] == ranks[1]["eval_sizes"]
    assert max(ranks[0]["sizes"]) > 16 and ranks[1]["oom_recoveries"] >= 1 and ranks[0]["oom_recoveries"] == 0
    for ours, theirs in zip(ranks, plain, strict=True):
        for key in ("fitted", "validated"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-6)
        assert ours["best"] == pytest.approx(theirs["best"], rel=1e-6)
        assert ours["stopped_epoch"] == theirs["stopped_epoch"]
        assert ours["index"] == theirs["index"] and ours["logits"] == pytest.approx(theirs["logits"], abs=1e-6)
        assert (
            [i for b in ours["batch_indices"] for i in b]
            == ours["index"]
            == [i for b in ours["epoch_indices"] for i in b]
        )
    assert sorted(ranks[0]["index"] + ranks[1]["index"]) == list(range(203))  # predict: every sample once


def test_fit_logs_the_evaluation_batch(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import CSVLogger

    from tests.helpers import csv_rows

    logger, callback = CSVLogger(str(tmp_path), name="csv"), sizing()
    make_trainer(tmp_path, [callback], limit_val_batches=1.0, max_epochs=2, logger=logger).fit(Tagger())
    logger.save()
    logged = [float(row["tune/eval_batch_size"]) for row in csv_rows(logger.log_dir) if row.get("tune/eval_batch_size")]
    assert len(logged) == 2 and logged[-1] == callback.step.evaluation["fit"].size > 16  # once per validation


@pytest.mark.parametrize("shards", [(102, 101), (45, 43)])
def test_ranks_with_short_last_batches_of_different_sizes_take_one_decision(shards: tuple[int, int]) -> None:
    """Predict's sampler gives ranks 102 and 101 samples: their last batches differ in size, and a decision after one
    must still be one decision (on its own largest piece, a rank of 43 sized its next batch 42, the other 43)."""
    import threading

    from lightning_tune.batch.evaluate import EvalSizer

    barrier, posted = threading.Barrier(2, timeout=20), [[], []]

    def agree_for(rank: int) -> Callable[[Any], list[float]]:
        def agree(figures: Any) -> list[float]:  # all_reduce_max between two threads, blocking as a collective
            posted[rank] = list(figures)
            barrier.wait()
            agreed = [max(a, b) for a, b in zip(*posted, strict=True)]
            barrier.wait()
            return agreed

        return agree

    sizes: list[list[int | None]] = [[], []]

    def rank(r: int) -> None:
        controller = BatchSizeController(target=0.9, min_batch_size=1, max_batch_size=None, multiple_of=1)
        probe = SimulatedMemory(total_bytes=1000, fixed_bytes=400, bytes_per_sample=20, eval_bytes_per_sample=11)
        sizer = EvalSizer(controller, probe, lambda: (1000, 900.0), warn=lambda text: None)
        agree, data = agree_for(r), torch.arange(shards[r])
        sizer.begin(loader_batch=8, samples=shards[r], agree=agree)
        start = 0
        while start < shards[r]:
            with torch.no_grad():
                sizer.run(data[start : start + sizer.size], lambda piece: piece * 2)  # type: ignore[operator]
            start += sizer.size  # type: ignore[operator]
            sizer.batch_end(agree)
            sizes[r].append(sizer.size)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not barrier.broken, "the ranks called a different number of collectives"
    assert sizes[0] == sizes[1], sizes
