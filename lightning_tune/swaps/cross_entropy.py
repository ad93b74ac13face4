"""Cross-entropy of a linear head without the logits: :func:`linear_cross_entropy`.

The hidden states are multiplied by the head's weight a chunk of tokens at a time, each chunk reduced to its
log-sum-exp and target logit in float32 and dropped; the backward pass recomputes each chunk's logits. So at most one
chunk of logits exists at a time, forward or backward (docs/loss_swap.md has the arithmetic).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tune._validation import check_bool, check_choice, check_float, check_instance, check_int

#: How :func:`linear_cross_entropy` reduces the per-token losses.
Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)

#: Bytes of one default chunk's logits in float32 (the bound on what the loss holds, forward or backward, is about
#: twice this: the logits and their exponentials or gradient).
CHUNK_LOGITS_BYTES = 128 * 2**20
#: Fewest tokens in a default chunk: below it the head's weight gradient, added once per chunk, costs more than the
#: chunk's matrix products.
MIN_CHUNK_TOKENS = 256


def default_chunk_size(tokens: int, vocab: int, *, itemsize: int = 4) -> int:
    """Tokens per chunk when none is given: :data:`CHUNK_LOGITS_BYTES` of logits, at least :data:`MIN_CHUNK_TOKENS`.

    Args:
        tokens: Number of token rows (a chunk never holds more).
        vocab: Vocabulary size (rows of the head's weight).
        itemsize: Bytes of a reduced logit (4 for float32, 8 for float64).

    Example:
        >>> default_chunk_size(16_384, 128_256), default_chunk_size(16_384, 32_000), default_chunk_size(100, 32_000)
        (261, 1048, 100)
    """
    check_int("tokens", tokens, minimum=0)
    check_int("vocab", vocab, minimum=1)
    check_int("itemsize", itemsize, minimum=1)
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, CHUNK_LOGITS_BYTES // (vocab * itemsize))))


def check_loss_options(
    label_smoothing: float, ce_weight: Tensor | None, lse_square_scale: float, *, vocab: int | None = None
) -> None:
    """Check :func:`linear_cross_entropy`'s loss options; ``ce_weight`` must have ``vocab`` rows where given.

    Raises:
        TypeError: If an option has the wrong type, or ``ce_weight`` is not floating-point.
        ValueError: If an option's value or ``ce_weight``'s shape is not allowed.
    """
    check_float("label_smoothing", label_smoothing, low=0.0, high=1.0)
    check_float("lse_square_scale", lse_square_scale, low=0.0)
    check_instance("ce_weight", ce_weight, Tensor, "a torch.Tensor", allow_none=True)
    if ce_weight is None:
        return
    if not ce_weight.is_floating_point():
        raise TypeError(f"`ce_weight` must hold floating-point class weights, got dtype {ce_weight.dtype}")
    if ce_weight.ndim != 1 or (vocab is not None and ce_weight.shape[0] != vocab):
        want = "[vocab]" if vocab is None else f"({vocab},)"
        raise ValueError(
            f"`ce_weight` must have shape {want}, one weight per class, got shape {tuple(ce_weight.shape)}"
        )


def head_inputs(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, shift: bool, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states and labels by token (``shift``: labels moved left), ``weight`` in the dtype the head runs in."""
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if torch.is_autocast_enabled(hidden.device.type):  # the product in the autocast dtype, as nn.Linear runs it
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    return hidden, weight.to(hidden.dtype), labels.reshape(-1).to(hidden.device)


class LinearCrossEntropyOutput(NamedTuple):
    """What :func:`linear_cross_entropy` returns when a ``return_*`` flag is set (``None`` for those not set).

    Args:
        loss: The loss, z-loss included.
        z_loss: Its z-loss part.
        token_accuracy: The share of labelled tokens whose largest logit is the label's; per token for ``"none"``.
        predictions: Each position's ``logits.argmax(-1)`` (int64, the shape of ``labels``).
    """

    loss: Tensor
    z_loss: Tensor | None
    token_accuracy: Tensor | None
    predictions: Tensor | None = None


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
    """Per-token cross-entropy and log-sum-exp of ``hidden @ weight.T + bias``, chunked over tokens.

    The cross-entropy is ``F.cross_entropy(..., weight=, label_smoothing=, reduction="none")``'s; both are 0 where the
    label is ignored. With ``argmax``, also each token's largest logit's class (int64; empty without).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        class_weight: Tensor | None,
        ignore_index: int,
        chunk: int,
        softcap: float | None,
        smoothing: float,
        argmax: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        dtype, rows_total = _reduced(hidden.dtype), hidden.shape[0]
        losses = torch.zeros(rows_total, dtype=dtype, device=hidden.device)
        lse = torch.zeros_like(losses)
        predictions = torch.zeros(rows_total if argmax else 0, dtype=torch.int64, device=hidden.device)
        for start in range(0, rows_total, chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(hidden[rows], weight, bias, softcap)
            valid = labels[rows] != ignore_index
            target = torch.where(valid, labels[rows], 0)
            lse[rows] = torch.logsumexp(logits, dim=1)
            loss = lse[rows] - logits.gather(1, target.unsqueeze(1)).squeeze(1)  # -log p(label)
            if class_weight is not None:
                loss = loss * class_weight[target]
            if smoothing:  # -sum_c w_c log p_c / V, with w_c = 1 without class weights
                spread = lse[rows] * logits.shape[1] - logits.sum(1)
                if class_weight is not None:
                    spread = lse[rows] * class_weight.sum() - logits @ class_weight
                loss = (1.0 - smoothing) * loss + smoothing / logits.shape[1] * spread
            losses[rows] = torch.where(valid, loss, 0.0)
            if argmax:
                predictions[rows] = logits.argmax(1)
        ctx.save_for_backward(hidden, weight, bias, labels, class_weight, lse)
        ctx.ignore_index, ctx.chunk, ctx.softcap, ctx.smoothing = ignore_index, chunk, softcap, smoothing
        ctx.mark_non_differentiable(predictions)
        valid_lse = torch.where(labels != ignore_index, lse, 0.0)
        return losses, valid_lse, predictions

    @staticmethod
    def backward(ctx: Any, grad_losses: Tensor, grad_lse: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, class_weight, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        smoothing, softcap = ctx.smoothing, ctx.softcap
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=_reduced(weight.dtype), device=weight.device) if need_weight else None
        )
        grad_bias = torch.zeros(bias.shape, dtype=_reduced(bias.dtype), device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = _chunk_logits(hidden[rows], weight, bias, softcap)
            vocab = logits.shape[1]
            valid = labels[rows] != ctx.ignore_index
            target = torch.where(valid, labels[rows], 0)
            # d loss / d logit_c = p_c * (label part + smoothing part) - (1 - s) w_y [c = y] - s / V w_c;
            # d lse / d logit_c = p_c
            grad_loss = torch.where(valid, grad_losses[rows].to(logits.dtype), 0.0)
            w_y = 1.0 if class_weight is None else class_weight[target]
            w_sum = vocab if class_weight is None else class_weight.sum()
            on_p = grad_loss * ((1.0 - smoothing) * w_y + smoothing / vocab * w_sum) + grad_lse[rows]
            capped = 1.0 - (logits / softcap) ** 2 if softcap is not None else None  # d(cap tanh(x / cap)) / dx
            grad = logits.sub_(lse[rows].unsqueeze(1)).exp_().mul_(torch.where(valid, on_p, 0.0).unsqueeze(1))
            grad.scatter_add_(1, target.unsqueeze(1), (-(1.0 - smoothing) * grad_loss * w_y).unsqueeze(1))
            if smoothing:
                spread = (smoothing / vocab * grad_loss).unsqueeze(1)
                grad -= spread if class_weight is None else spread * class_weight
            if capped is not None:
                grad *= capped
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            grad_low = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_low @ weight
            if grad_weight is not None and grad_weight.dtype == grad_low.dtype:
                grad_weight.addmm_(grad_low.T, hidden[rows])
            elif grad_weight is not None:
                grad_weight += grad_low.T @ hidden[rows]
        weight_grad = None if grad_weight is None else grad_weight.to(weight.dtype)
        bias_grad = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, weight_grad, bias_grad, *[None] * 7  # labels and the options: none


@overload
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = ...,
    ignore_index: int = ...,
    reduction: Reduction = ...,
    shift: bool = ...,
    chunk_size: int | None = ...,
    softcap: float | None = ...,
    label_smoothing: float = ...,
    ce_weight: Tensor | None = ...,
    lse_square_scale: float = ...,
    return_z_loss: Literal[False] = ...,
    return_token_accuracy: Literal[False] = ...,
    return_predictions: Literal[False] = ...,
) -> Tensor: ...


@overload
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = ...,
    ignore_index: int = ...,
    reduction: Reduction = ...,
    shift: bool = ...,
    chunk_size: int | None = ...,
    softcap: float | None = ...,
    label_smoothing: float = ...,
    ce_weight: Tensor | None = ...,
    lse_square_scale: float = ...,
    return_z_loss: bool = ...,
    return_token_accuracy: bool = ...,
    return_predictions: bool = ...,
) -> LinearCrossEntropyOutput: ...


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
    label_smoothing: float = 0.0,
    ce_weight: Tensor | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predictions: bool = False,
) -> Tensor | LinearCrossEntropyOutput:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` without ever holding all the logits (docs/loss_swap.md).

    Args:
        hidden: Hidden states ``[..., hidden]`` (e.g. ``[batch, seq, hidden]``).
        weight: The head's weight ``[vocab, hidden]`` (``nn.Linear.weight``; the embedding matrix when tied).
        labels: Target ids of shape ``hidden.shape[:-1]``; ``ignore_index`` marks tokens without a loss.
        bias: The head's bias ``[vocab]``, if it has one.
        ignore_index: Label value that contributes neither loss nor gradient.
        reduction: ``"mean"`` over the labelled tokens (``nan`` when none), ``"sum"``, or ``"none"`` (0 where ignored).
        shift: Position ``t`` predicts label ``t + 1``, as Hugging Face's causal-LM loss shifts.
        chunk_size: Tokens per chunk; ``None``: :func:`default_chunk_size`.
        softcap: Apply ``softcap * tanh(logits / softcap)`` first (Gemma 2's ``final_logit_softcapping``).
        label_smoothing: In [0, 1], as ``F.cross_entropy``'s.
        ce_weight: Class weights ``[vocab]``, as ``F.cross_entropy``'s ``weight``.
        lse_square_scale: Adds the z-loss ``lse_square_scale * logsumexp(logits) ** 2`` of each labelled token.
        return_z_loss: Return a :class:`LinearCrossEntropyOutput` with the z-loss part of the loss.
        return_token_accuracy: Return a :class:`LinearCrossEntropyOutput` with the token accuracy (no gradient).
        return_predictions: Return a :class:`LinearCrossEntropyOutput` with each position's argmax (no gradient).

    Returns:
        The loss, a float32 scalar (``"mean"``, ``"sum"``) or a float32 tensor of ``labels``' shape (``"none"``); a
        :class:`LinearCrossEntropyOutput` when a ``return_*`` flag is set.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If the shapes do not match, or an argument's value is not allowed.

    Example:
        >>> hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
        >>> loss = linear_cross_entropy(hidden, weight, labels, chunk_size=3, label_smoothing=0.1)
        >>> want = F.cross_entropy((hidden @ weight.T).view(-1, 11), labels.view(-1), label_smoothing=0.1)
        >>> torch.allclose(loss, want)
        True
    """
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        check_instance(name, value, Tensor, "a torch.Tensor")
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
    check_instance("bias", bias, Tensor, "a torch.Tensor", allow_none=True)
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"`bias` must have shape {tuple(weight.shape[:1])}, got shape {tuple(bias.shape)}")
    check_loss_options(label_smoothing, ce_weight, lse_square_scale, vocab=weight.shape[0])
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"`labels` must hold integer class ids, got dtype {labels.dtype}")
    check_int("ignore_index", ignore_index, minimum=-(2**63), maximum=2**63 - 1)  # an int64 label
    check_bool("shift", shift)
    check_int("chunk_size", chunk_size, minimum=1, allow_none=True)
    check_float("softcap", softcap, low=0.0, low_inclusive=False, allow_none=True)
    check_bool("return_z_loss", return_z_loss)
    check_bool("return_token_accuracy", return_token_accuracy)
    check_bool("return_predictions", return_predictions)
    flat_hidden, weight, flat_labels = head_inputs(hidden, weight, labels, shift=shift, ignore_index=ignore_index)
    reduced = _reduced(flat_hidden.dtype)
    class_weight = None if ce_weight is None else ce_weight.detach().to(flat_hidden.device, reduced)
    chunk = chunk_size or default_chunk_size(flat_hidden.shape[0], weight.shape[0], itemsize=reduced.itemsize)
    with torch.autocast(hidden.device.type, enabled=False):
        losses, lse, predictions = _LinearCrossEntropy.apply(
            flat_hidden,
            weight,
            bias,
            flat_labels,
            class_weight,
            ignore_index,
            chunk,
            None if softcap is None else float(softcap),
            float(label_smoothing),
            return_token_accuracy or return_predictions,
        )
    z_losses = float(lse_square_scale) * lse.square()
    valid = flat_labels != ignore_index
    labelled = valid.sum()
    correct = (valid & (predictions == flat_labels)).to(losses.dtype) if return_token_accuracy else None
    if reduction == "none":
        loss, z_loss = losses.view(labels.shape), z_losses.view(labels.shape)
        accuracy = None if correct is None else correct.view(labels.shape)
    else:
        per_label = labelled if reduction == "mean" else 1
        per_weight = per_label  # "mean" with class weights: over the labelled tokens' weights, as F.cross_entropy
        if class_weight is not None and reduction == "mean":
            per_weight = torch.where(valid, class_weight[torch.where(valid, flat_labels, 0)], 0.0).sum()
        loss, z_loss = losses.sum() / per_weight, z_losses.sum() / per_label
        accuracy = None if correct is None else correct.sum() / labelled
    loss = loss + z_loss
    if not (return_z_loss or return_token_accuracy or return_predictions):
        return loss
    return LinearCrossEntropyOutput(
        loss,
        z_loss if return_z_loss else None,
        accuracy,
        predictions.view(labels.shape) if return_predictions else None,
    )
