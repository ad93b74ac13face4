"""TrackedMemory: the real tensors of a run on a device of a given size, and DynamicBatchSize's decisions on them."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune.batch.runner import is_allocation_failure
from tests.helpers import make_trainer

VOCAB = 128


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run faster on one thread than on two busy ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gpt2(width: int = 64, seq: int = 32, layers: int = 2, **kwargs: Any) -> transformers.PretrainedConfig:
    """Without dropout, so that a step run again after a failure draws nothing different."""
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=2, n_positions=seq, **dropout, **kwargs
    )


def llama(width: int = 64, seq: int = 32, layers: int = 2, **kwargs: Any) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        **kwargs,
    )


class CausalLM(LightningModule):
    """A Hugging Face causal LM built from its config, fine-tuned with AdamW (every weight, unless ``adapt`` says)."""

    def __init__(
        self,
        config: transformers.PretrainedConfig,
        *,
        lr: float = 1e-3,
        adapt: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        self.model = adapt(model) if adapt is not None else model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def token_data(n: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of one length (micro-batches are counted in samples), labels the inputs (the model shifts them)."""
    ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


class Intervals(Callback):
    """At every step's end, before DynamicBatchSize decides: decisions so far, the micro-batch, the interval's peak."""

    def __init__(self, dyn: lt.DynamicBatchSize, memory: lt.TrackedMemory) -> None:
        self.dyn, self.memory = dyn, memory
        self.steps: list[tuple[int, int, int, int]] = []  # (decisions, micro-batch, peak, OOMs recovered)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        dyn = self.dyn
        self.steps.append((dyn.decisions, int(dyn.batch_size or 0), self.memory.peak_bytes(), dyn.oom_recoveries))

    def after_first_decision(self) -> list[tuple[int, int]]:
        """(micro-batch, peak so far in its interval) of each step after the first decision."""
        return [(size, peak) for decisions, size, peak, _ in self.steps if decisions >= 1]

    def oom_recoveries_after_first_decision(self) -> int:
        before = max((ooms for decisions, _, _, ooms in self.steps if decisions == 0), default=0)
        return self.dyn.oom_recoveries - before


def fit_tracked(
    tmp_path: Path,
    module: LightningModule,
    memory: lt.TrackedMemory,
    dyn: lt.DynamicBatchSize | None,
    data: list[Any],
    batch_size: int,
    *,
    callbacks: Sequence[Callback] = (),
    val: list[Any] | None = None,
    **trainer: Any,
) -> Intervals | None:
    """Fit ``module`` on ``data`` (and ``val``) inside ``memory.tracking``; the per-step record of DynamicBatchSize."""
    record = None if dyn is None else Intervals(dyn, memory)
    driving: list[Callback] = [] if dyn is None or record is None else [record, dyn]
    with memory.tracking(module):
        trainer_ = make_trainer(tmp_path, [*driving, *callbacks], **trainer)
        val_loader = None if val is None else DataLoader(val, batch_size=len(val))
        trainer_.fit(module, DataLoader(data, batch_size=batch_size), val_loader)
    return record


def weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


# -- the probe --------------------------------------------------------------------------------------------------------
def test_counts_each_storage_once_until_it_is_freed() -> None:
    memory = lt.TrackedMemory(total_bytes=1 << 30)
    weight = torch.ones(1000)  # 4000 bytes, rounded to 4096 as CUDA's allocator rounds
    with memory.tracking(weight):
        assert memory.allocated_bytes() == 4096
        ones = torch.ones(1000, 300)  # 1_200_000 bytes -> 1_200_128
        y = weight @ ones  # 1200 bytes -> 1536
        views = [y[:10], y.view(3, 100), y.t(), y.detach()]
        y.mul_(2)
        weight @ ones  # a temporary: freed at once, its block cached
        assert memory.allocated_bytes() == 4096 + 1_200_128 + 1536
        del views, y
        assert memory.allocated_bytes() == 4096 + 1_200_128  # y's storage is freed with its last view
    del ones  # counted until freed, inside the block or after it
    assert memory.allocated_bytes() == 4096 and memory.reserved_bytes() == 4096 + 1_200_128 + 2 * 1536  # y, temporary
    memory.empty_cache()
    assert memory.reserved_bytes() == memory.allocated_bytes() == weight.untyped_storage().nbytes() + 96


def test_peak_is_reserved_memory_and_starts_again_at_reset() -> None:
    memory = lt.TrackedMemory(total_bytes=1 << 30)
    with memory.tracking():
        a = torch.zeros(1 << 20)  # 4 MiB
        del a
        b = torch.zeros(1 << 19)  # 2 MiB, served from the cached 4 MiB
        assert (memory.allocated_bytes(), memory.reserved_bytes(), memory.peak_bytes()) == (2 << 20, 4 << 20, 4 << 20)
        memory.reset_peak()
        assert memory.peak_bytes() == 4 << 20  # what is reserved now, as torch.cuda.reset_peak_memory_stats
        memory.empty_cache()
        memory.reset_peak()
        assert memory.peak_bytes() == 2 << 20 == b.untyped_storage().nbytes()


