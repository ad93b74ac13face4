"""Transformer shapes as data: the numbers a memory plan needs, a table of common models and a Hugging Face reader.

A :class:`TransformerShape` covers five families (``docs/planner.md`` says what each assumes). Parameter counts are
exact: the tests compare each with the model ``transformers`` builds from the same config.

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
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal, get_args

from lightning_tune._validation import check_bool, check_choice, check_float, check_instance, check_int, check_str

#: Architecture families a shape can describe.
Family = Literal["llama", "gpt2", "phi", "bert", "t5"]
FAMILIES: Final[tuple[str, ...]] = get_args(Family)

#: ``model_type`` values of a Hugging Face ``config.json`` that :func:`from_hf_config` reads, and their family.
HF_MODEL_TYPES: Final[Mapping[str, Family]] = MappingProxyType(
    {
        **dict.fromkeys(("gemma", "llama", "mistral", "mixtral", "qwen2"), "llama"),
        **dict.fromkeys(("bert", "roberta"), "bert"),
        "gpt2": "gpt2",
        "phi": "phi",
        "t5": "t5",
    }
)

#: The fields of one family only, and that family.
_FAMILY_FIELDS: Final = {
    **dict.fromkeys(("num_decoder_layers", "relative_attention_buckets", "gated_mlp"), "t5"),
    "type_vocab_size": "bert",
}


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a transformer: decoder-only, encoder (``"bert"``) or encoder-decoder (``"t5"``).

    Args:
        family: ``"llama"`` (RoPE, RMSNorm, SwiGLU), ``"gpt2"`` (learned positions, LayerNorm, GELU), ``"phi"``,
            ``"bert"`` or ``"t5"`` (see ``docs/planner.md``).
        vocab_size: Number of token ids.
        hidden_size: Width of the residual stream.
        num_layers: Number of transformer blocks (of the encoder, for ``"t5"``).
        num_heads: Number of query heads.
        intermediate_size: Width of the MLP's hidden layer.
        num_kv_heads: Key/value heads (grouped-query attention); ``None`` means ``num_heads``.
        head_dim: Width of one head (T5's ``d_kv``); ``None`` means ``hidden_size // num_heads``.
        tie_word_embeddings: Whether the output head reuses the token embedding.
        max_position_embeddings: Length of the learned position table (``"gpt2"``, ``"bert"``; 0 for the others).
        qkv_bias: Biases on the query/key/value projections.
        output_bias: A bias on the attention output projection.
        mlp_bias: Biases on the MLP projections.
        dropout: Whether training applies dropout (attention probabilities and residual branches).
        name: A label for messages and reports.
        num_experts: Experts per block of a mixture-of-experts ``"llama"`` shape; 0 for a dense MLP.
        experts_per_token: Experts each token is routed to (top-k), 1 to ``num_experts``; 0 for a dense MLP.
        num_decoder_layers: Decoder blocks of a ``"t5"`` shape (>= 1); 0 for the other families.
        gated_mlp: A ``"t5"`` gated-GELU MLP (``wi_0``, ``wi_1``, ``wo``) rather than ReLU (``wi``, ``wo``).
        type_vocab_size: Token-type (segment) embeddings of a ``"bert"`` shape (2 for BERT, 1 for RoBERTa).
        relative_attention_buckets: Relative position buckets of a ``"t5"`` shape (>= 1).
        partial_rotary_factor: Fraction of each head that gets rotary positions (``"llama"``, ``"phi"``).

    Raises:
        TypeError: If a field has the wrong type.
        ValueError: If a field is out of range, ``family`` is unknown, ``num_heads`` is not a multiple of
            ``num_kv_heads``, ``hidden_size`` is not divisible by ``num_heads`` without an explicit ``head_dim``, or a
            family-specific field is set for another family (or missing for its own).
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
    num_experts: int = 0
    experts_per_token: int = 0
    num_decoder_layers: int = 0
    gated_mlp: bool = False
    type_vocab_size: int = 0
    relative_attention_buckets: int = 0
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        check_choice("family", self.family, FAMILIES)
        for f in fields(self):  # sizes >= 1 (None: derived); the counts that default to 0 (none) >= 0
            value = getattr(self, f.name)
            if f.type == "bool":
                check_bool(f.name, value)
            elif f.type in ("int", "int | None"):
                check_int(f.name, value, minimum=0 if f.default == 0 else 1, allow_none=f.type != "int")
        check_float("partial_rotary_factor", self.partial_rotary_factor, low=0.0, high=1.0, low_inclusive=False)
        check_instance("name", self.name, str, "a string")
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
        if self.family in ("gpt2", "bert") and self.max_position_embeddings < 1:
            raise ValueError(
                f"`max_position_embeddings` must be an integer >= 1 for the {self.family!r} family (learned "
                f"positions), got {self.max_position_embeddings!r}"
            )
        if self.num_experts and self.family != "llama":
            raise ValueError(f"`num_experts` must be 0 for the {self.family!r} family (experts: 'llama' only)")
        if not 0 < self.experts_per_token <= self.num_experts and (self.num_experts or self.experts_per_token):
            raise ValueError(
                f"`experts_per_token` must be an integer from 1 to num_experts={self.num_experts} with experts, and "
                f"0 without, got {self.experts_per_token!r}"
            )
        for field, family in _FAMILY_FIELDS.items():
            if getattr(self, field) and self.family != family:
                raise ValueError(
                    f"`{field}` is not a field of the {self.family!r} family, got {getattr(self, field)!r}"
                )
        if self.family == "t5" and (self.num_decoder_layers < 1 or self.relative_attention_buckets < 1):
            raise ValueError(
                "`num_decoder_layers` and `relative_attention_buckets` must be integers >= 1 for the 't5' family, "
                f"got {self.num_decoder_layers!r} and {self.relative_attention_buckets!r}"
            )
        if self.family == "bert" and self.tie_word_embeddings:
            raise ValueError("`tie_word_embeddings` must be False for the 'bert' family (the encoder has no head)")

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

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (three projections: SwiGLU/GeGLU, T5's gated-GELU) rather than two."""
        return self.family == "llama" or self.gated_mlp

    @property
    def attention_blocks(self) -> int:
        """Attention blocks in the model: one a block, two (self- and cross-attention) a ``"t5"`` decoder block."""
        return self.num_layers + 2 * self.num_decoder_layers

    def _norm(self) -> list[int]:
        return [self.hidden_size] if self.family in ("llama", "t5") else [self.hidden_size] * 2  # RMSNorm | LayerNorm

    def _attention_sizes(self) -> list[int]:
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        qkv = [q + 2 * kv] if self.family == "gpt2" else [q, kv, kv]  # GPT-2: one fused projection (c_attn)
        sizes = [h * n for n in qkv] + [q * h]
        return sizes + (qkv if self.qkv_bias else []) + ([h] if self.output_bias else [])

    def _mlp_sizes(self) -> list[int]:
        h, i = self.hidden_size, self.intermediate_size
        if self.num_experts:  # router, then every expert's fused gate/up and down projections (transformers 5)
            return [h * self.num_experts, self.num_experts * 2 * i * h, self.num_experts * i * h]
        sizes = [h * i, h * i, i * h] if self.gated else [h * i, i * h]
        return sizes + (([i] * (len(sizes) - 1) + [h]) if self.mlp_bias else [])

    def _layer_sizes(self, cross_attention: bool = False) -> list[int]:
        norms = 1 if self.family == "phi" else 3 if cross_attention else 2  # Phi: one norm feeds both branches
        attention = self._attention_sizes() * (2 if cross_attention else 1)
        return self._norm() * norms + attention + self._mlp_sizes()

    def tensors(self) -> Iterator[tuple[int, bool, int]]:
        """Every parameter tensor as ``(numel, is_embedding_table, count)``: ``count`` tensors of that kind.

        A block's tensors come once, counted by the number of blocks; a tied head is counted once (as the embedding)
        and GPT-2's fused query, key and value projection (``c_attn``) is one tensor, as its optimizer sees it.

        Example:
            >>> sum(n * count for n, _, count in get_shape("gpt2").tensors())
            124439808
        """
        h, v = self.hidden_size, self.vocab_size
        yield v * h, True, 1
        if self.family in ("gpt2", "bert"):
            yield self.max_position_embeddings * h, True, 1
        if self.family == "bert":
            yield self.type_vocab_size * h, True, 1
            yield from ((n, False, 1) for n in self._norm())  # the embeddings' LayerNorm
        for stack, layers in ((False, self.num_layers), (True, self.num_decoder_layers)):
            if self.family == "t5" and layers:  # relative position buckets, in each stack's first block
                yield self.relative_attention_buckets * self.num_heads, True, 1
            if layers:
                yield from ((n, False, layers) for n in self._layer_sizes(cross_attention=stack))
            if self.family != "bert" and layers:  # the stack's final norm
                yield from ((n, False, 1) for n in self._norm())
        if self.family == "bert":  # pooler
            yield from ((h * h, False, 1), (h, False, 1))
        elif not self.tie_word_embeddings:
            yield v * h, False, 1
            if self.family == "phi":
                yield v, False, 1

    def num_parameters(self) -> int:
        """All parameters, a tied head counted once (as ``sum(p.numel() for p in model.parameters())`` does)."""
        return sum(n * count for n, _, count in self.tensors())

    def largest_layer_parameters(self) -> int:
        """Parameters of the largest single module, its own and not its children's: ZeRO-3 gathers them one at a time.

        With experts, one block's experts are one module (as ``transformers`` holds them); DeepSpeed's estimators
        count the largest layer the same way (``model.modules()``, ``parameters(recurse=False)``).
        """
        h, i, q, kv, v = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size, self.vocab_size
        mlp = sum(self._mlp_sizes()[1:]) if self.num_experts else h * i + (i if self.mlp_bias else 0)
        attention = h * (q + 2 * kv) + q + 2 * kv if self.family == "gpt2" else h * q + (q if self.qkv_bias else 0)
        head = v * h + (v if self.family == "phi" and not self.tie_word_embeddings else 0)
        return max(head, mlp, attention)

    def buffer_bytes(self) -> int:
        """Bytes of the buffers: two float32 rotary tables (``"llama"``, ``"phi"``), BERT's int64 id tables."""
        if self.family in ("llama", "phi"):
            return 2 * (int(self.head_size * self.partial_rotary_factor) // 2) * 4
        return 2 * self.max_position_embeddings * 8 if self.family == "bert" else 0


def _llama(
    name: str, vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int, **kw: Any
) -> TransformerShape:
    return TransformerShape("llama", vocab, hidden, layers, heads, inter, num_kv_heads=kv, name=name, **kw)


def _gpt2(name: str, hidden: int, layers: int, heads: int) -> TransformerShape:
    """A GPT-2 of OpenAI's vocabulary, 4x MLP and 1024 positions: its ``config.json`` with the rest left default."""
    return from_hf_config({"model_type": "gpt2", "n_embd": hidden, "n_layer": layers, "n_head": heads}, name=name)


_ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "llama-3.1-8b": "llama-3-8b",
        "llama-3.1-70b": "llama-3-70b",
        "llama-3.3-70b": "llama-3-70b",
        "mistral-7b-v0.1": "mistral-7b",
        "gpt2-small": "gpt2",
    }
)


