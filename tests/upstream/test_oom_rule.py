"""What counts as an allocation failure, against the rules of Lightning and accelerate and their own test cases.

Lightning's ``is_oom_error`` (``lightning/pytorch/utilities/memory.py``, what ``BatchSizeFinder`` shrinks on) and
accelerate's ``should_reduce_batch_size`` (``accelerate/utils/memory.py``, what ``find_executable_batch_size`` shrinks
on) both take cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED`` for a too-large batch (PyTorch issue 4107). The messages below are
theirs: accelerate's ``tests/test_memory_utils.py`` raises ``f"{torch_device.upper()} out of memory."`` for each device
it tests on and ``ValueError("Oops, we had an error!")`` as any other error; pykeen's ``tests/test_utils.py`` uses
torch's full cuDNN message; torch itself raises ``torch.AcceleratorError`` for a failed CUDA runtime call.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.memory import is_oom_error

from lightning_tune.batch.runner import MicroBatchRunner, cut_step, is_allocation_failure

_memory = pytest.importorskip("accelerate.utils.memory", reason="accelerate is the reference here")
find_executable_batch_size = _memory.find_executable_batch_size
should_reduce_batch_size = _memory.should_reduce_batch_size

CUDNN_NOT_SUPPORTED = (
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
)

SHRINK = [
    pytest.param(RuntimeError(CUDNN_NOT_SUPPORTED), id="cudnn-not-supported"),
    pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."), id="cudnn-not-supported-upstream-string"),
    *(
        pytest.param(RuntimeError(f"{device} out of memory."), id=f"accelerate-{device.lower()}")
        for device in ("CUDA", "XPU", "NPU", "MLU", "MUSA", "HPU", "MPS", "CPU")
    ),
    pytest.param(RuntimeError("CUDA error: out of memory"), id="lightning-cuda-rule"),
    pytest.param(RuntimeError("CUDA driver error: out of memory"), id="lightning-cuda-rule-driver"),
    pytest.param(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), id="cpu"),
    pytest.param(
        RuntimeError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::4294967296 (4096)MB"), id="hpu"
    ),
    pytest.param(RuntimeError("MPS backend out of memory (MPS allocated: 17.36 GB)"), id="mps-backend"),
]
if hasattr(torch, "AcceleratorError"):  # torch's type for a failed CUDA runtime call, a RuntimeError subclass
    SHRINK.append(pytest.param(torch.AcceleratorError("CUDA error: out of memory"), id="torch-accelerator-error"))

KEEP = [
    pytest.param(ValueError("Oops, we had an error!"), id="accelerate-any-other-error"),
    pytest.param(RuntimeError("Something else."), id="pykeen-not-cuda-error"),
    pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"), id="cudnn-execution-failed"),
    pytest.param(RuntimeError("CUDA error: device-side assert triggered"), id="device-assert"),
]


@pytest.mark.parametrize("error", SHRINK)
def test_what_lightning_or_accelerate_shrink_on_is_an_allocation_failure(error: BaseException) -> None:
    assert is_oom_error(error) or should_reduce_batch_size(error)  # the upstream rule ...
    assert is_allocation_failure(error)  # ... and ours


@pytest.mark.parametrize("error", KEEP)
def test_what_both_leave_alone_is_not(error: BaseException) -> None:
    assert not is_oom_error(error) and not should_reduce_batch_size(error)
    assert not is_allocation_failure(error)


def test_the_runner_shrinks_on_cudnn_not_supported_to_the_size_find_executable_batch_size_reaches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """accelerate's ``test_memory_implicit`` with cuDNN's error: every size above 8 fails, both end at a size <= 8."""
    monkeypatch.setattr("gc.collect", lambda *args: 0)  # accelerate collects at every try: seconds in a test process

    def fails_above_8(size: int) -> int:
        if size > 8:
            raise RuntimeError(CUDNN_NOT_SUPPORTED)
        return size

    reached = find_executable_batch_size(fails_above_8, starting_batch_size=128)()
    w = torch.zeros(1, requires_grad=True)

    def forward(micro_batch):  # noqa: ANN001, ANN202
        fails_above_8(micro_batch.samples)
        return ((micro_batch.batch - w) ** 2).mean()

    runner = MicroBatchRunner(
        forward=forward,
        backward=lambda loss: loss.backward(),
        zero_grad=lambda: setattr(w, "grad", None),
        free=lambda: None,
        shrink=lambda size: size // 2,
        min_size=1,
    )
    outcome = runner.run(torch.arange(128.0), [], lambda b, m: cut_step(b, m, sample_weight=1 / 128), 128)
    assert runner.size == 8 and outcome.failures == 4 and reached <= 8
