"""Parity with accelerate's memory utilities (``tests/test_memory_utils.py`` and ``should_reduce_batch_size``) and its
model-size estimator (``accelerate estimate-memory``, ``commands/estimate.py``, tested in ``tests/cli/test_cli.py``).

accelerate's ``find_executable_batch_size`` halves the batch after an error its ``should_reduce_batch_size`` accepts:
the out-of-memory messages of CUDA, HIP, XPU, MPS, the CPU allocator and Habana's HPU. lightning_tune's micro-batch
runner must treat the same errors as allocation failures and shrink, as accelerate's own test case does
(128 -> 64 -> 32 -> 16 -> 8), instead of failing the run. Lightning's ``BatchSizeFinder`` (``is_oom_error``) is the
second reference for the messages it knows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.memory import is_oom_error

from lightning_tune.batch.runner import MicroBatchRunner, cut_step, is_allocation_failure

should_reduce_batch_size = pytest.importorskip(
    "accelerate.utils.memory", reason="the reference is accelerate's own (pip install accelerate)"
).should_reduce_batch_size

# What each device's allocator raises when it runs out (the wording of each source, sizes filled in).
DEVICE_MESSAGES = [
    pytest.param("CUDA out of memory. Tried to allocate 2.00 GiB.", id="cuda"),  # accelerate's own fake error
    pytest.param("HIP out of memory. Tried to allocate 512.00 MiB.", id="rocm-hip"),
    pytest.param(
        "XPU out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 15.11 GiB of which 0 bytes is "
        "free.",
        id="intel-xpu",
    ),
    pytest.param(
        "MPS backend out of memory (MPS allocated: 17.36 GB, other allocations: 613.56 MB, max allowed: 18.13 GB). "
        "Tried to allocate 192.00 MB on private pool.",
        id="apple-mps",
    ),
    pytest.param(
        "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 2359296 bytes. Error code 12 (Cannot allocate memory)",
        id="cpu-allocator",
    ),
    pytest.param("CPU out of memory.", id="cpu-generic"),
    pytest.param(
        "synStatus=26 [Generic failure] Device acquire failed. FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed "
        "for size::4294967296 (4096)MB",
        id="habana-hpu",
    ),
]


@pytest.mark.parametrize("message", DEVICE_MESSAGES)
def test_every_device_out_of_memory_message_is_an_allocation_failure(message: str) -> None:
    error = RuntimeError(message)
    assert should_reduce_batch_size(error)  # accelerate shrinks on it ...
    assert is_allocation_failure(error)  # ... and so do we


def test_lightning_oom_messages_are_allocation_failures() -> None:
    """The out-of-memory errors Lightning's ``BatchSizeFinder`` shrinks on (its ``is_oom_error``)."""
    for message in ("CUDA out of memory.", "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"):
        assert is_oom_error(RuntimeError(message))
        assert is_allocation_failure(RuntimeError(message))


def test_a_real_cpu_allocation_failure_is_recognised() -> None:
    """torch's own CPU allocator raising, not a message written here."""
    with pytest.raises(RuntimeError) as caught:
        torch.empty(1 << 62, dtype=torch.uint8)
    assert should_reduce_batch_size(caught.value)
    assert is_allocation_failure(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(ValueError("Oops, we had an error!"), id="accelerate-any-other-error"),
        pytest.param(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"), id="shape"),
        pytest.param(NotImplementedError("CPU out of memory."), id="runtime-error-subclass"),
    ],
)
def test_other_errors_are_not_allocation_failures(error: BaseException) -> None:
    assert not is_allocation_failure(error)


@pytest.mark.parametrize("message", DEVICE_MESSAGES)
def test_runner_halves_like_find_executable_batch_size(message: str) -> None:
    """accelerate's ``test_memory_implicit``: starting at 128, every size but 8 fails; the sizes tried are halvings."""
    tried: list[int] = []
    w = torch.zeros(1, requires_grad=True)

    def forward(micro_batch) -> torch.Tensor:  # noqa: ANN001
        tried.append(micro_batch.samples)
        if micro_batch.samples > 8:
            raise RuntimeError(message)
        return ((micro_batch.batch - w) ** 2).mean()

    runner = MicroBatchRunner(
        forward=forward,
        backward=lambda loss: loss.backward(),
        zero_grad=lambda: setattr(w, "grad", None),
        free=lambda: None,
        shrink=lambda size: size // 2,
        min_size=1,
    )
    batch = torch.arange(128.0)
    outcome = runner.run(batch, [], lambda b, m: cut_step(b, m, sample_weight=1 / 128), 128)
    assert tried[:5] == [128, 64, 32, 16, 8] and runner.size == 8 and outcome.failures == 4
    assert w.grad is not None and float(w.grad) == pytest.approx(-2 * float(batch.mean()))


def test_estimate_memory_runs_accelerates_bert_base_cased_case(tmp_path: Path) -> None:
    """accelerate's ``test_explicit_dtypes``: bert-base-cased in float32, 433,249,280 bytes, largest layer 89,075,712.

    accelerate counts what ``AutoModel`` builds (the encoder and its pooler) with its buffers at their own width, and
    plans training as four times that (weights, gradients, Adam's two moments, all in the model's dtype).
    """
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel, BertConfig

    from lightning_tune.plan import estimate_memory

    config = BertConfig(vocab_size=28996)  # bert-base-cased's config.json: BERT-base with a cased vocabulary
    config.save_pretrained(tmp_path)
    estimate = estimate_memory(tmp_path, sequence_length=512, precision="32-true", optimizer="adamw")
    total_size, largest_layer = 433_249_280, 89_075_712  # accelerate's expected values
    assert estimate.weight_bytes + estimate.buffer_bytes == total_size
    assert 4 * estimate.largest_layer_parameters == largest_layer  # the word embeddings
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    assert calculate_maximum_sizes(model)[0] == total_size  # accelerate's own count of the model it builds
    # Training: accelerate's 4x, less three copies of the int64 buffers (no gradients or moments), plus AdamW's
    # float32 step count per parameter tensor.
    assert estimate.fixed_bytes == 4 * total_size - 3 * estimate.buffer_bytes + 4 * len(list(model.parameters()))
