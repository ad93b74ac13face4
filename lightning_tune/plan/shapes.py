"""Transformer shapes as data: the numbers a memory plan needs, a table of common models and a Hugging Face reader.

A :class:`TransformerShape` holds what decides a decoder-only transformer's parameter count and activation sizes
(width, depth, heads, MLP kind, biases, tied head). Two families are described:

- ``"llama"``: rotary positions, RMSNorm, a SwiGLU MLP (gate, up, down), grouped-query attention with
  ``num_kv_heads`` key/value heads, no biases unless stated, usually an untied head (Llama, Mistral, Qwen2);
- ``"gpt2"``: learned positions, LayerNorm, a GELU MLP, biases on every projection, a head tied to the token
  embedding.

:data:`MODEL_SHAPES` holds common models by name (their Hugging Face ``config.json`` values); :func:`get_shape`
looks a name up and :func:`from_hf_config` reads a ``config.json``. Parameter counts are exact: the tests compare
each table entry with the model Hugging Face ``transformers`` builds from the same config.

Example:
    >>> shape = get_shape("llama-2-7b")
    >>> f"{shape.num_parameters():,}"
    '6,738,415,616'
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal, get_args

from lightning_tune._validation import check_bool, check_choice, check_float, check_int

__all__ = ["FAMILIES", "HF_MODEL_TYPES", "MODEL_SHAPES", "Family", "TransformerShape", "from_hf_config", "get_shape"]

#: Architecture families a shape can describe.
Family = Literal["llama", "gpt2"]
FAMILIES: Final[tuple[str, ...]] = get_args(Family)

#: ``model_type`` values of a Hugging Face ``config.json`` that :func:`from_hf_config` reads, and their family.
HF_MODEL_TYPES: Final[Mapping[str, Family]] = MappingProxyType(
    {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama"}
)


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a decoder-only transformer.

    Args:
        family: ``"llama"`` (RoPE, RMSNorm, SwiGLU) or ``"gpt2"`` (learned positions, LayerNorm, GELU).
        vocab_size: Number of token ids.
        hidden_size: Width of the residual stream.
        num_layers: Number of transformer blocks.
        num_heads: Number of query heads.
        intermediate_size: Width of the MLP's hidden layer.
        num_kv_heads: Key/value heads (grouped-query attention); ``None`` means ``num_heads``.
        head_dim: Width of one head; ``None`` means ``hidden_size // num_heads``.
        tie_word_embeddings: Whether the output head reuses the token embedding.
        max_position_embeddings: Length of the learned position table (``"gpt2"``; ignored by ``"llama"``).
        qkv_bias: Biases on the query/key/value projections.
        output_bias: A bias on the attention output projection.
        mlp_bias: Biases on the MLP projections.
        dropout: Whether training applies dropout (attention probabilities and residual branches).
        name: A label for messages and reports.

    Raises:
        TypeError: If a field has the wrong type.
        ValueError: If a field is out of range, ``family`` is unknown, ``num_heads`` is not a multiple of
            ``num_kv_heads`` or ``hidden_size`` is not divisible by ``num_heads`` without an explicit ``head_dim``.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 0
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    dropout: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        check_choice("family", self.family, FAMILIES)
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            check_int(field, getattr(self, field), minimum=1)
        check_int("num_kv_heads", self.num_kv_heads, minimum=1, allow_none=True)
        check_int("head_dim", self.head_dim, minimum=1, allow_none=True)
        check_int("max_position_embeddings", self.max_position_embeddings, minimum=0)
        for field in ("tie_word_embeddings", "qkv_bias", "output_bias", "mlp_bias", "dropout"):
            check_bool(field, getattr(self, field))
        if not isinstance(self.name, str):
            raise TypeError(f"`name` must be a string, got {self.name!r} ({type(self.name).__name__})")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"`num_heads` must be a multiple of `num_kv_heads`, got num_heads={self.num_heads!r} and "
                f"num_kv_heads={self.num_kv_heads!r}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"`hidden_size` must be divisible by `num_heads` when `head_dim` is not given, got "
                f"hidden_size={self.hidden_size!r} and num_heads={self.num_heads!r}"
            )
        if self.family == "gpt2" and self.max_position_embeddings < 1:
            raise ValueError(
                "`max_position_embeddings` must be an integer >= 1 for the 'gpt2' family (learned positions), "
                f"got {self.max_position_embeddings!r}"
            )

    # ------------------------------------------------------------------------------------------------- derived sizes

    @property
    def kv_heads(self) -> int:
        """Key/value heads, ``num_kv_heads`` or ``num_heads``."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_size(self) -> int:
        """Width of one attention head, ``head_dim`` or ``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection's output, ``num_heads * head_size``."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output, ``kv_heads * head_size``."""
        return self.kv_heads * self.head_size

    def _layer_sizes(self) -> list[int]:
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        norm = [h] if self.family == "llama" else [h, h]  # RMSNorm weight, or LayerNorm weight and bias
        sizes = [*norm, h * q, h * kv, h * kv, q * h, *norm]
        sizes += [q, kv, kv] if self.qkv_bias else []
        sizes += [h] if self.output_bias else []
        if self.family == "llama":
            return sizes + [h * i, h * i, i * h] + ([i, i, h] if self.mlp_bias else [])
        return sizes + [h * i, i * h] + ([i, h] if self.mlp_bias else [])

    def tensors(self) -> Iterator[tuple[int, bool]]:
        """Every parameter tensor as ``(numel, is_embedding_table)``, a tied head once (as the embedding).

        Example:
            >>> sum(n for n, _ in get_shape("gpt2").tensors())
            124439808
        """
        h = self.hidden_size
        yield self.vocab_size * h, True
        if self.family == "gpt2":
            yield self.max_position_embeddings * h, True
        for _ in range(self.num_layers):
            yield from ((n, False) for n in self._layer_sizes())
        yield from ((n, False) for n in ([h] if self.family == "llama" else [h, h]))
        if not self.tie_word_embeddings:
            yield self.vocab_size * h, False

    def num_parameters(self) -> int:
        """All parameters, a tied head counted once (as ``sum(p.numel() for p in model.parameters())`` does)."""
        return sum(n for n, _ in self.tensors())

    def largest_layer_parameters(self) -> int:
        """Parameters of the largest module (a block, the token embedding or the head): ZeRO-3 gathers one at a time."""
        return max(sum(self._layer_sizes()), self.vocab_size * self.hidden_size)

    def buffer_bytes(self) -> int:
        """Bytes of the model's buffers: the rotary inverse frequencies (two float32 copies) for ``"llama"``.

        Returns:
            The number of bytes.
        """
        return 2 * (self.head_size // 2) * 4 if self.family == "llama" else 0


def _llama(
    name: str, vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int, **kw: Any
) -> TransformerShape:
    return TransformerShape("llama", vocab, hidden, layers, heads, inter, num_kv_heads=kv, name=name, **kw)


def _gpt2(name: str, hidden: int, layers: int, heads: int) -> TransformerShape:
    return TransformerShape(
        "gpt2",
        50257,
        hidden,
        layers,
        heads,
        4 * hidden,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        qkv_bias=True,
        output_bias=True,
        mlp_bias=True,
        dropout=True,
        name=name,
    )


_SHAPES: Final[tuple[TransformerShape, ...]] = (
    _gpt2("gpt2", 768, 12, 12),
    _gpt2("gpt2-medium", 1024, 24, 16),
    _gpt2("gpt2-large", 1280, 36, 20),
    _gpt2("gpt2-xl", 1600, 48, 25),
    _llama("llama-2-7b", 32000, 4096, 32, 32, 32, 11008),
    _llama("llama-2-13b", 32000, 5120, 40, 40, 40, 13824),
    _llama("llama-2-70b", 32000, 8192, 80, 64, 8, 28672),
    _llama("llama-3-8b", 128256, 4096, 32, 32, 8, 14336),
    _llama("llama-3-70b", 128256, 8192, 80, 64, 8, 28672),
    _llama("llama-3.2-1b", 128256, 2048, 16, 32, 8, 8192, tie_word_embeddings=True),
    _llama("llama-3.2-3b", 128256, 3072, 28, 24, 8, 8192, tie_word_embeddings=True),
    _llama("mistral-7b", 32000, 4096, 32, 32, 8, 14336),
    _llama("qwen2.5-0.5b", 151936, 896, 24, 14, 2, 4864, tie_word_embeddings=True, qkv_bias=True),
    _llama("qwen2.5-7b", 152064, 3584, 28, 28, 4, 18944, qkv_bias=True),
    _llama("tinyllama-1.1b", 32000, 2048, 22, 32, 4, 5632),
)
MODEL_SHAPES: Final[Mapping[str, TransformerShape]] = MappingProxyType({s.name: s for s in _SHAPES})
"""Shapes of common models by name, from their Hugging Face ``config.json`` files."""

_ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "llama-3.1-8b": "llama-3-8b",
        "llama-3.1-70b": "llama-3-70b",
        "llama-3.3-70b": "llama-3-70b",
        "mistral-7b-v0.1": "mistral-7b",
        "gpt2-small": "gpt2",
    }
)