def get_shape(name: str) -> TransformerShape:
    """Look a model up in :data:`MODEL_SHAPES`.

    Case, an organisation prefix and a ``-hf``/``-chat``/``-instruct`` suffix are ignored, so
    ``"meta-llama/Llama-2-7b-hf"`` finds ``"llama-2-7b"``; ``"llama-3.1-8b"`` has the shape of ``"llama-3-8b"``.

    Raises:
        TypeError: If ``name`` is not a string.
        ValueError: If the name is empty or unknown; the message lists the closest known names and every known name.

    Example:
        >>> get_shape("meta-llama/Llama-2-7b-hf").name
        'llama-2-7b'
    """
    check_str("name", name)
    key = name.strip().lower().rsplit("/", 1)[-1]  # "meta-llama/Llama-2-7b-hf" -> "llama-2-7b-hf"
    for suffix in ("-hf", "-instruct", "-chat"):
        key = key.removesuffix(suffix)
    key = key.replace("meta-llama-", "llama-").replace("_", "-")
    key = _ALIASES.get(key, key)
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key]
    close = difflib.get_close_matches(key, [*MODEL_SHAPES, *_ALIASES], n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"`name`: unknown model {name!r}{hint} Known models: {', '.join(MODEL_SHAPES)} (or give a path to a Hugging "
        "Face config.json)"
    )


