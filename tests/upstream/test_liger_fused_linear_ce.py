"""Liger-Kernel's fused linear cross-entropy cases against :func:`~lightning_tune.linear_cross_entropy`.

The parameter tables of Liger-Kernel's ``test/transformers/test_fused_linear_cross_entropy.py`` (shapes, dtypes with
their tolerances, ``reduction``, bias, class weights, ``label_smoothing``, ``ignore_index``, ``lse_square_scale``,
``softcap``, ``return_z_loss``, ``return_token_accuracy``, autocast, a per-token upstream gradient), each run on the CPU
against torch's reference as Liger's tests build it: the head's ``nn.Linear`` in the case's dtype, the logits upcast
to float32, softcapped, then ``F.cross_entropy(weight=, label_smoothing=, ignore_index=, reduction=)`` plus the z-loss
``lse_square_scale * logsumexp(logits) ** 2`` of each labelled token, reduced over the labelled tokens (their
``CrossEntropyWithZLoss``). Weights are drawn as theirs (``torch.rand``), as are the ignored tokens (a random number,
from 1 to half the tokens).

Changed for the CPU, to run in seconds: their large shape ``(B, T, H, V) = (8, 128, 1024, 4096)`` is
``(2, 32, 64, 256)`` here (the same vocabulary-to-hidden ratio), and every case runs in chunks of 48 tokens (5 or 7
for the smallest shapes), so that each crosses chunk boundaries (their kernel chooses its own chunks). Class weights
of the functional case come from ``torch.rand`` (theirs: ``randn``, compared there between two entry points of
their own). Left out: ``accum_dtype`` (the weight gradient is always accumulated in float32 here),
``use_token_scaling`` and ``return_predicted_tokens``, which ``linear_cross_entropy`` does not have.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tune.swaps.cross_entropy import LinearCrossEntropyOutput, linear_cross_entropy

SHAPES = [pytest.param(2, 32, 64, 256, id="large-shrunk"), pytest.param(4, 47, 31, 123, id="random-shape")]
DTYPES = [  # (reduction, scalar, dtype, atol, rtol), as theirs
    pytest.param("mean", 1.0, torch.bfloat16, 5e-3, 5e-2, id="mean-bf16"),
    pytest.param("mean", 1.0, torch.float32, 1e-5, 5e-4, id="mean-fp32"),
    pytest.param("sum", 1.0, torch.bfloat16, 5e-0, 5e1, id="sum-bf16"),
    pytest.param("sum", 1.0, torch.float32, 1e-3, 5e-2, id="sum-fp32"),
]
OPTIONS = [  # (has_ce_weight, label_smoothing, ignore_index, lse_square_scale, softcap, return_z_loss)
    pytest.param(False, 0.0, -100, 0.0, None, False, id="defaults"),
    pytest.param(True, 0.1, 42, 1e-4, 30.0, True, id="all-options"),
]
CHUNK = 48


def reference(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    *,
    ce_weight: Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Liger's torch reference (``TorchLMHeadCE`` over ``CrossEntropyWithZLoss``): the loss and its z-loss part."""
    logits = F.linear(x, weight, bias).to(torch.float32)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ce = F.cross_entropy(
        logits,
        target,
        weight=ce_weight,
        reduction=reduction,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
    )
    labelled = target != ignore_index
    z = torch.where(labelled, lse_square_scale * torch.logsumexp(logits, dim=-1) ** 2, 0.0)
    z = {"mean": z.sum() / labelled.sum(), "sum": z.sum(), "none": z}[reduction]
    return ce + z, z


