"""Cross-entropy of a linear head without the logits: :func:`linear_cross_entropy`.

For a language model the head's logits are the largest activation of training: ``tokens x vocabulary`` values, upcast
to float32 for the loss, with a gradient of the same size and ``log_softmax``'s copy beside them. Here the hidden
states are multiplied by the head's weight a chunk of tokens at a time, each chunk reduced to its log-sum-exp and
target logit in float32 and dropped; the backward pass recomputes each chunk's logits and turns them straight into
the chunk's share of the gradients. So at most one chunk of logits exists at a time, forward or backward.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tune._validation import check_bool, check_choice, check_float, check_int

__all__ = ["REDUCTIONS", "Reduction", "default_chunk_size", "linear_cross_entropy"]

#: How :func:`linear_cross_entropy` reduces the per-token losses.
Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)


def default_chunk_size(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk when none is given: one chunk's logits hold about as many values as the hidden states.

    Args:
        tokens: Number of token rows.
        vocab: Vocabulary size (rows of the head's weight).
        hidden: Hidden size.

    Returns:
        ``ceil(tokens / ceil(vocab / hidden))``, at least 1.

    Example:
        >>> default_chunk_size(4096, 128_256, 2048)
        66
    """
    return max(1, math.ceil(tokens / math.ceil(vocab / hidden)))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    logits = (hidden @ weight.T).to(_reduced(hidden.dtype))
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _reduced(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float32, or float64 for float64 inputs


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token losses of ``cross_entropy(hidden @ weight.T + bias, labels)``, chunked over tokens."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        ignore_index: int,
        chunk: int,
        softcap: float | None,
    ) -> Tensor:
        losses = torch.zeros(hidden.shape[0], dtype=_reduced(hidden.dtype), device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(hidden[rows], weight, bias, softcap)
            target = labels[rows]
            valid = target != ignore_index
            picked = logits.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
            losses[rows] = torch.where(valid, torch.logsumexp(logits, dim=1) - picked, 0.0)
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.ignore_index, ctx.chunk, ctx.softcap = ignore_index, chunk, softcap
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=_reduced(weight.dtype), device=weight.device) if need_weight else None
        )
        grad_bias = torch.zeros(bias.shape, dtype=_reduced(bias.dtype), device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = _chunk_logits(hidden[rows], weight, bias, ctx.softcap)
            target = labels[rows]
            valid = target != ctx.ignore_index
            grad = torch.softmax(logits, dim=1)
            grad.scatter_add_(1, torch.where(valid, target, 0).unsqueeze(1), torch.full_like(grad[:, :1], -1.0))
            grad *= torch.where(valid, grad_losses[rows].to(grad.dtype), 0.0).unsqueeze(1)
            if ctx.softcap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2 = 1 - (capped / cap)^2
                grad *= 1.0 - (logits / ctx.softcap) ** 2
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            grad_low = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_low @ weight
            if grad_weight is not None:
                grad_weight += grad_low.T @ hidden[rows]
        weight_grad = None if grad_weight is None else grad_weight.to(weight.dtype)
        bias_grad = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, weight_grad, bias_grad, None, None, None, None  # labels, ignore_index, chunk, softcap: none


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    shift: bool = False,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` without ever holding all the logits.

    The result and the gradients of ``hidden``, ``weight`` and ``bias`` are those of the unchunked loss (the logits
    are reduced in float32, as Hugging Face's loss upcasts them). Under autocast the matrix products run in the
    autocast dtype, as the head's ``nn.Linear`` would, and the gradients come back in the inputs' dtypes. A weight
    that does not require grad (a frozen head under LoRA) gets no gradient computed.

    Args:
        hidden: Hidden states ``[..., hidden]`` (e.g. ``[batch, seq, hidden]``).
        weight: The head's weight ``[vocab, hidden]`` (``nn.Linear.weight``; the embedding matrix when tied).
        labels: Target ids of shape ``hidden.shape[:-1]``; ``ignore_index`` marks tokens without a loss.
        bias: The head's bias ``[vocab]``, if it has one.
        ignore_index: Label value that contributes neither loss nor gradient.
        reduction: ``"mean"`` over the tokens whose label is not ``ignore_index`` (``nan`` when there are none, as
            ``F.cross_entropy`` and Hugging Face give), ``"sum"``, or ``"none"`` (one loss per token, 0 where
            ignored, in the shape of ``labels``).
        shift: Position ``t`` predicts label ``t + 1``, as Hugging Face's causal-LM loss shifts: the labels are moved
            left by one along the last dimension and the last position gets ``ignore_index``.
        chunk_size: Tokens per chunk; ``None`` chooses chunks whose logits are about the size of the hidden states
            (:func:`default_chunk_size`).
        softcap: Apply ``softcap * tanh(logits / softcap)`` to the logits first (Gemma 2's
            ``final_logit_softcapping``).

    Returns:
        The loss, a float32 scalar (``"mean"``, ``"sum"``) or a float32 tensor of ``labels``' shape (``"none"``).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If the shapes do not match, or ``reduction``, ``chunk_size`` or ``softcap`` is invalid.

    Example:
        >>> hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
        >>> loss = linear_cross_entropy(hidden, weight, labels, chunk_size=3)
        >>> torch.allclose(loss, F.cross_entropy((hidden @ weight.T).view(-1, 11), labels.view(-1)))
        True
    """
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(value, Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")
    check_choice("reduction", reduction, REDUCTIONS)
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"`weight` must have shape [vocab, {hidden.shape[-1]}] for `hidden` of shape {tuple(hidden.shape)}, "
            f"got shape {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"`labels` must have shape {tuple(hidden.shape[:-1])} (that of `hidden` without its last dimension), "
            f"got shape {tuple(labels.shape)}"
        )
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"`bias` must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"`bias` must have shape {tuple(weight.shape[:1])}, got shape {tuple(bias.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"`labels` must hold integer class ids, got dtype {labels.dtype}")
    check_int("ignore_index", ignore_index, minimum=-(2**63), maximum=2**63 - 1)  # an int64 label
    check_bool("shift", shift)
    check_int("chunk_size", chunk_size, minimum=1, allow_none=True)
    check_float("softcap", softcap, low=0.0, low_inclusive=False, allow_none=True)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    if torch.is_autocast_enabled(hidden.device.type):  # the head's matmul runs in the autocast dtype, as nn.Linear's
        dtype = torch.get_autocast_dtype(hidden.device.type)
        flat_hidden, weight = flat_hidden.to(dtype), weight.to(dtype)
    else:
        weight = weight.to(flat_hidden.dtype)
    chunk = chunk_size or default_chunk_size(flat_hidden.shape[0], weight.shape[0], weight.shape[1])
    with torch.autocast(hidden.device.type, enabled=False):
        losses = _LinearCrossEntropy.apply(
            flat_hidden, weight, bias, flat_labels, ignore_index, chunk, None if softcap is None else float(softcap)
        )
    if reduction == "none":
        return losses.view(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (flat_labels != ignore_index).sum()