def _normalise(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1]  # "meta-llama/Llama-2-7b-hf" -> "llama-2-7b-hf"
    for suffix in ("-hf", "-instruct", "-chat"):
        key = key.removesuffix(suffix)
    key = key.replace("meta-llama-", "llama-").replace("_", "-")
    return _ALIASES.get(key, key)


def get_shape(name: str) -> TransformerShape:
    """Look a model up in :data:`MODEL_SHAPES`.

    Case, an organisation prefix and a ``-hf``/``-chat``/``-instruct`` suffix are ignored, so
    ``"meta-llama/Llama-2-7b-hf"`` finds ``"llama-2-7b"``; ``"llama-3.1-8b"`` has the shape of ``"llama-3-8b"``.

    Args:
        name: The model's name.

    Returns:
        Its shape.

    Raises:
        TypeError: If ``name`` is not a string.
        ValueError: If the name is unknown; the message lists the closest known names and every known name.

    Example:
        >>> get_shape("meta-llama/Llama-2-7b-hf").name
        'llama-2-7b'
    """
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a string, got {name!r} ({type(name).__name__})")
    key = _normalise(name)
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key]
    close = difflib.get_close_matches(key, [*MODEL_SHAPES, *_ALIASES], n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"unknown model {name!r}{hint} Known models: {', '.join(MODEL_SHAPES)} (or give a path to a Hugging Face "
        "config.json)"
    )


