"""Batches as real projects collate them: each trains exactly as Lightning alone, cut or not, or is refused at once.

Every row builds a dataset and a collate function of a kind found in real projects, and a module whose loss is a
mean over per-sample terms that depend on which target belongs to which sample. Lightning's own run (no callback)
is the reference: DynamicBatchSize must reach its weights when it cuts each step into micro-batches, and again
when the simulated device runs out of memory at the first step and the step runs again in smaller pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_tune as lt
from lightning_tune.perf.batch import count_samples
from tests.helpers import fit
from tests.hf_data import VOCAB, tokenizer

N = 20  # samples: two steps of 8 and a short one of 4


@dataclasses.dataclass(frozen=True)
class Case:
    """A dataset's samples, its collate function and how the module reads a batch.

    ``read(module, batch)`` returns per-sample features ``(n, 4)``, targets ``(n,)`` and weights ``(n,)``.
    """

    sample: Callable[[int, torch.Generator], Any]
    collate: Callable[[list[Any]], Any]
    read: Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    per_batch: tuple[str, ...] = ()
    split_batch: Callable[[Any, list[int]], list[Any]] | None = None


class Samples(Dataset):
    def __init__(self, case: Case) -> None:
        gen = torch.Generator().manual_seed(0)
        self.items = [case.sample(i, gen) for i in range(N)]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class Net(LightningModule):
    def __init__(self, case: Case, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.embed = nn.Embedding(VOCAB, 4)
        self.case, self.batch_size = case, batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y, w = self.case.read(self, batch)
        if not len(x):
            return None  # a step the collate left empty: Lightning skips it
        return (w * (self.net(x).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Samples(self.case), batch_size=self.batch_size, shuffle=False, collate_fn=self.case.collate)


# -- the rows -------------------------------------------------------------------------------------------------------
def _image(i: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    boxes = torch.rand(i % 3 + 1, 4, generator=gen)  # a different number of boxes per image
    return torch.randn(1, 2, 2, generator=gen), {"boxes": boxes, "labels": torch.arange(len(boxes))}


def _read_detection(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    images, targets = batch
    images = torch.stack(list(images)) if isinstance(images, tuple) else images
    assert len(images) == len(targets), "each image comes with its own target dict"
    y = torch.stack([t["boxes"].mean() for t in targets])
    return images.flatten(1), y, torch.tensor([float(len(t["labels"])) for t in targets])


def _hf_sample(i: int, gen: torch.Generator) -> dict[str, Any]:
    length = [3, 11, 5, 2, 8][i % 5]
    return {"input_ids": torch.randint(2, VOCAB, (length,), generator=gen).tolist(), "labels": i % 3}


def _read_hf(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert isinstance(batch, transformers.BatchEncoding)
    mask = batch["attention_mask"].unsqueeze(-1).float()
    x = (module.embed(batch["input_ids"]) * mask).sum(1) / mask.sum(1)
    return x, batch["labels"].float(), torch.ones(len(x))


def _read_audio(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    waves = batch["input_values"]
    x = torch.stack([torch.stack([w.mean(), w.std(), w.max(), w.min()]) for w in waves])
    return x, batch["labels"], torch.tensor([len(w) / 10 for w in waves])


def _xyw(i: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    return torch.randn(4, generator=gen), torch.randn((), generator=gen), i


def _stack(items: list[Any], at: int) -> torch.Tensor:
    return torch.stack([item[at] for item in items])


def _read_nested(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    (x, weights), targets = batch
    return x, targets["y"], weights["w"]


def _read_class_weights(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert batch["class_weights"].shape == (3,), "the class weights reach every micro-batch whole"
    return batch["x"], batch["y"].float(), batch["class_weights"][batch["y"]]


def _read_strings(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert batch["text"] == [f"sample {i}" for i in batch["id"]], "each string stays with its id"
    assert batch["split"] == "train"
    return batch["x"], batch["y"], torch.tensor([1.0 + i % 3 for i in batch["id"]])


def _read_ragged(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch["x"], batch["y"], torch.tensor([float(len(t)) for t in batch["tokens"]])


def _read_records(module: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.stack([r["x"] for r in batch])
    return x, torch.stack([r["y"] for r in batch]), torch.tensor([1.0 + r["id"] % 2 for r in batch])


@dataclasses.dataclass
class Graphs:
    """A batch object of the user's (as graph libraries collate): per-graph node features and a target each."""

    nodes: list[torch.Tensor]
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


def split_graphs(batch: Graphs, sizes: list[int]) -> list[Graphs]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [Graphs(batch.nodes[a : a + k], batch.y[a : a + k]) for a, k in zip(starts, sizes, strict=True)]