def test_tensors_made_before_tracking_count_only_when_handed_over() -> None:
    dataset = torch.zeros(1 << 20)  # a dataset in host memory
    model = nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    memory = lt.TrackedMemory(total_bytes=1 << 30)
    with memory.tracking(model, optimizer):
        row = dataset[:256]  # a view of a storage the device does not hold
        assert memory.allocated_bytes() == 4 * (256 * 256 + 256) * 4 + 1024  # weights, grads, 2 states, 2 step counters
        model(row[None]).sum()
    assert memory.peak_bytes() > memory.allocated_bytes()  # the forward's output, freed


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer step"])
def test_out_of_memory_is_raised_inside_the_operation_that_allocates(phase: str) -> None:
    """A step's phases fill a device in turn; one too small for a phase fails in it, as CUDA does, not before."""
    config, batch = gpt2(width=256, seq=8), torch.randint(0, VOCAB, (1, 8))

    def step(memory: lt.TrackedMemory, done: list[str]) -> None:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        peaks = []
        with memory.tracking(model):
            optimizer = torch.optim.AdamW(model.parameters())
            peaks.append(memory.peak_bytes())
            loss = model(input_ids=batch, labels=batch).loss
            done.append("forward")
            peaks.append(memory.peak_bytes())
            loss.backward()
            done.append("backward")
            peaks.append(memory.peak_bytes())
            optimizer.step()  # the first step creates AdamW's state
            done.append("optimizer step")
            peaks.append(memory.peak_bytes())
        step.peaks = peaks  # type: ignore[attr-defined]

    step(lt.TrackedMemory(total_bytes=1 << 30), [])
    peaks = step.peaks  # type: ignore[attr-defined]
    assert peaks == sorted(set(peaks))  # each phase needs more than the one before (AdamW's state most)
    phases = ["forward", "backward", "optimizer step"]
    i = phases.index(phase)
    done: list[str] = []
    memory = lt.TrackedMemory(total_bytes=(peaks[i] + peaks[i + 1]) // 2)
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate ") as caught:
        step(memory, done)
    assert done == phases[:i]
    assert is_allocation_failure(caught.value) and memory.out_of_memory_errors == 1
    assert "of which" in str(caught.value) and "is reserved by PyTorch but unallocated" in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"total_bytes": 0}, ValueError, "`total_bytes` must be an integer >= 1, got 0", id="no-memory"),
        pytest.param(
            {"total_bytes": 1e9}, TypeError, r"`total_bytes` must be an integer, got 1000000000.0 \(float\)", id="float"
        ),
        pytest.param(
            {"total_bytes": 10, "outside_bytes": 10},
            ValueError,
            r"`outside_bytes` must be below `total_bytes` \(10\) so that PyTorch gets some memory, got 10",
            id="all-outside",
        ),
        pytest.param(
            {"total_bytes": 10, "fragmentation": 1.0}, ValueError, r"`fragmentation` must be in \[0, 1\), got 1.0"
        ),
        pytest.param(
            {"total_bytes": 10, "expandable_segments": "yes"},
            TypeError,
            "`expandable_segments` must be True or False, got 'yes'",
        ),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        lt.TrackedMemory(**kwargs)


def test_tracking_refuses_other_objects_and_a_second_entry() -> None:
    memory = lt.TrackedMemory(total_bytes=1 << 20)
    with pytest.raises(TypeError, match="`objects` must be modules, optimizers or tensors, got 'model' "):
        memory.tracking("model").__enter__()  # type: ignore[arg-type]
    with memory.tracking(), pytest.raises(RuntimeError, match="entered already; enter it once around the whole run"):
        memory.tracking().__enter__()


def test_measure_memory_agrees_with_the_real_step() -> None:
    """measure_memory's per-sample cost and fixed part against one real step's peaks, GPT-2 and Llama.

    Its fixed part is the optimizer step's peak when that is above the line's intercept (here: AdamW's state beside
    the gradients on a tiny model), so the line over-states the peak at small sizes by design; the slope and the
    optimizer step are what must agree.
    """
    for config in (gpt2(), llama()):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, VOCAB, (8, 32))
        estimate = lt.measure_memory(model, {"input_ids": ids, "labels": ids}, for_device="cpu", batch_sizes=(4, 8))
        memory = lt.TrackedMemory(total_bytes=1 << 32)
        peaks: dict[str, list[int]] = {"forward and backward": [], "optimizer step": []}
        with memory.tracking(model):
            optimizer = torch.optim.AdamW(model.parameters())
            for size in (4, 4, 8):  # the first step creates AdamW's state; the others are measured
                memory.empty_cache()
                memory.reset_peak()
                model(input_ids=ids[:size], labels=ids[:size]).loss.backward()
                peaks["forward and backward"].append(memory.peak_bytes())
                memory.empty_cache()
                memory.reset_peak()
                optimizer.step()
                optimizer.zero_grad()
                peaks["optimizer step"].append(memory.peak_bytes())
        _, small, large = peaks["forward and backward"]
        assert estimate.bytes_per_sample == pytest.approx((large - small) / 4, rel=0.05)
        assert estimate.fixed_bytes == pytest.approx(peaks["optimizer step"][-1], rel=0.05)
        assert estimate.total_bytes(8) >= large  # a line that never under-states