def from_hf_config(config: str | os.PathLike[str] | Mapping[str, Any], *, name: str | None = None) -> TransformerShape:
    """Read a shape from a Hugging Face ``config.json`` (a file, the directory holding it, or its parsed mapping).

    Supported ``model_type`` values are the keys of :data:`HF_MODEL_TYPES`. Fields the architecture defaults are
    filled in as ``transformers`` does (``num_key_value_heads`` defaults to the head count; Qwen2 always has
    query/key/value biases; GPT-2's ``n_inner`` defaults to 4x the width).

    Args:
        config: Path to ``config.json`` or to its directory, or the parsed config.
        name: Label for the shape; defaults to ``_name_or_path``, the directory name or the model type.

    Returns:
        The shape.

    Raises:
        TypeError: If ``config`` is neither a path nor a mapping.
        FileNotFoundError: If the path does not exist.
        ValueError: If the file is not valid JSON, the ``model_type`` is not supported or a required field is
            missing.

    Example:
        >>> shape = from_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12})
        >>> shape.num_parameters() == get_shape("gpt2").num_parameters()
        True
    """
    label = name
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"`config`: no Hugging Face config.json at {str(path)!r}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"`config`: {str(path)!r} is not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"`config`: {str(path)!r} must hold a JSON object, got {type(data).__name__}")
        label = label or data.get("_name_or_path") or path.parent.name
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(f"`config` must be a path or a mapping, got {config!r} ({type(config).__name__})")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"`config`: model_type {model_type!r} is not supported; supported: {', '.join(sorted(HF_MODEL_TYPES))}"
        )
    label = str(label or model_type)

    def need(key: str) -> Any:
        if key not in data:
            raise ValueError(f"`config`: the {model_type!r} config has no {key!r} field")
        return data[key]

    if HF_MODEL_TYPES[model_type] == "gpt2":
        hidden = need("n_embd")
        return TransformerShape(
            "gpt2",
            data.get("vocab_size", 50257),
            hidden,
            need("n_layer"),
            need("n_head"),
            data.get("n_inner") or 4 * hidden,
            tie_word_embeddings=data.get("tie_word_embeddings", True),
            max_position_embeddings=data.get("n_positions", 1024),
            qkv_bias=True,
            output_bias=True,
            mlp_bias=True,
            dropout=any(_probability(data, k, 0.1) > 0 for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop")),
            name=label,
        )
    heads = need("num_attention_heads")
    attention_bias = bool(data.get("attention_bias", False))
    return TransformerShape(
        "llama",
        need("vocab_size"),
        need("hidden_size"),
        need("num_hidden_layers"),
        heads,
        need("intermediate_size"),
        num_kv_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim"),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        output_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(data.get("mlp_bias", False)),
        dropout=_probability(data, "attention_dropout", 0.0) > 0,
        name=label,
    )


def _probability(data: dict[str, Any], key: str, default: float) -> float:
    """A dropout probability from a Hugging Face config, checked and named by its key."""
    value = data.get(key, default)
    if value is None:
        return 0.0  # some configs write null for "no dropout"
    check_float(f"config.{key}", value, low=0.0, high=1.0)
    return float(value)
