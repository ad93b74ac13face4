"""Analytic memory estimate of training a transformer from its shape: no model is built, any machine can run it.

Bytes per parameter (``e`` = 4 for fp32, 2 for fp16/bf16; ``u`` = the dtype of the tensor the optimizer updates,
4 with float32 master weights or in fp32, else ``e``):

- weights ``e`` for every parameter; gradients ``e`` for every trainable one;
- master weights: 4 per trainable parameter when ``master_weights`` (the default in 16-bit);
- optimizer state per trainable parameter: ``"adamw"`` two moments, ``2u``, as ``torch.optim.AdamW`` keeps them
  (and a 4-byte step count per tensor);
  ``"sgd"`` one momentum buffer, ``u``; ``"adamw8bit"`` bitsandbytes' block-wise 8-bit moments, ``2`` bytes plus
  one float32 scale per 256 values, except tensors under 4096 values and embeddings, which keep 32-bit moments
  (``8``), as the pack's ``OptimizerSwap`` sets it up (plus bitsandbytes' two 256-entry code books).

Activations per sample follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models": per layer and token, what autograd keeps for the backward pass, in the activation dtype. For a GPT block
with dropout and eager attention that is ``h * (34 + 5 * a * s / h)`` bytes in 16-bit, the paper's figure; the same
inventory covers a SwiGLU MLP, grouped-query attention and frozen (LoRA) weights:

- both norms' inputs ``2h``, the attention input ``h``, queries/keys/values, the output projection's input ``q``;
- eager attention: keys and values expanded to every query head (``3q``), the softmax output ``a * s`` per token
  (plus, with dropout, its 1-byte mask and the dropped copy); flash attention: ``q + 2kv`` and a float32
  log-sum-exp per head, no ``s``-sized term;
- MLP: its input ``h``; SwiGLU ``4i`` (gate, up, SiLU output, product), GELU ``2i``; with frozen weights the inputs
  that only weight gradients need are not kept;
- dropout: one byte per residual value; LoRA adapters keep their rank-``r`` intermediate;
- once per model: the final norm and head inputs, the logits (``V * e``) and the float32 loss over the vocabulary
  (log-probabilities and their gradient, ``2 * V * 4``), and the int64 inputs and labels.

With ``gradient_checkpointing`` each block keeps only its input (``h`` per token) and one block's activations are
recomputed at a time. Norms and activation functions are counted as fused kernels (the paper's assumption);
Hugging Face's RMSNorm keeps float32 copies and needs more, which :func:`~lightning_tune.plan.measure_memory` sees.

Example:
    >>> estimate = estimate_memory("llama-2-7b", sequence_length=2048, precision="bf16")
    >>> round(estimate.weight_bytes / 2**30, 2), round(estimate.fixed_bytes / 2**30, 1)
    (12.55, 100.4)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal, get_args

from lightning_tune._validation import check_bool, check_choice, check_int
from lightning_tune.plan.estimate import MemoryEstimate
from lightning_tune.plan.shapes import TransformerShape, from_hf_config, get_shape

__all__ = [
    "ATTENTIONS",
    "Attention",
    "OPTIMIZERS",
    "Optimizer",
    "PRECISIONS",
    "Precision",
    "estimate_memory",
    "lora_parameters",
]

#: Dtype the weights and activations are held in.
Precision = Literal["fp32", "fp16", "bf16"]
PRECISIONS: Final[tuple[str, ...]] = get_args(Precision)

#: Optimizers the analytic estimate knows.
Optimizer = Literal["adamw", "adamw8bit", "sgd"]
OPTIMIZERS: Final[tuple[str, ...]] = get_args(Optimizer)

#: Attention implementations: ``"flash"`` (FlashAttention or SDPA's fused kernels) or ``"eager"`` (softmax kept).
Attention = Literal["flash", "eager"]
ATTENTIONS: Final[tuple[str, ...]] = get_args(Attention)

_ELEMENT_BYTES: Final[dict[str, int]] = {"fp32": 4, "fp16": 2, "bf16": 2}
_MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep 32-bit state
_BLOCK = 256  # bitsandbytes' block-wise quantisation: one float32 scale per block
_QUANTISATION_MAPS = 2 * 256 * 4  # bitsandbytes' two float32 code books, shared by every 8-bit tensor


@dataclass(frozen=True)
class _Tensor:
    """One parameter tensor of a shape: its size, whether it trains, whether it is an embedding table."""

    numel: int
    trainable: bool
    embedding: bool = False


def lora_parameters(shape: TransformerShape, rank: int) -> int:
    """Parameters of rank-``rank`` LoRA adapters on every block's query, key, value and output projections.

    Each adapted ``in -> out`` projection gains ``A`` (``rank x in``) and ``B`` (``out x rank``).

    Args:
        shape: The model.
        rank: The adapters' rank, >= 1.

    Returns:
        The count.

    Raises:
        TypeError: If ``rank`` is not an integer.
        ValueError: If ``rank`` < 1.

    Example:
        >>> from lightning_tune.plan.shapes import get_shape
        >>> lora_parameters(get_shape("llama-2-7b"), 8)  # 32 layers x 4 projections x 8 x (4096 + 4096)
        8388608
    """
    check_int("rank", rank, minimum=1)
    return sum(t.numel for t in _lora_tensors(shape, rank))


def _lora_tensors(shape: TransformerShape, rank: int) -> Iterator[_Tensor]:
    h, q, kv = shape.hidden_size, shape.q_size, shape.kv_size
    for _ in range(shape.num_layers):
        for fan_in, fan_out in ((h, q), (h, kv), (h, kv), (q, h)):
            yield _Tensor(rank * fan_in, True)
            yield _Tensor(fan_out * rank, True)


def _base_tensors(shape: TransformerShape, trainable: bool) -> Iterator[_Tensor]:
    """Every parameter tensor of the base model (a tied head once, as the embedding)."""
    h, q, kv, i = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size
    norm = [h] if shape.family == "llama" else [h, h]
    yield _Tensor(shape.vocab_size * h, trainable, embedding=True)
    if shape.family == "gpt2":
        yield _Tensor(shape.max_position_embeddings * h, trainable, embedding=True)
    for _ in range(shape.num_layers):
        sizes = [*norm, h * q, h * kv, h * kv, q * h, *norm]
        sizes += [q, kv, kv] if shape.qkv_bias else []
        sizes += [h] if shape.output_bias else []
        if shape.family == "llama":
            sizes += [h * i, h * i, i * h] + ([i, i, h] if shape.mlp_bias else [])
        else:
            sizes += [h * i, i * h] + ([i, h] if shape.mlp_bias else [])
        yield from (_Tensor(n, trainable) for n in sizes)
    yield from (_Tensor(n, trainable) for n in norm)
    if not shape.tie_word_embeddings:
        yield _Tensor(shape.vocab_size * h, trainable)


def _optimizer_bytes(tensors: list[_Tensor], optimizer: str, update_bytes: int) -> int:
    total = 0
    quantised = False
    for t in tensors:
        if not t.trainable:
            continue
        if optimizer == "adamw":
            total += 2 * update_bytes * t.numel + 4  # two moments and a float32 step count
        elif optimizer == "sgd":
            total += update_bytes * t.numel
        elif t.numel < _MIN_8BIT_SIZE or t.embedding:  # adamw8bit, kept 32-bit
            total += 2 * 4 * t.numel
        else:  # adamw8bit: two uint8 moments and a float32 scale per block for each
            total += 2 * (t.numel + 4 * math.ceil(t.numel / _BLOCK))
            quantised = True
    return total + (_QUANTISATION_MAPS if quantised else 0)


def _layer_activation_bytes(
    shape: TransformerShape, sequence_length: int, e: int, attention: str, frozen: bool, lora_rank: int | None
) -> int:
    """Bytes one block keeps for backward, per token."""
    h, q, kv, i, a = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size, shape.num_heads
    s = sequence_length
    values = 2 * h + h + q  # norm inputs, attention input, output-projection input
    extra = 0  # bytes not in the activation dtype
    if attention == "flash":
        values += q + 2 * kv
        extra += 4 * a  # float32 log-sum-exp per head
    else:
        values += 3 * q + a * s  # queries, expanded keys and values, softmax output
        if shape.dropout:
            values += a * s  # dropped-out probabilities
            extra += a * s  # dropout mask
    if shape.family == "llama":
        values += 3 * i if frozen else h + 4 * i
    else:
        values += i if frozen else h + 2 * i
    if shape.dropout:
        extra += 2 * h  # residual dropout masks
    if lora_rank is not None:
        values += 4 * lora_rank
    return values * e + extra


def _activation_bytes_per_sample(
    shape: TransformerShape,
    sequence_length: int,
    e: int,
    attention: str,
    gradient_checkpointing: bool,
    frozen: bool,
    lora_rank: int | None,
) -> int:
    layer = _layer_activation_bytes(shape, sequence_length, e, attention, frozen, lora_rank)
    layers = shape.num_layers * shape.hidden_size * e + layer if gradient_checkpointing else shape.num_layers * layer
    head = 2 * shape.hidden_size * e + shape.vocab_size * e + 2 * shape.vocab_size * 4
    inputs = 2 * 8 + (shape.hidden_size if shape.dropout else 0)  # int64 ids and labels, embedding dropout mask
    return sequence_length * (layers + head + inputs)


def _resolve(model: str | os.PathLike[str] | TransformerShape) -> TransformerShape:
    if isinstance(model, TransformerShape):
        return model
    if isinstance(model, os.PathLike) or (isinstance(model, str) and model.endswith(".json")):
        return from_hf_config(model)
    if isinstance(model, str):
        if os.path.isdir(model):
            if not os.path.isfile(os.path.join(model, "config.json")):
                raise FileNotFoundError(f"`model`: the directory {model!r} has no config.json")
            return from_hf_config(model)
        return get_shape(model)
    raise TypeError(
        "`model` must be a model name, a path to a Hugging Face config.json or a TransformerShape, got "
        f"{model!r} ({type(model).__name__}); for an nn.Module use measure_memory"
    )


def estimate_memory(
    model: str | os.PathLike[str] | TransformerShape,
    *,
    sequence_length: int,
    precision: Precision = "bf16",
    optimizer: Optimizer = "adamw",
    master_weights: bool | None = None,
    attention: Attention = "flash",
    gradient_checkpointing: bool = False,
    lora_rank: int | None = None,
) -> MemoryEstimate:
    """Estimate the training memory of a transformer from its shape (the arithmetic is in the module docstring).

    Args:
        model: A name from :data:`~lightning_tune.plan.shapes.MODEL_SHAPES`, a path to a Hugging Face
            ``config.json`` (or its directory), or a :class:`~lightning_tune.plan.shapes.TransformerShape`.
        sequence_length: Tokens per sample, >= 1.
        precision: Dtype of weights, gradients and activations: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        optimizer: ``"adamw"``, ``"adamw8bit"`` (bitsandbytes) or ``"sgd"`` (with momentum).
        master_weights: Keep float32 master copies of 16-bit trainable weights (and step them, so 32-bit optimizer
            state); ``None`` means yes in fp16/bf16. Not allowed with ``"fp32"``.
        attention: ``"flash"`` (no ``s x s`` matrix kept) or ``"eager"``.
        gradient_checkpointing: Recompute each block in backward, keeping only block inputs.
        lora_rank: Train only rank-``r`` LoRA adapters on the attention's query, key, value and output projections;
            the base weights are frozen (no gradients, no optimizer state). ``None`` trains every weight. At most the
            smallest side of those projections (``hidden_size``, or the key/value width with grouped-query attention).

    Returns:
        The estimate; ``fixed_bytes`` is weights + gradients + master weights + optimizer state + buffers and
        ``bytes_per_sample`` the activations of one sample.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a value is not allowed, the model name is unknown (the message lists known names) or
            ``master_weights=True`` is given with ``"fp32"``.
        FileNotFoundError: If a config path does not exist.

    Example:
        >>> estimate = estimate_memory("gpt2", sequence_length=1024, precision="fp32")
        >>> estimate.parameters, estimate.weight_bytes
        (124439808, 497759232)
    """
    shape = _resolve(model)
    check_int("sequence_length", sequence_length, minimum=1)
    if shape.family == "gpt2" and sequence_length > shape.max_position_embeddings:
        raise ValueError(
            f"`sequence_length` must be at most {shape.max_position_embeddings} for {shape.name or 'this model'} "
            f"(its learned position table), got {sequence_length}"
        )
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    if master_weights is not None:
        check_bool("master_weights", master_weights)
    check_choice("attention", attention, ATTENTIONS)
    check_bool("gradient_checkpointing", gradient_checkpointing)
    check_int("lora_rank", lora_rank, minimum=1, allow_none=True)
    full_rank = min(shape.hidden_size, shape.q_size, shape.kv_size)
    if lora_rank is not None and lora_rank > full_rank:
        raise ValueError(
            f"`lora_rank` must be an integer from 1 to {full_rank} for {shape.name or 'this model'} (the smallest "
            "side of its q/k/v/o projections; a higher rank trains more than the full weight), got "
            f"{lora_rank}"
        )
    e = _ELEMENT_BYTES[precision]
    if master_weights and e == 4:
        raise ValueError("`master_weights` must be False or None with precision 'fp32' (the weights are float32)")
    master = e != 4 if master_weights is None else master_weights
    update_bytes = 4 if master else e

    frozen = lora_rank is not None
    tensors = list(_base_tensors(shape, trainable=not frozen))
    if lora_rank is not None:
        tensors += list(_lora_tensors(shape, lora_rank))
    parameters = sum(t.numel for t in tensors)
    trainable = sum(t.numel for t in tensors if t.trainable)
    weight_bytes = e * parameters
    gradient_bytes = e * trainable
    master_bytes = 4 * trainable if master else 0
    optimizer_bytes = _optimizer_bytes(tensors, optimizer, update_bytes)
    buffer_bytes = shape.buffer_bytes()
    per_sample = _activation_bytes_per_sample(
        shape, sequence_length, e, attention, gradient_checkpointing, frozen, lora_rank
    )
    notes = [
        f"{shape.name or shape.family}: {precision} weights and activations, "
        + ("float32 master weights, " if master else "")
        + {"adamw": "AdamW", "adamw8bit": "8-bit AdamW (bitsandbytes)", "sgd": "SGD with momentum"}[optimizer]
        + f", {attention} attention"
        + (", gradient checkpointing" if gradient_checkpointing else "")
        + (f", LoRA rank {lora_rank} on q/k/v/o (base frozen)" if lora_rank is not None else ""),
    ]
    return MemoryEstimate(
        parameters=parameters,
        trainable_parameters=trainable,
        weight_bytes=weight_bytes,
        gradient_bytes=gradient_bytes,
        master_weight_bytes=master_bytes,
        optimizer_bytes=optimizer_bytes,
        buffer_bytes=buffer_bytes,
        fixed_bytes=weight_bytes + gradient_bytes + master_bytes + optimizer_bytes + buffer_bytes,
        bytes_per_sample=per_sample,
        largest_layer_parameters=shape.largest_layer_parameters(),
        sequence_length=sequence_length,
        source="analytic",
        notes=tuple(notes),
    )