# -- DynamicBatchSize on real tensors ---------------------------------------------------------------------------------
def test_the_base_is_read_with_the_gradients_freed(tmp_path: Path) -> None:
    """A full fine-tune with fp32 gradients, measured at a small size, then jumping: the jump must fit.

    The gradients are alive between steps and freed at the next step's zero_grad; one micro-batch a step
    (keep="none") holds them only in its optimizer step. A base read with them alive anchors a line through the
    measured peak that under-states the slope, and the jump it allows ran out of memory.
    """
    memory = lt.TrackedMemory(total_bytes=100_000_000)
    dyn = lt.DynamicBatchSize(0.9, keep="none", adjust_every=2, multiple_of=1, probe=memory)
    record = fit_tracked(tmp_path, CausalLM(gpt2(width=256, seq=16)), memory, dyn, token_data(512, 16), 4, max_steps=8)
    assert record is not None and dyn.decisions == 4
    assert memory.out_of_memory_errors == dyn.oom_recoveries == 0
    budget = 0.9 * memory.capacity_bytes()
    for size, peak in record.after_first_decision():
        assert peak <= budget, f"micro-batch {size} peaked at {peak / budget:.3f} of the target"
    size, peak = record.after_first_decision()[-1]
    assert size > 4 * 8 and peak > 0.85 * budget  # it did jump, to nearly the target


def test_out_of_memory_in_backward_is_recovered_with_every_sample_trained_once(tmp_path: Path) -> None:
    config, data = gpt2(), token_data(64, 32)
    reference = CausalLM(config)
    fit_tracked(tmp_path, reference, lt.TrackedMemory(total_bytes=1 << 32), None, data, 16, max_steps=4)
    # the first step at 16 samples: its forward fits, its backward (gradients beside the activations) does not
    memory = lt.TrackedMemory(total_bytes=_between_forward_and_backward(config, data))
    dyn = lt.DynamicBatchSize(0.9, adjust_every=2, multiple_of=1, probe=memory)
    model = CausalLM(config)
    with pytest.warns(UserWarning, match="out of memory at a micro-batch of 16 samples.*running the same step again"):
        fit_tracked(tmp_path, model, memory, dyn, data, 16, max_steps=4)
    assert dyn.oom_recoveries == memory.out_of_memory_errors == 1
    for ours, theirs in zip(weights(model), weights(reference), strict=True):  # AdamW: m / sqrt(v) of tiny gradients
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def _between_forward_and_backward(config: transformers.PretrainedConfig, data: list[Any]) -> int:
    """A device size halfway between the first step's forward peak and its backward peak at 16 samples."""
    memory = lt.TrackedMemory(total_bytes=1 << 32)
    model = CausalLM(config)
    batch = next(iter(DataLoader(data, batch_size=16)))
    with memory.tracking(model):
        loss = model.training_step(batch, 0)
        forward = memory.peak_bytes()
        loss.backward()
        backward = memory.peak_bytes()
    assert backward > forward
    return (forward + backward) // 2


class FirstStepCycle(CausalLM):
    """Leaves 8 MiB in a reference cycle at its first step: garbage that only a collection frees."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 0:
            cycle: list[Any] = [torch.empty(1 << 21)]
            cycle.append(cycle)
        return super().training_step(batch, batch_idx)


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.usefixtures("no_automatic_gc")
def test_out_of_memory_in_the_optimizer_step_is_recovered_with_every_sample_trained_once(tmp_path: Path) -> None:
    """AdamW's first step creates its state; the device fits it only once the garbage is collected."""
    config, data = gpt2(width=256, seq=32, layers=4), token_data(64, 32)
    reference = CausalLM(config)
    fit_tracked(tmp_path, reference, lt.TrackedMemory(total_bytes=1 << 32), None, data, 4, max_steps=1)
    gc.collect()
    sizing = lt.TrackedMemory(total_bytes=1 << 32)
    fit_tracked(tmp_path, CausalLM(config), sizing, None, data, 4, max_steps=1)
    memory = lt.TrackedMemory(total_bytes=sizing.peak_bytes() + (1 << 22))  # short of the garbage by 4 MiB
    model = FirstStepCycle(config)
    dyn = lt.DynamicBatchSize(0.9, adjust_every=100, probe=memory)
    with pytest.warns(UserWarning, match="out of memory in the optimizer step.*retrying once"):
        fit_tracked(tmp_path, model, memory, dyn, data, 4, max_steps=1)
    assert memory.out_of_memory_errors == 1 and dyn.oom_recoveries == 0  # the step was not run again
    for ours, theirs in zip(weights(model), weights(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
