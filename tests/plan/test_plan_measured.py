"""Measured estimate: a training step on fake tensors gives the bytes a real step holds, without allocating them."""

from __future__ import annotations

import contextlib
import re
import resource
from typing import Any

import pytest
import torch
from torch import nn

from lightning_tune.demos import DemoGPT, GPTConfig
from lightning_tune.plan import measure_memory, measured
from lightning_tune.plan.measured import LiveBytes, _fake_modes
from lightning_tune.swaps.optimizer import optimizer_state_bytes

CONFIG = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4)


def token_batch(n: int, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 64, (n, seq)), torch.randint(0, 64, (n, seq))


def nbytes(tensors: Any) -> int:
    return sum(t.nbytes for t in tensors)


@pytest.mark.filterwarnings("ignore:.*self.log.*")
@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "64-true"])
def test_fake_step_bytes_equal_a_real_cpu_step(precision: Any) -> None:
    model = DemoGPT(CONFIG)
    estimate = measure_memory(model, token_batch(4), precision=precision)
    real = DemoGPT(CONFIG)
    if precision != "32-true":
        real = real.to(torch.bfloat16 if precision == "bf16-true" else torch.float64)
    optimizer = real.configure_optimizers()
    real.training_step(token_batch(4), 0).backward()
    optimizer.step()
    assert estimate.parameters == real.model.num_parameters()
    assert estimate.weight_bytes == nbytes(real.parameters())
    assert estimate.gradient_bytes == nbytes(p.grad for p in real.parameters())
    assert estimate.optimizer_bytes == optimizer_state_bytes(optimizer)


@pytest.mark.filterwarnings("ignore:.*self.log.*")
def test_a_precision_alias_measures_what_its_canonical_name_does() -> None:
    bf16 = measure_memory(DemoGPT(CONFIG), token_batch(2), precision="bf16")  # type: ignore[arg-type]
    assert bf16 == measure_memory(DemoGPT(CONFIG), token_batch(2), precision="bf16-mixed")
    assert bf16.weight_bytes == bf16.gradient_bytes == 4 * bf16.parameters  # float32 weights under autocast


def test_the_module_is_left_as_it_was() -> None:
    model = DemoGPT(CONFIG)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    measure_memory(model, token_batch(2))
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) and param.grad is None
        assert not isinstance(param.data, torch._subclasses.fake_tensor.FakeTensor)


@pytest.mark.slow
def test_a_large_model_costs_no_memory_of_its_size() -> None:
    # 16 layers of width 2048 on the meta device: 0.8 B parameters, 13 GB of fp32 weights, gradients and AdamW state
    config = GPTConfig(vocab_size=64, seq_len=128, d_model=2048, n_layers=16, n_heads=16)
    with torch.device("meta"):
        model = DemoGPT(config)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    estimate = measure_memory(model, token_batch(1, 128))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert estimate.fixed_bytes > 12 * 2**30
    assert grown_kib < 512 * 2**10  # the process grew by less than 0.5 GiB


def test_peak_grows_by_the_activations_of_each_sample() -> None:
    estimate = measure_memory(DemoGPT(CONFIG), token_batch(1), batch_sizes=(2, 4))
    # the fit is exact for a module whose saved tensors scale with the batch
    three = measure_memory(DemoGPT(CONFIG), token_batch(1), batch_sizes=(3, 6))
    assert estimate.bytes_per_sample == three.bytes_per_sample
    assert estimate.bytes_per_sample > 32 * 64 * 4 * 2  # at least the block inputs of each token
    assert estimate.fixed_bytes >= estimate.state_bytes


def test_plain_module_with_a_batch_function_and_an_optimizer_factory() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    estimate = measure_memory(
        model,
        lambda n: torch.randn(n, 16),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        loss_fn=lambda module, x: module(x).pow(2).mean(),
    )
    assert estimate.optimizer_bytes == estimate.weight_bytes == 4 * (16 * 32 + 32 + 32 + 1)