def from_hf_config(config: str | os.PathLike[str] | Mapping[str, Any], *, name: str | None = None) -> TransformerShape:
    """Read a shape from a Hugging Face ``config.json`` (a file, the directory holding it, or its parsed mapping).

    Supported ``model_type`` values are the keys of :data:`HF_MODEL_TYPES`. Fields the architecture defaults are
    filled in as ``transformers`` does (``num_key_value_heads`` defaults to the head count; Qwen2 always has
    query/key/value biases; GPT-2's ``n_inner`` defaults to 4x the width; T5's ``num_decoder_layers`` to
    ``num_layers``; Phi's ``partial_rotary_factor`` to 0.5, top-level or in ``rope_parameters``).

    Args:
        config: Path to ``config.json`` or to its directory, or the parsed config.
        name: Label for the shape; defaults to ``_name_or_path``, the directory name or the model type.

    Raises:
        TypeError: If ``config`` is neither a path nor a mapping, or ``name`` not a string.
        FileNotFoundError: If the path does not exist.
        ValueError: If ``name`` is empty, the file is not valid JSON, the ``model_type`` is not supported or a required
            field is missing.

    Example:
        >>> shape = from_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12})
        >>> shape.num_parameters() == get_shape("gpt2").num_parameters()
        True
    """
    check_str("name", name, allow_none=True)
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

    def dropout(default: float, *keys: str) -> bool:
        """Whether a dropout probability of ``keys`` is above 0, each checked until one is (null: no dropout)."""
        for key in keys:
            value = data.get(key, default)
            check_float(f"config.{key}", value, low=0.0, high=1.0, allow_none=True)
            if value:
                return True
        return False

    family = HF_MODEL_TYPES[model_type]
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    biases = {"qkv_bias": True, "output_bias": True, "mlp_bias": True}
    kwargs: dict[str, Any]
    if family == "gpt2":
        hidden = need("n_embd")
        inner = data.get("n_inner") or 4 * hidden
        sizes = [data.get("vocab_size", 50257), hidden, need("n_layer"), need("n_head"), inner]
        kwargs = {
            "tie_word_embeddings": data.get("tie_word_embeddings", True),
            "max_position_embeddings": data.get("n_positions", 1024),
            "dropout": dropout(0.1, "attn_pdrop", "resid_pdrop", "embd_pdrop"),
            **biases,
        }
    elif family == "bert":
        sizes = [need(key) for key in keys]
        kwargs = {
            "max_position_embeddings": data.get("max_position_embeddings", 512),
            "dropout": dropout(0.1, "hidden_dropout_prob", "attention_probs_dropout_prob"),
            "type_vocab_size": data.get("type_vocab_size", 2),
            **biases,
        }
    elif family == "t5":
        projection = data.get("feed_forward_proj", "relu")
        if projection not in ("relu", "gated-gelu", "gated-relu", "gelu"):
            raise ValueError(f"`config`: feed_forward_proj {projection!r} is not one of 'relu', 'gelu', 'gated-gelu'")
        layers = need("num_layers")
        sizes = [need(key) for key in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff")]
        kwargs = {
            "head_dim": need("d_kv"),
            "tie_word_embeddings": bool(data.get("tie_word_embeddings", True)),
            "dropout": dropout(0.1, "dropout_rate"),
            "num_decoder_layers": data.get("num_decoder_layers") or layers,
            "gated_mlp": projection.startswith("gated-"),
            "relative_attention_buckets": data.get("relative_attention_num_buckets", 32),
        }
    elif family == "phi":
        if data.get("qk_layernorm"):
            raise ValueError("`config`: a 'phi' config with qk_layernorm=true is not supported")
        heads = need("num_attention_heads")
        sizes = [need(key) for key in keys]
        rope = data.get("rope_parameters") or {}
        kwargs = {
            "num_kv_heads": data.get("num_key_value_heads") or heads,
            "tie_word_embeddings": bool(data.get("tie_word_embeddings", False)),
            "dropout": dropout(0.0, "resid_pdrop", "embd_pdrop", "attention_dropout"),
            "partial_rotary_factor": rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 0.5)),
            **biases,
        }
    else:
        heads = need("num_attention_heads")
        sizes = [need(key) for key in keys]
        attention_bias = bool(data.get("attention_bias", False))
        experts = data.get("num_local_experts", 0) if model_type == "mixtral" else 0
        kwargs = {
            "num_kv_heads": data.get("num_key_value_heads") or heads,
            "head_dim": data.get("head_dim"),
            "tie_word_embeddings": bool(data.get("tie_word_embeddings", model_type == "gemma")),
            "qkv_bias": model_type == "qwen2" or attention_bias,
            "output_bias": model_type != "qwen2" and attention_bias,
            "mlp_bias": bool(data.get("mlp_bias", False)),
            "dropout": dropout(0.0, "attention_dropout"),
            "num_experts": experts,
            "experts_per_token": data.get("num_experts_per_tok", 2) if experts else 0,
        }
    return TransformerShape(family, *sizes, **{**kwargs, "name": label})


# built last: the GPT-2 shapes are read as configs by from_hf_config
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