def targets(bt: int, vocab: int, ignore_index: int) -> Tensor:
    """Random labels, a random number of them (1 to half) set to ``ignore_index``, as Liger's tests draw them."""
    target = torch.randint(0, vocab, (bt,))
    target[torch.randperm(bt)[: int(torch.randint(1, bt // 2, (1,)))]] = ignore_index
    return target


def head(vocab: int, hidden: int, dtype: torch.dtype, bias: bool) -> tuple[Tensor, Tensor | None]:
    weight = torch.rand(vocab, hidden, dtype=dtype).requires_grad_()
    return weight, torch.rand(vocab, dtype=dtype).requires_grad_() if bias else None


def close(got: Tensor | None, want: Tensor | None, atol: float, rtol: float) -> None:
    assert got is not None and want is not None
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("has_ce_weight", "label_smoothing", "ignore_index", "lse_square_scale", "softcap", "z"), OPTIONS
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("reduction", "scalar", "dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize(("B", "T", "H", "V"), SHAPES)
@pytest.mark.parametrize("backward", [True, False], ids=["correctness", "forward-only"])
def test_correctness(
    backward: bool,
    B: int,  # noqa: N803 (their names)
    T: int,  # noqa: N803
    H: int,  # noqa: N803
    V: int,  # noqa: N803
    reduction: str,
    scalar: float,
    dtype: torch.dtype,
    atol: float,
    rtol: float,
    bias: bool,
    has_ce_weight: bool,
    label_smoothing: float,
    ignore_index: int,
    lse_square_scale: float,
    softcap: float | None,
    z: bool,
) -> None:
    """Their ``test_correctness`` and ``test_correctness_with_forward_only``."""
    torch.manual_seed(42)
    ce_weight = torch.rand(V) if has_ce_weight else None
    weight, head_bias = head(V, H, dtype, bias)
    x = (torch.randn(B * T, H, dtype=dtype) * scalar).requires_grad_()
    target = targets(B * T, V, ignore_index)
    options: dict[str, Any] = {
        "ce_weight": ce_weight,
        "ignore_index": ignore_index,
        "lse_square_scale": lse_square_scale,
        "label_smoothing": label_smoothing,
        "reduction": reduction,
        "softcap": softcap,
    }
    with torch.set_grad_enabled(backward):
        want, want_z = reference(x, weight, head_bias, target, **options)
        got = linear_cross_entropy(x, weight, target, bias=head_bias, chunk_size=CHUNK, return_z_loss=z, **options)
    loss = got.loss if z else got
    assert isinstance(got, LinearCrossEntropyOutput) is z
    close(loss, want, atol, rtol)
    if z:
        close(got.z_loss, want_z, atol, rtol)
    if not backward:
        assert not loss.requires_grad
        return
    inputs = [t for t in (x, weight, head_bias) if t is not None]
    grads = torch.autograd.grad(loss, inputs, torch.ones_like(loss))
    for g, w in zip(grads, torch.autograd.grad(want, inputs, torch.ones_like(want)), strict=True):
        close(g, w, atol, rtol)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("has_ce_weight", [True, False], ids=["ce_weight", "no-ce_weight"])
@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"),
    [pytest.param(torch.bfloat16, 5e-3, 5e-2, id="bf16"), pytest.param(torch.float32, 1e-5, 5e-4, id="fp32")],
)
@pytest.mark.parametrize(("B", "T", "H", "V"), [(2, 2, 8, 8), (9, 7, 41, 41)], ids=["tiny", "weird"])
def test_correctness_functional(
    B: int,  # noqa: N803
    T: int,  # noqa: N803
    H: int,  # noqa: N803
    V: int,  # noqa: N803
    dtype: torch.dtype,
    atol: float,
    rtol: float,
    has_ce_weight: bool,
    bias: bool,
) -> None:
    """Their ``test_correctness_functional`` (every option at once, a random upstream gradient), against torch's
    reference where theirs compares two entry points of their own. Class weights from ``torch.rand`` (theirs:
    ``randn``, whose negative weights make a weighted mean ill-conditioned against another implementation)."""
    torch.manual_seed(42)
    x = torch.randn(B * T, H, dtype=dtype).requires_grad_()
    target = torch.randint(0, V, (B * T,))
    weight = torch.randn(V, H, dtype=dtype)
    head_bias = torch.randn(V, dtype=dtype) if bias else None
    options: dict[str, Any] = {
        "ce_weight": torch.rand(V) if has_ce_weight else None,
        "lse_square_scale": 1e-4,
        "label_smoothing": 0.1,
        "softcap": 30.0,
    }
    got = linear_cross_entropy(x, weight, target, bias=head_bias, chunk_size=5, return_z_loss=True, **options)
    want, want_z = reference(x, weight, head_bias, target, **options)
    close(got.loss, want, atol, rtol)
    close(got.z_loss, want_z, atol, rtol)
    upstream = torch.randn_like(want)
    (g,), (w,) = torch.autograd.grad(got.loss, [x], upstream), torch.autograd.grad(want, [x], upstream)
    close(g, w, atol, rtol)


@pytest.mark.parametrize("return_token_accuracy", [True, False], ids=["accuracy", "no-accuracy"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("reduction", "scalar", "dtype", "atol", "rtol"), DTYPES[:2])
@pytest.mark.parametrize(("B", "T", "H", "V"), SHAPES)
def test_correctness_with_token_accuracy(
    B: int,  # noqa: N803
    T: int,  # noqa: N803
    H: int,  # noqa: N803
    V: int,  # noqa: N803
    reduction: str,
    scalar: float,
    dtype: torch.dtype,
    atol: float,
    rtol: float,
    bias: bool,
    return_token_accuracy: bool,
) -> None:
    torch.manual_seed(42)
    weight, head_bias = head(V, H, dtype, bias)
    x = (torch.randn(B * T, H, dtype=dtype) * scalar).requires_grad_()
    target = targets(B * T, V, -100)
    got = linear_cross_entropy(
        x,
        weight,
        target,
        bias=head_bias,
        reduction=reduction,
        chunk_size=CHUNK,
        return_token_accuracy=return_token_accuracy,
    )
    loss = got.loss if return_token_accuracy else got
    if return_token_accuracy:
        with torch.no_grad():
            predictions = F.linear(x, weight, head_bias).argmax(-1)
            labelled = target != -100
            expected = ((predictions == target) & labelled).sum().float() / labelled.sum().float()
        close(got.token_accuracy, expected, atol, rtol)
    else:
        assert isinstance(got, Tensor)
    want, _ = reference(x, weight, head_bias, target, reduction=reduction)
    close(loss, want, atol, rtol)
    inputs = [t for t in (x, weight, head_bias) if t is not None]
    for g, w in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(want, inputs), strict=True):
        close(g, w, atol, rtol)


@pytest.mark.parametrize("cast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("B", "T", "H", "V"), SHAPES)
def test_amp(B: int, T: int, H: int, V: int, bias: bool, cast_dtype: torch.dtype) -> None:  # noqa: N803
    """Their ``test_amp``: float32 weights and inputs under autocast (atol 5e-3, rtol 5e-2)."""
    torch.manual_seed(42)
    weight, head_bias = head(V, H, torch.float32, bias)
    x = torch.randn(B * T, H).requires_grad_()
    target = torch.randint(0, V, (B * T,))
    with torch.autocast("cpu", dtype=cast_dtype):
        want, _ = reference(x, weight, head_bias, target)
        got = linear_cross_entropy(x, weight, target, bias=head_bias, chunk_size=CHUNK)
    close(got, want, 5e-3, 5e-2)
    for g, w in zip(torch.autograd.grad(got, [x, weight]), torch.autograd.grad(want, [x, weight]), strict=True):
        close(g, w, 5e-3, 5e-2)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("B", "T", "H", "V"), [(2, 16, 32, 64), (1, 32, 64, 128)])
def test_correctness_reduction_none_per_token_grad_output(B: int, T: int, H: int, V: int, bias: bool) -> None:  # noqa: N803
    """A per-token upstream gradient with ``reduction="none"`` reaches each token's share of the weight gradient."""
    torch.manual_seed(42)
    x = (torch.randn(B * T, H) * 0.1).requires_grad_()
    weight = (torch.randn(V, H) * 0.1).requires_grad_()
    head_bias = (torch.randn(V) * 0.1).requires_grad_() if bias else None
    target = torch.randint(0, V, (B * T,))
    upstream = torch.rand(B * T) + 0.5
    got = linear_cross_entropy(x, weight, target, bias=head_bias, reduction="none", chunk_size=7)
    want = F.cross_entropy(F.linear(x, weight, head_bias), target, reduction="none")
    close(got, want, 1e-4, 1e-4)
    inputs = [t for t in (x, weight, head_bias) if t is not None]
    for g, w in zip(
        torch.autograd.grad(got, inputs, upstream), torch.autograd.grad(want, inputs, upstream), strict=True
    ):
        close(g, w, 1e-4, 1e-4)


@pytest.mark.parametrize(
    ("return_z_loss", "return_token_accuracy"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_structured_output(return_z_loss: bool, return_token_accuracy: bool) -> None:
    """A tensor without either flag; with one, a structured output whose unrequested field is ``None``."""
    hidden = torch.tensor([[0.2, -0.1], [1.0, 0.5], [-0.3, 0.7]], requires_grad=True)
    weight = torch.tensor([[0.5, -0.4], [-0.2, 0.3], [0.1, 0.6]])
    bias = torch.tensor([0.1, -0.2, 0.05])
    target = torch.tensor([0, 1, 2])
    result = linear_cross_entropy(
        hidden, weight, target, bias=bias, return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy
    )
    logits = hidden @ weight.T + bias
    expected = F.cross_entropy(logits, target)
    if not (return_z_loss or return_token_accuracy):
        assert isinstance(result, Tensor)
        close(result, expected, 1e-6, 0)
        return
    assert isinstance(result, LinearCrossEntropyOutput)
    close(result.loss, expected, 1e-6, 0)
    assert (result.z_loss is not None) is return_z_loss
    if return_token_accuracy:
        close(result.token_accuracy, (logits.argmax(-1) == target).float().mean(), 1e-6, 0)
    else:
        assert result.token_accuracy is None
    result.loss.backward()
    assert hidden.grad is not None