def test_live_bytes_follow_storages_not_views() -> None:
    # what the measurement relies on in torch's fake tensors and dispatch modes (checked on torch 2.13)
    counter = LiveBytes()
    fake_mode, tracker = _fake_modes(counter)
    with fake_mode, tracker:
        a = torch.empty(1000)
        assert isinstance(a, torch._subclasses.fake_tensor.FakeTensor)
        view = a.view(10, 100)
        assert counter.current == 4000  # a view shares its storage
        b = a * 2
        assert counter.current == 8000 and counter.peak == 8000
        del a, view, b
        assert counter.current == 0 and counter.peak == 8000


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(
            lambda: measure_memory("gpt2", None), TypeError, "`model` must be an nn.Module, got 'gpt2'", id="name"
        ),
        pytest.param(
            lambda: measure_memory(nn.Linear(2, 1), torch.zeros(1, 2), precision="auto"),
            ValueError,
            "`precision` must be one of '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', '64-true' (or an "
            "alias: '16', '32', '64', 'bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32', 'fp64'), got 'auto'",
            id="precision",
        ),
        pytest.param(
            lambda: measure_memory(nn.Linear(2, 1), torch.zeros(1, 2), batch_sizes=(2, 2)),
            ValueError,
            "`batch_sizes` must hold two different sizes",
            id="sizes",
        ),
        pytest.param(
            lambda: measure_memory(nn.Linear(2, 1), torch.zeros(1, 2), for_device="tpu"),
            ValueError,
            "`for_device` must be one of 'cuda', 'cpu', got 'tpu'",
            id="device",
        ),
        pytest.param(
            lambda: measure_memory(nn.Linear(2, 1), torch.zeros(1, 2), optimizer=3),
            TypeError,
            "`optimizer` must be a function",
            id="optimizer",
        ),
        pytest.param(
            lambda: measure_memory(nn.Linear(2, 1), lambda n: torch.zeros(1, 2)),
            ValueError,
            "the peak did not grow from batch 1 to 2",
            id="fixed-batch",
        ),
        pytest.param(
            lambda: measure_memory(nn.Linear(2, 1), torch.zeros(1, 3)),
            RuntimeError,
            "could not run a training step of Linear on fake tensors",
            id="shape",
        ),
    ],
)
def test_bad_arguments(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_lightning_module_needing_a_trainer_asks_for_an_optimizer() -> None:
    class NeedsTrainer(DemoGPT):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3 * self.trainer.num_devices)

    with pytest.raises(ValueError, match=r"configure_optimizers\(\) failed outside a Trainer .*pass `optimizer=`"):
        measure_memory(NeedsTrainer(CONFIG), token_batch(1))
    estimate = measure_memory(NeedsTrainer(CONFIG), token_batch(1), optimizer=lambda p: torch.optim.AdamW(p))
    assert estimate.optimizer_bytes > 2 * estimate.weight_bytes


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:.*self.log.*")
@pytest.mark.parametrize("batch_size", [8, 16, 32])
def test_predicted_peak_within_10_percent_of_cuda(batch_size: int) -> None:
    config = GPTConfig(vocab_size=64, seq_len=1024, d_model=512, n_layers=8, n_heads=8)
    estimate = measure_memory(DemoGPT(config), token_batch(1, 1024), precision="bf16-mixed")
    model = DemoGPT(config).cuda()
    optimizer = model.configure_optimizers()
    torch.cuda.synchronize()
    for step in range(3):
        if step == 1:
            torch.cuda.reset_peak_memory_stats()
        batch = tuple(t.cuda() for t in token_batch(batch_size, 1024))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.training_step(batch, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss, batch
    real = torch.cuda.max_memory_allocated()
    predicted = estimate.total_bytes(batch_size)
    assert abs(predicted - real) / real <= 0.10, (predicted, real)


def test_planning_for_a_gpu_includes_the_multi_tensor_optimizer_temporaries() -> None:
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    for_gpu = measure_memory(model, torch.zeros(1, 256), for_device="cuda")
    for_cpu = measure_memory(model, torch.zeros(1, 256), for_device="cpu")
    assert for_gpu.optimizer_bytes == for_cpu.optimizer_bytes
    # torch's foreach AdamW holds sqrt(second moments) of all 8 weights at once, the per-tensor path two at a time
    assert for_gpu.fixed_bytes - for_cpu.fixed_bytes >= 5 * 4 * 256 * 256


class _Tagger(nn.Module):
    """A token classifier called as a Hugging Face model is: ``model(**batch)`` with -100 labels and a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(input_ids) * attention_mask.unsqueeze(-1))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _collated(n: int) -> dict[str, Any]:
    lengths = [2 + 29 * (i % 3 == 2) for i in range(n)]  # long-tailed, padded to the longest
    labels = torch.full((n, 31), -100)
    for row, length in enumerate(lengths):
        labels[row, :length] = torch.randint(0, 8, (length,))
    mask = (labels != -100).long()
    return {"input_ids": torch.randint(0, 64, (n, 31)) * mask, "attention_mask": mask, "labels": labels}


def _nested(n: int) -> dict[str, Any]:
    return {"features": [(torch.randn(n, 16),), {"scale": torch.ones(n, 1)}]}


def _scaled_mlp(module: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    (x,), extra = batch["features"]
    return (module(x) * extra["scale"]).pow(2).mean()


STEP_ON_META = [
    pytest.param(lambda: DemoGPT(CONFIG), token_batch, {}, id="lightning-tuple"),
    pytest.param(_Tagger, _collated, {}, id="hf-collator-dict"),
    pytest.param(
        lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
        _nested,
        {"loss_fn": _scaled_mlp},
        id="nested-dict-list-tuple",
    ),
]


@pytest.mark.filterwarnings("ignore:.*self.log.*")
@pytest.mark.parametrize(("make_model", "make_batch", "kwargs"), STEP_ON_META)
def test_a_batch_function_measures_on_another_device_what_its_template_does(
    make_model: Any, make_batch: Any, kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU the fake parameters are on `cuda` while a batch function makes CPU tensors; `meta` is such another
    # device on a CPU-only torch. A template is made on the step's device: the function's batch must be moved there.
    real_run = measured._run
    monkeypatch.setattr(measured, "_run", lambda *a, **k: real_run(*a, **{**k, "device": torch.device("meta")}))
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: contextlib.nullcontext())  # none for meta; 32-true here
    from_template = measure_memory(make_model(), make_batch(1), **kwargs)
    assert measure_memory(make_model(), make_batch, **kwargs) == from_template