def _graph(i: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(i % 4 + 2, 4, generator=gen), torch.randn((), generator=gen)


def _read_graphs(module: Any, batch: Graphs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.stack([g.mean(0) for g in batch.nodes])
    return x, batch.y, torch.tensor([float(len(g)) for g in batch.nodes])


CASES = {
    "torchvision-detection": Case(
        _image, lambda items: (torch.stack([im for im, _ in items]), [t for _, t in items]), _read_detection
    ),
    "torchvision-reference-collate": Case(_image, lambda items: tuple(zip(*items, strict=True)), _read_detection),
    "hf-collator-dict": Case(_hf_sample, transformers.DataCollatorWithPadding(tokenizer()), _read_hf),
    "audio-variable-length": Case(
        lambda i, gen: (torch.randn(5 + 3 * (i % 4), generator=gen), torch.randn((), generator=gen)),
        lambda items: {"input_values": [w for w, _ in items], "labels": _stack(items, 1)},
        _read_audio,
    ),
    "nested-tuples-of-dicts": Case(
        _xyw,
        lambda items: (
            (_stack(items, 0), {"w": torch.tensor([1.0 + i % 2 for *_, i in items])}),
            {"y": _stack(items, 1)},
        ),
        _read_nested,
    ),
    "class-weights-declared": Case(
        _xyw,
        lambda items: {
            "class_weights": torch.tensor([1.0, 2.0, 0.5]),  # per batch, and first: not the sample count
            "x": _stack(items, 0),
            "y": torch.tensor([i % 3 for *_, i in items]),
        },
        _read_class_weights,
        per_batch=("class_weights",),
    ),
    "strings-and-ids": Case(
        _xyw,
        lambda items: {
            "x": _stack(items, 0),
            "y": _stack(items, 1),
            "text": [f"sample {i}" for *_, i in items],
            "id": [i for *_, i in items],
            "split": "train",
        },
        _read_strings,
    ),
    "ragged-lists": Case(
        _xyw,
        lambda items: {"x": _stack(items, 0), "y": _stack(items, 1), "tokens": [[7] * (i % 4 + 1) for *_, i in items]},
        _read_ragged,
    ),
    "list-of-sample-dicts": Case(_xyw, lambda items: [{"x": x, "y": y, "id": i} for x, y, i in items], _read_records),
    "user-batch-object-with-split_batch": Case(
        _graph,
        lambda items: Graphs([g for g, _ in items], _stack(items, 1)),
        _read_graphs,
        split_batch=split_graphs,
    ),
}


def assert_same_weights(ours: nn.Module, theirs: nn.Module) -> None:
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# the DataLoader's batch, accumulate_grad_batches, and the simulated device (None: no memory target)
SETTINGS = {
    "cut": (4, 2, None),  # micro-batches of the DataLoader's 4 samples, two per optimizer step of 8
    "oom": (8, 1, 3_000),  # 8 samples need 26,000 of 10,000 bytes: the first step runs out and runs again smaller
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_each_batch_structure_trains_as_lightning(tmp_path: Path, name: str, setting: str) -> None:
    case, (batch_size, accumulation, per_sample) = CASES[name], SETTINGS[setting]
    reference = Net(case, batch_size)
    fit(reference, [], tmp_path, accumulate_grad_batches=accumulation)
    probe = None if per_sample is None else lt.SimulatedMemory(10_000, 2_000, per_sample)
    declared = {"per_batch": case.per_batch} if case.per_batch else {}
    declared |= {"split_batch": case.split_batch} if case.split_batch else {}
    dyn = lt.DynamicBatchSize(probe=probe, multiple_of=2, adjust_every=1, **declared)
    model = Net(case, batch_size)
    fit(model, [dyn], tmp_path, accumulate_grad_batches=accumulation)
    assert (dyn.oom_recoveries > 0) == (probe is not None)
    assert dyn.batch_size is not None and dyn.batch_size < 8  # the steps of 8 samples were cut
    assert_same_weights(model, reference)


# -- refused at the first step -----------------------------------------------------------------------------------
REFUSED = [
    pytest.param(
        CASES["class-weights-declared"],
        ValueError,
        r"holds 8 samples \(as batch\['x'\].*but batch\['class_weights'\] has 3 rows.*per_batch=\['class_weights'\]",
        id="class-weights-undeclared",
    ),
    pytest.param(
        Case(
            lambda i, gen: (torch.randn(2, 4, generator=gen), torch.randn((), generator=gen)),
            lambda items: (torch.cat([x for x, _ in items]), torch.stack([y for _, y in items])),
            lambda module, batch: (batch[0][: len(batch[1])], batch[1], torch.ones(len(batch[1]))),
        ),
        ValueError,
        r"holds 16 samples \(as batch\[0\].*but batch\[1\] has 8 rows.*per_batch=\['batch\[1\]'\]",
        id="x-of-16-rows-labels-of-8",
    ),
    pytest.param(
        dataclasses.replace(CASES["user-batch-object-with-split_batch"], split_batch=None),
        TypeError,
        r"cannot cut batch, a Graphs: name it in `per_batch=`.*`split_batch=`",
        id="user-batch-object",
    ),
    pytest.param(
        Case(
            _xyw,
            lambda items: {"x": _stack(items, 0), "y": _stack(items, 1), "classes": ["cat", "dog", "bird"]},
            lambda module, batch: (batch["x"], batch["y"], torch.ones(len(batch["x"]))),
        ),
        ValueError,
        r"holds 8 samples .*but batch\['classes'\] has 3 items.*per_batch=\['classes'\]",
        id="list-of-another-length",
    ),
]


@pytest.mark.parametrize(("case", "error", "message"), REFUSED)
def test_a_batch_the_rule_cannot_cut_is_refused_at_the_first_step(
    tmp_path: Path, case: Case, error: type[Exception], message: str
) -> None:
    dyn = lt.DynamicBatchSize()
    with pytest.raises(error, match=message):
        trainer = Trainer(
            default_root_dir=tmp_path,
            callbacks=[dyn],
            max_epochs=1,
            accumulate_grad_batches=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
        )
        trainer.fit(Net(case, 4))
    assert trainer.global_step == 0


def test_a_per_batch_tensor_is_not_the_sample_count() -> None:
    """The position a resume starts from and the monitor's samples/s both count samples this way."""
    batch = CASES["class-weights-declared"].collate([_xyw(i, torch.Generator()) for i in range(32)])
    assert count_samples(batch) == 32


def _collate_strings(items: list[Any]) -> Any:
    return CASES["strings-and-ids"].collate(items)


# -- what the collate kept ---------------------------------------------------------------------------------------
def _filtered(keep: Callable[[int], bool]) -> Case:
    def collate(items: list[Any]) -> Any:
        kept = [item for item in items if keep(item[2])]
        if not kept:
            return {"x": torch.zeros(0, 4), "y": torch.zeros(0), "id": []}
        return {"x": _stack(kept, 0), "y": _stack(kept, 1), "id": [i for *_, i in kept]}

    return Case(_xyw, collate, lambda module, batch: (batch["x"], batch["y"], torch.ones(len(batch["x"]))))


@pytest.mark.parametrize(
    ("case", "batch_size", "accumulation"),
    [
        pytest.param(_filtered(lambda i: i % 3 != 0), 8, 1, id="filtering-collate"),
        pytest.param(_filtered(lambda i: i % 4 != 0), 4, 2, id="filtering-collate-accumulated"),
        pytest.param(_filtered(lambda i: not 8 <= i < 16), 8, 1, id="empty-step"),
        pytest.param(
            Case(
                _xyw, lambda items: None if items[0][2] == 8 else CASES["strings-and-ids"].collate(items), _read_strings
            ),
            8,
            1,
            id="collate-returns-none",
        ),
    ],
)
def test_a_collate_that_keeps_fewer_samples_trains_as_lightning(
    tmp_path: Path, case: Case, batch_size: int, accumulation: int
) -> None:
    def read(module: Any, batch: Any, inner: Callable[..., Any] = case.read) -> Any:
        return (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0)) if batch is None else inner(module, batch)

    case = dataclasses.replace(case, read=read)
    reference = Net(case, batch_size)
    fit(reference, [], tmp_path, accumulate_grad_batches=accumulation)
    dyn = lt.DynamicBatchSize(max_batch_size=2, multiple_of=2)
    model = Net(case, batch_size)
    fit(model, [dyn], tmp_path, accumulate_grad_batches=accumulation)
    assert dyn.step.consumed == N  # the epoch's position counts what the sampler drew
    assert_same_weights(model, reference)


def test_a_ragged_list_with_one_sample_as_long_as_the_batch_is_read_per_sample() -> None:
    """Whether a ragged list of ids is cut must not hang on one sample's length happening to be the sample count."""
    from lightning_tune.perf.batch import BatchLayout

    words = [[1, 2], [1, 2, 3, 4], [5], [6, 7, 8]]  # sample 1 holds as many ids as the batch has samples
    layout = BatchLayout()
    assert layout.samples({"ids": torch.zeros(4, 3), "words": words}) == 4
    assert layout.per_sample(("words",))  # cut with its samples, not refused and not sent whole
