"""What a training run holds: :class:`MemoryEstimate`, and :func:`estimate_memory`, counted from a transformer's shape.

No model is built; activations follow Korthikanti et al. 2022 (``docs/planner.md`` gives the arithmetic).

Example:
    >>> estimate = estimate_memory("llama-2-7b", sequence_length=2048, precision="bf16-mixed")
    >>> round(estimate.weight_bytes / 2**30, 2), round(estimate.fixed_bytes / 2**30, 1)
    (12.55, 100.4)
    >>> estimate.batch_sizes(80 * 2**30)
    {'safe': 0, 'optimal': 0, 'aggressive': 0}
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Final, Literal, get_args

from lightning_tune._validation import check_bool, check_choice, check_instance, check_int
from lightning_tune.plan.shapes import TransformerShape, from_hf_config, get_shape
from lightning_tune.vocab import (
    PLAN_MODES,
    PRECISIONS,
    Attention,
    OptimizerName,
    PlanMode,
    Precision,
    canonical_attention,
    canonical_optimizer,
    canonical_precision,
    precision_bytes,
)

#: The precisions a plan is made for: all but ``"auto"`` (it depends on the GPU) and transformer-engine's float8.
PLAN_PRECISIONS: Final[tuple[str, ...]] = tuple(p for p in PRECISIONS if p != "auto" and "transformer" not in p)

#: Names of the margins a budget is cut by.
Margin = Literal["safe", "optimal", "aggressive"]
MARGINS: Final[tuple[str, ...]] = get_args(Margin)

#: Share of the budget each margin keeps back.
MARGIN_RESERVE: Final[Mapping[str, float]] = MappingProxyType({"safe": 0.20, "optimal": 0.10, "aggressive": 0.05})


def format_bytes(n: int) -> str:
    """A byte count in GiB, MiB, KiB or bytes (binary units), as the planner prints it.

    Example:
        >>> format_bytes(13_476_831_232), format_bytes(3 * 2**20), format_bytes(512)
        ('12.55 GiB', '3.0 MiB', '512 B')
    """
    check_int("n", n, minimum=0)
    for unit, size, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if n >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Training memory of one model setting: a breakdown in bytes and a linear model of the peak.

    ``fixed_bytes`` and ``bytes_per_sample`` are what the batch-size arithmetic uses: the sums of the breakdown for an
    analytic estimate, a fit of peaks at two batch sizes for a measured one (which may differ from the sum).

    Args:
        parameters: All parameters, counted once.
        weight_bytes: Bytes of the weights as the model holds them ("model size").
        bytes_per_sample: What each extra sample adds to the peak (activations, inputs).
        fixed_bytes: Everything at the peak that does not grow with the batch.
        trainable_parameters: Parameters that get gradients; ``None`` means ``parameters``.
        gradient_bytes: Bytes of the gradients.
        master_weight_bytes: Bytes of float32 master copies of 16-bit weights (0 when there are none).
        optimizer_bytes: Bytes of the optimizer's state.
        buffer_bytes: Bytes of the model's buffers.
        largest_layer_parameters: Parameters of the largest module (ZeRO stage 3 gathers one at a time); ``None``
            means ``parameters``.
        sequence_length: Sequence length the activations were sized for, if any.
        source: ``"analytic"`` (from a shape) or ``"measured"`` (from a fake-tensor training step).
        notes: One line per assumption worth printing next to the figures.
        mode: What the figures are for, one of :data:`PLAN_MODES` (``docs/planner.md``, Evaluation memory).
        fit_fixed_bytes: With ``"eval"``/``"predict"``: the fixed bytes of evaluation inside ``fit`` (the training
            state resident); ``None`` when not planned.

    Raises:
        TypeError: If a count is not an integer.
        ValueError: If a count is negative or ``bytes_per_sample`` is 0.
    """

    parameters: int
    weight_bytes: int
    bytes_per_sample: int
    fixed_bytes: int
    trainable_parameters: int | None = None
    gradient_bytes: int = 0
    master_weight_bytes: int = 0
    optimizer_bytes: int = 0
    buffer_bytes: int = 0
    largest_layer_parameters: int | None = None
    sequence_length: int | None = None
    source: Literal["analytic", "measured"] = "analytic"
    notes: tuple[str, ...] = field(default=())
    mode: PlanMode = "train"
    fit_fixed_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):  # the counts; None: filled in below, or not planned
            if f.type in ("int", "int | None"):
                minimum = 1 if f.name in ("bytes_per_sample", "sequence_length", "fit_fixed_bytes") else 0
                check_int(f.name, getattr(self, f.name), minimum=minimum, allow_none=f.type != "int")
        check_choice("source", self.source, ("analytic", "measured"))
        check_choice("mode", self.mode, PLAN_MODES)
        if not isinstance(self.notes, tuple) or not all(isinstance(note, str) for note in self.notes):
            raise TypeError(f"`notes` must be a tuple of strings, got {self.notes!r} ({type(self.notes).__name__})")
        if self.trainable_parameters is None:
            object.__setattr__(self, "trainable_parameters", self.parameters)
        if self.largest_layer_parameters is None:
            object.__setattr__(self, "largest_layer_parameters", self.parameters)

    @property
    def state_bytes(self) -> int:
        """Weights, gradients, master weights and optimizer state: what ZeRO shards."""
        return self.weight_bytes + self.gradient_bytes + self.master_weight_bytes + self.optimizer_bytes

    def total_bytes(self, batch_size: int) -> int:
        """Predicted peak memory in bytes at ``batch_size``: ``fixed_bytes + bytes_per_sample * batch_size``.

        Args:
            batch_size: Samples per micro-batch, >= 0.

        Raises:
            TypeError: If ``batch_size`` is not an integer.
            ValueError: If ``batch_size`` is negative.
        """
        check_int("batch_size", batch_size, minimum=0)
        return self.fixed_bytes + self.bytes_per_sample * batch_size

    def usable_bytes(self, budget_bytes: int, margin: Margin = "optimal") -> int:
        """The part of a budget a margin leaves to the model: ``floor(budget_bytes * (1 - reserve))``.

        Args:
            budget_bytes: Memory of one device, in bytes.
            margin: ``"safe"``, ``"optimal"`` or ``"aggressive"``.

        Raises:
            TypeError: If ``budget_bytes`` is not an integer.
            ValueError: If ``budget_bytes`` is negative or ``margin`` is unknown.
        """
        check_int("budget_bytes", budget_bytes, minimum=0)
        check_choice("margin", margin, MARGINS)
        return int(budget_bytes * (1.0 - MARGIN_RESERVE[margin]))

    def max_batch_size(self, budget_bytes: int, margin: Margin = "optimal") -> int:
        """Largest batch whose predicted peak fits the budget after the margin; 0 when not even one sample fits.

        Args:
            budget_bytes: Memory of one device, in bytes.
            margin: ``"safe"``, ``"optimal"`` or ``"aggressive"``.

        Raises:
            TypeError: If ``budget_bytes`` is not an integer.
            ValueError: If ``budget_bytes`` is negative or ``margin`` is unknown.
        """
        usable = self.usable_bytes(budget_bytes, margin)
        return max(0, (usable - self.fixed_bytes) // self.bytes_per_sample)

    def batch_sizes(self, budget_bytes: int) -> dict[str, int]:
        """:meth:`max_batch_size` at every margin: ``{"safe": n, "optimal": n, "aggressive": n}``.

        Args:
            budget_bytes: Memory of one device, in bytes.

        Raises:
            TypeError: If ``budget_bytes`` is not an integer.
            ValueError: If ``budget_bytes`` is negative.
        """
        return {margin: self.max_batch_size(budget_bytes, margin) for margin in MARGINS}  # type: ignore[arg-type]


#: 8-bit states per value of each bitsandbytes optimizer (Adam: two moments; Lion, SGD: one).
_8BIT_STATES: Final[dict[str, int]] = {"lion8bit": 1, "paged_lion8bit": 1, "sgd8bit": 1}
_MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep 32-bit state
_BLOCK = 256  # bitsandbytes' block-wise quantisation: one float32 scale per block
_CODE_BOOK = 256 * 4  # bitsandbytes' float32 code book per state, shared by every 8-bit tensor


@dataclass(frozen=True)
class _Tensor:
    """``count`` parameter tensors of a shape alike: their size, whether they train, whether they embed tokens."""

    numel: int
    trainable: bool
    embedding: bool = False
    count: int = 1


def lora_parameters(shape: TransformerShape, rank: int) -> int:
    """Parameters of rank-``rank`` LoRA adapters on every block's q/k/v/o projections: ``A`` and ``B`` on each.

    Example:
        >>> lora_parameters(get_shape("llama-2-7b"), 8)  # 32 layers x 4 projections x 8 x (4096 + 4096)
        8388608
    """
    check_instance("shape", shape, TransformerShape, "a TransformerShape (get_shape, from_hf_config)")
    check_int("rank", rank, minimum=1)
    return sum(t.numel * t.count for t in _lora_tensors(shape, rank))


def _lora_tensors(shape: TransformerShape, rank: int) -> Iterator[_Tensor]:
    h, q, kv = shape.hidden_size, shape.q_size, shape.kv_size
    for fan_in, fan_out in ((h, q), (h, kv), (h, kv), (q, h)):  # one adapter pair per projection of each block
        yield _Tensor(rank * fan_in, True, count=shape.attention_blocks)
        yield _Tensor(fan_out * rank, True, count=shape.attention_blocks)


def _optimizer_bytes(tensors: list[_Tensor], optimizer: str, update_bytes: int) -> int:
    states = _8BIT_STATES.get(optimizer, 2)
    total = 0
    quantised = False
    for t in (t for t in tensors if t.trainable):
        if optimizer in ("adamw", "adamw_fused"):
            total += t.count * (2 * update_bytes * t.numel + 4)  # two moments and a float32 step count
        elif optimizer == "sgd":
            total += t.count * update_bytes * t.numel
        elif t.numel < _MIN_8BIT_SIZE or t.embedding:  # bitsandbytes, kept 32-bit
            total += t.count * states * 4 * t.numel
        else:  # bitsandbytes: uint8 states and a float32 scale per block for each
            total += t.count * states * (t.numel + 4 * math.ceil(t.numel / _BLOCK))
            quantised = True
    return total + (states * _CODE_BOOK if quantised else 0)


def _layer_activation_bytes(
    shape: TransformerShape, s: int, e: int, attention: str, lora_rank: int | None, cross_attention: bool = False
) -> int:
    """Bytes one block keeps for backward, per token; a ``"t5"`` decoder block adds a cross-attention sub-block."""
    h, q, kv, i, a = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size, shape.num_heads
    sublayers = 1 if shape.family == "phi" else 3 if cross_attention else 2  # Phi: attention and MLP in parallel
    blocks = 2 if cross_attention else 1
    values = sublayers * h + blocks * (h + q)  # norm inputs; per attention block its input and the o-proj input
    extra = 0  # bytes not in the activation dtype
    if attention != "eager":
        values += blocks * (q + 2 * kv)
        extra += blocks * 4 * a  # float32 log-sum-exp per head
    else:
        values += blocks * (3 * q + a * s)  # queries, expanded keys and values, softmax output
        if shape.dropout:
            values += blocks * a * s  # dropped-out probabilities
            extra += blocks * a * s  # dropout mask
    mlp = (3 * i if shape.gated else i) if lora_rank is not None else h + (4 * i if shape.gated else 2 * i)
    values += max(shape.experts_per_token, 1) * mlp  # a token's activations in each expert it is routed to
    extra += 4 * shape.num_experts  # float32 router logits
    if shape.dropout:
        extra += sublayers * h  # residual dropout masks
    if lora_rank is not None:
        values += blocks * 4 * lora_rank
    return values * e + extra


def _activation_bytes_per_sample(
    shape: TransformerShape, s: int, e: int, attention: str, checkpointing: bool, lora_rank: int | None, loss_swap: bool
) -> int:
    h, blocks = shape.hidden_size, shape.num_layers + shape.num_decoder_layers
    layer = _layer_activation_bytes(shape, s, e, attention, lora_rank)
    layers = shape.num_layers * layer
    if shape.num_decoder_layers:
        decoder = _layer_activation_bytes(shape, s, e, attention, lora_rank, True)
        layers += shape.num_decoder_layers * decoder
        layer = max(layer, decoder)
    if checkpointing:
        layers = blocks * h * e + layer
    # An encoder ("bert") has no vocabulary head: its pooler's input; the others: final norm, head, logits, loss.
    head = h * e if shape.family == "bert" else 2 * h * e + _logits_bytes_per_token(shape, e, loss_swap)
    inputs = 2 * 8 + (h if shape.dropout else 0)  # int64 ids and labels, embedding dropout mask
    return s * (layers + head + inputs)


def _eval_bytes_per_sample(
    shape: TransformerShape, sequence_length: int, e: int, attention: str, loss_swap: bool, mode: str
) -> int:
    """One sample's live working set in an evaluation step: the residual stream, and one block's or the head's."""
    h, q, kv, i, a = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size, shape.num_heads
    s = sequence_length
    qkv = q + 2 * kv
    # queries, keys and values, their rotated copies (rotary families) and the output; with eager attention keys
    # and values expanded to every head (grouped-query), the scores, their float32 softmax and its cast; else a
    # float32 log-sum-exp per head
    values = qkv + q + (q + kv if shape.family in ("llama", "phi") else 0)
    if attention == "eager":
        values += (2 * q if kv < q else 0) + 2 * a * s
    attend = values * e + 4 * a * (s if attention == "eager" else 1)
    experts = max(shape.experts_per_token, 1) / max(shape.num_experts, 1)  # one expert's tokens at a time
    mlp = round((3 * i if shape.gated else 2 * i) * experts) * e + 4 * shape.num_experts
    block = 2 * h * e + max(attend, mlp) + (h * e if shape.family == "phi" else 0)  # Phi: attention output kept
    if shape.family == "bert":
        head = 2 * h * e  # the pooler's input and output
    elif mode == "predict":
        head = 2 * h * e + shape.vocab_size * e  # the logits it returns; no labels, no loss, nothing to swap
    else:
        head = 2 * h * e + _logits_bytes_per_token(shape, e, loss_swap)
    encoder = h * e if shape.num_decoder_layers else 0  # the decoder reads the encoder's output
    inputs = 8 if mode == "predict" else 16  # int64 ids (and labels)
    return s * (inputs + encoder + max(block, head))


def _logits_bytes_per_token(shape: TransformerShape, e: int, loss_swap: bool) -> int:
    """The logits and the float32 loss over the vocabulary; under the loss swap, one chunk's (about ``h`` values)."""
    return 2 * shape.hidden_size * 4 if loss_swap else shape.vocab_size * (e + 2 * 4)


def _as_model(read: Callable[[Any], TransformerShape], model: str | os.PathLike[str]) -> TransformerShape:
    """``read(model)``, its errors naming ``model``, the argument the user gave, instead of ``read``'s own."""
    try:
        return read(model)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(re.sub(r"^`(config|name)`", "`model`", str(err))) from None


def resolve_model(model: str | os.PathLike[str] | TransformerShape) -> TransformerShape:
    """The shape :func:`estimate_memory` plans for ``model``: a name, a Hugging Face ``config.json`` or its directory.

    Raises:
        TypeError, ValueError, FileNotFoundError: As :func:`estimate_memory` does for ``model``.

    Example:
        >>> resolve_model("llama-2-7b").hidden_size
        4096
    """
    if isinstance(model, TransformerShape):
        return model
    if isinstance(model, os.PathLike) or (isinstance(model, str) and model.endswith(".json")):
        return _as_model(from_hf_config, model)
    if isinstance(model, str):
        if os.path.isdir(model):
            if not os.path.isfile(os.path.join(model, "config.json")):
                raise FileNotFoundError(f"`model`: the directory {model!r} has no config.json")
            return _as_model(from_hf_config, model)
        return _as_model(get_shape, model)
    raise TypeError(
        "`model` must be a model name, a path to a Hugging Face config.json or a TransformerShape, got "
        f"{model!r} ({type(model).__name__}); for an nn.Module use measure_memory"
    )


def estimate_memory(
    model: str | os.PathLike[str] | TransformerShape,
    *,
    sequence_length: int,
    precision: Precision = "bf16-mixed",
    optimizer: OptimizerName = "adamw",
    master_weights: bool | None = None,
    attention: Attention = "flash",
    gradient_checkpointing: bool = False,
    lora_rank: int | None = None,
    loss_swap: bool = False,
    mode: PlanMode = "train",
) -> MemoryEstimate:
    """Estimate the training (or evaluation) memory of a transformer from its shape (``docs/planner.md``).

    Args:
        model: A name from :data:`~lightning_tune.plan.shapes.MODEL_SHAPES`, a path to a Hugging Face
            ``config.json`` (or its directory), or a :class:`~lightning_tune.plan.shapes.TransformerShape`.
        sequence_length: Tokens per sample, >= 1.
        precision: One of :data:`PLAN_PRECISIONS` or an alias (``"bf16"`` is ``"bf16-mixed"``): ``-true`` holds
            everything in that width, ``-mixed`` 16-bit activations with float32 master weights and optimizer state.
        optimizer: A name of :data:`~lightning_tune.vocab.OPTIMIZERS` or an alias (``"sgd"`` means with momentum).
        master_weights: ``None``: float32 master weights under ``-mixed`` only; ``True`` adds them to a 16-bit
            ``-true`` precision (DeepSpeed's bf16 mode), ``False`` drops them.
        attention: ``"flash"`` or ``"eager"``; ``"sdpa"`` and ``"auto"`` are planned as ``"flash"``.
        gradient_checkpointing: Recompute each block in backward, keeping only block inputs.
        lora_rank: Train only rank-``r`` LoRA adapters on the q/k/v/o projections, the base frozen; ``None`` trains
            every weight. At most the smallest side of those projections.
        loss_swap: The loss is computed without the logits (``LossSwap``, ``TunePlugin(loss=...)``).
        mode: ``"train"``, ``"eval"`` (with labels) or ``"predict"`` (the logits returned), see ``docs/planner.md``.

    Returns:
        The estimate. With ``"eval"``/``"predict"``, ``fixed_bytes`` is what ``trainer.validate``/``test``/``predict``
        holds and ``fit_fixed_bytes`` the training figure (validation inside ``fit``).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a value is not allowed, the model name is unknown (the message lists known names) or
            ``master_weights=True`` is given with 32- or 64-bit weights.
        FileNotFoundError: If a config path does not exist.

    Example:
        >>> estimate = estimate_memory("gpt2", sequence_length=1024, precision="32-true")
        >>> estimate.parameters, estimate.weight_bytes
        (124439808, 497759232)
    """
    shape = resolve_model(model)
    check_int("sequence_length", sequence_length, minimum=1)
    if shape.family in ("gpt2", "bert") and sequence_length > shape.max_position_embeddings:
        raise ValueError(
            f"`sequence_length` must be at most {shape.max_position_embeddings} for {shape.name or 'this model'} "
            f"(its learned position table), got {sequence_length}"
        )
    precision = canonical_precision(precision, allowed=PLAN_PRECISIONS)
    optimizer = canonical_optimizer(optimizer)
    if master_weights is not None:
        check_bool("master_weights", master_weights)
    attention = canonical_attention(attention)
    check_bool("gradient_checkpointing", gradient_checkpointing)
    check_int("lora_rank", lora_rank, minimum=1, allow_none=True)
    check_bool("loss_swap", loss_swap)
    check_choice("mode", mode, PLAN_MODES)
    full_rank = min(shape.hidden_size, shape.q_size, shape.kv_size)
    if lora_rank is not None and lora_rank > full_rank:
        raise ValueError(
            f"`lora_rank` must be an integer from 1 to {full_rank} for {shape.name or 'this model'} (the smallest "
            "side of its q/k/v/o projections; a higher rank trains more than the full weight), got "
            f"{lora_rank}"
        )
    e = precision_bytes(precision)
    if master_weights and e >= 4:
        raise ValueError(f"`master_weights` must be False or None with precision {precision!r} (no 16-bit weights)")
    master = precision.endswith("-mixed") if master_weights is None else master_weights
    update_bytes = 4 if master else e

    tensors = [_Tensor(numel, lora_rank is None, embedding, count) for numel, embedding, count in shape.tensors()]
    if lora_rank is not None:
        tensors += list(_lora_tensors(shape, lora_rank))
    parameters = sum(t.numel * t.count for t in tensors)
    trainable = sum(t.numel * t.count for t in tensors if t.trainable)
    weight_bytes = e * parameters
    gradient_bytes = e * trainable
    master_bytes = 4 * trainable if master else 0
    optimizer_bytes = _optimizer_bytes(tensors, optimizer, update_bytes)
    buffer_bytes = shape.buffer_bytes()
    per_sample = _activation_bytes_per_sample(
        shape, sequence_length, e, attention, gradient_checkpointing, lora_rank, loss_swap
    )
    notes = [
        f"{shape.name or shape.family}: {precision}, "
        + ("float32 master weights, " if master else "")
        + f"{optimizer} optimizer, {attention} attention"
        + (" (planned as flash)" if attention in ("sdpa", "auto") else "")
        + (", gradient checkpointing" if gradient_checkpointing else "")
        + (f", LoRA rank {lora_rank} on q/k/v/o (base frozen)" if lora_rank is not None else ""),
    ]
    if shape.family != "bert" and mode == "predict":
        logits = sequence_length * shape.vocab_size * e
        notes.append(f"logits: {format_bytes(logits)} per sample, returned (no labels: no loss to swap)")
    elif shape.family != "bert":
        full = format_bytes(sequence_length * _logits_bytes_per_token(shape, e, False))
        left = format_bytes(sequence_length * _logits_bytes_per_token(shape, e, True))
        if loss_swap:
            notes.append(f"logits and loss: {left} per sample with the loss swap ({full} without)")
        else:
            notes.append(f"logits and loss: {full} per sample (the loss swap leaves {left})")
    fixed_bytes = weight_bytes + gradient_bytes + master_bytes + optimizer_bytes + buffer_bytes
    if mode != "train":
        weight_bytes = (4 if master and precision.endswith("-mixed") else e) * parameters
        per_sample = _eval_bytes_per_sample(shape, sequence_length, e, attention, loss_swap, mode)
        notes.append(
            f"{mode}: no gradients, optimizer state or saved activations; weights and buffers "
            f"{format_bytes(weight_bytes + buffer_bytes)}"
            + (f", {format_bytes(fixed_bytes)} inside fit (the training state stays)" if mode == "eval" else "")
        )
    return MemoryEstimate(
        parameters=parameters,
        trainable_parameters=trainable,
        weight_bytes=weight_bytes,
        gradient_bytes=gradient_bytes if mode == "train" else 0,
        master_weight_bytes=master_bytes if mode == "train" else 0,
        optimizer_bytes=optimizer_bytes if mode == "train" else 0,
        buffer_bytes=buffer_bytes,
        fixed_bytes=fixed_bytes if mode == "train" else weight_bytes + buffer_bytes,
        bytes_per_sample=per_sample,
        largest_layer_parameters=shape.largest_layer_parameters(),
        sequence_length=sequence_length,
        notes=tuple(notes),
        mode=mode,
        fit_fixed_bytes=fixed_bytes if mode == "eval" else None,
    )
