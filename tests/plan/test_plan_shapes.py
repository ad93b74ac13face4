"""Model shapes: exact parameter counts against the models Hugging Face builds, lookup and config.json reading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from lightning_tune.plan import MODEL_SHAPES, TransformerShape, from_hf_config, get_shape

# Hugging Face configs of the table's models, written out from each model card's config.json.
HF_CONFIGS: dict[str, PretrainedConfig] = {
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25),
    "llama-2-7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008
    ),
    "llama-2-13b": LlamaConfig(
        vocab_size=32000, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=13824
    ),
    "llama-2-70b": LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
    ),
    "llama-3-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
    ),
    "llama-3-70b": LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
    ),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": LlamaConfig(
        vocab_size=128256,
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        intermediate_size=8192,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "mistral-7b": MistralConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
    ),
    "qwen2.5-0.5b": Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        tie_word_embeddings=False,
    ),
    "tinyllama-1.1b": LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
    ),
}


def hf_model(config: PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):  # shapes only: a 70B model costs no memory
        return AutoModelForCausalLM.from_config(config)


def test_every_table_entry_has_a_hugging_face_reference() -> None:
    assert set(HF_CONFIGS) == set(MODEL_SHAPES)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_parameter_count_equals_hugging_face(name: str) -> None:
    model = hf_model(HF_CONFIGS[name])
    shape = MODEL_SHAPES[name]
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())
    assert shape.buffer_bytes() == sum(b.nbytes for b in model.buffers())


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-2-70b", "llama-3.2-1b", "qwen2.5-0.5b", "gpt2-medium"])
def test_config_json_written_by_transformers_gives_the_table_shape(name: str, tmp_path: Path) -> None:
    HF_CONFIGS[name].save_pretrained(tmp_path)
    shape = from_hf_config(tmp_path / "config.json")
    assert shape.num_parameters() == MODEL_SHAPES[name].num_parameters()
    assert from_hf_config(tmp_path).num_parameters() == shape.num_parameters()  # the directory works too


def test_llama_2_7b_parameters_spelled_out() -> None:
    h, i, v, layers = 4096, 11008, 32000, 32
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two RMSNorm weights
    expected = v * h + layers * per_layer + h + v * h  # embedding, blocks, final norm, untied head
    assert expected == 6_738_415_616
    assert get_shape("llama-2-7b").num_parameters() == expected


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param("llama-2-7b", "llama-2-7b", id="exact"),
        pytest.param("meta-llama/Llama-2-7b-hf", "llama-2-7b", id="hub-id"),
        pytest.param("Meta-Llama-3.1-8B-Instruct", "llama-3-8b", id="alias"),
        pytest.param("GPT2-XL", "gpt2-xl", id="case"),
    ],
)
def test_names_are_found_loosely(query: str, expected: str) -> None:
    assert get_shape(query) is MODEL_SHAPES[expected]


def test_unknown_name_lists_the_closest_and_every_known_model() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'llama-2-8b'; did you mean .*'llama-2-7b'") as info:
        get_shape("llama-2-8b")
    assert all(name in str(info.value) for name in MODEL_SHAPES)
    assert "\n" not in str(info.value)


def bad_config(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "config.json"
    path.write_text(content)
    return path


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        pytest.param(
            {"model_type": "mamba"},
            ValueError,
            "model_type 'mamba' is not supported; supported: bert, gemma, gpt2, llama, mistral, mixtral, phi",
            id="mamba",
        ),
        pytest.param(
            {"model_type": "llama", "hidden_size": 8}, ValueError, "has no 'num_attention_heads' field", id="missing"
        ),
        pytest.param(42, TypeError, "`config` must be a path or a mapping, got 42", id="type"),
        pytest.param("nowhere/config.json", FileNotFoundError, "no Hugging Face config.json at", id="missing-file"),
        pytest.param("{not json", ValueError, "is not valid JSON", id="bad-json"),
    ],
)
def test_bad_configs(config: Any, error: type[Exception], message: str, tmp_path: Path) -> None:
    if config == "{not json":
        config = bad_config(tmp_path, config)
    with pytest.raises(error, match=message):
        from_hf_config(config)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param(
            {"family": "mamba"},
            ValueError,
            r"`family` must be one of 'llama', 'gpt2', .*'t5', got 'mamba'",
            id="family",
        ),
        pytest.param({"num_heads": 0}, ValueError, r"`num_heads` must be an integer >= 1, got 0", id="heads"),
        pytest.param({"num_kv_heads": 3}, ValueError, r"`num_heads` must be a multiple of `num_kv_heads`", id="gqa"),
        pytest.param({"hidden_size": 30}, ValueError, r"`hidden_size` must be divisible by `num_heads`", id="width"),
        pytest.param({"tie_word_embeddings": 1}, TypeError, r"`tie_word_embeddings` must be True or False", id="bool"),
        pytest.param({"vocab_size": 1.5}, TypeError, r"`vocab_size` must be an integer, got 1.5", id="float"),
    ],
)
def test_bad_shapes(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    fields: dict[str, Any] = {
        "family": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 64,
    }
    with pytest.raises(error, match=message):
        TransformerShape(**{**fields, **kwargs})


def test_gpt2_needs_a_position_table() -> None:
    with pytest.raises(ValueError, match="`max_position_embeddings` must be an integer >= 1 for the 'gpt2' family"):
        TransformerShape("gpt2", 100, 32, 2, 4, 128)


def test_json_on_disk_is_read_as_written(tmp_path: Path) -> None:
    path = bad_config(tmp_path, json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}))
    shape = from_hf_config(path, name="tiny")
    assert (shape.name, shape.hidden_size, shape.num_layers, shape.tie_word_embeddings) == ("tiny", 64, 2, True)


GEMMA_CONFIGS = {
    "gemma-2b": {"hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18, "num_key_value_heads": 1},
    "gemma-7b": {"hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28, "num_key_value_heads": 16},
}


@pytest.mark.parametrize("name", list(GEMMA_CONFIGS))
def test_gemma_config_json_counts_the_model_transformers_builds(name: str, tmp_path: Path) -> None:
    from transformers import GemmaConfig

    heads = 8 if name == "gemma-2b" else 16
    config = GemmaConfig(vocab_size=256000, num_attention_heads=heads, head_dim=256, **GEMMA_CONFIGS[name])
    config.save_pretrained(tmp_path)
    model = hf_model(config)
    shape = from_hf_config(tmp_path)
    assert shape.tie_word_embeddings  # Gemma ties its head to the embedding
    assert shape.num_parameters() == sum({id(p): p.numel() for p in model.parameters()}.values())
    # rotary frequencies as for Llama; Gemma's embedding scale (one float32 scalar) is left out
    assert sum(b.nbytes for b in model.buffers()) - shape.buffer_bytes() == 4
    own = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape.largest_layer_parameters() == own


# Families beyond decoder-only Llama/GPT-2, each from its model card's config.json, built on the meta device by the
# Auto class that trains it (an encoder: AutoModel, its body with the pooler; T5: the seq2seq LM; the rest: causal LM).
def _other_families() -> dict[str, tuple[str, PretrainedConfig]]:
    from transformers import BertConfig, MixtralConfig, PhiConfig, RobertaConfig, T5Config

    return {
        "bert-base-cased": ("AutoModel", BertConfig(vocab_size=28996)),
        "roberta-base": ("AutoModel", RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1)),
        "t5-small": ("AutoModelForSeq2SeqLM", T5Config()),
        "flan-t5-small": (
            "AutoModelForSeq2SeqLM",
            T5Config(d_ff=1024, num_heads=6, num_layers=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        ),
        "phi-2": (
            "AutoModelForCausalLM",
            PhiConfig(
                vocab_size=51200,
                hidden_size=2560,
                intermediate_size=10240,
                num_hidden_layers=32,
                num_attention_heads=32,
                partial_rotary_factor=0.4,
            ),
        ),
        "mixtral-8x7b": (
            "AutoModelForCausalLM",
            MixtralConfig(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
        ),
    }


@pytest.mark.parametrize(
    "name", ["bert-base-cased", "roberta-base", "t5-small", "flan-t5-small", "phi-2", "mixtral-8x7b"]
)
def test_other_families_count_the_model_transformers_builds(name: str, tmp_path: Path) -> None:
    import transformers

    auto, config = _other_families()[name]
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = getattr(transformers, auto).from_config(config)
    shape = from_hf_config(tmp_path)
    assert shape.num_parameters() == sum({id(p): p.numel() for p in model.parameters()}.values())
    assert shape.buffer_bytes() == sum(b.nbytes for b in model.buffers())
    own = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape.largest_layer_parameters() == own


def test_mixture_of_experts_stores_every_expert_and_activates_the_routed_ones() -> None:
    """Mixtral-style MoE: 16 experts double the expert weights of 8, but a token still runs through its top 2."""
    from lightning_tune.plan import estimate_memory

    def plan(experts: int, top_k: int) -> Any:
        shape = TransformerShape("llama", 32000, 1024, 4, 16, 2816, num_experts=experts, experts_per_token=top_k)
        return estimate_memory(shape, sequence_length=512, precision="bf16-mixed")

    eight, sixteen, eight_top1 = plan(8, 2), plan(16, 2), plan(8, 1)
    expert_weights = 4 * 3 * 1024 * 2816 * 8  # 8 more experts in each of 4 blocks
    assert sixteen.parameters - eight.parameters == expert_weights + 4 * 1024 * 8  # and 8 more router rows
    # activations: only the router's float32 logits grow (8 more per token and block) ...
    assert sixteen.bytes_per_sample - eight.bytes_per_sample == 512 * 4 * 4 * 8
    # ... while routing to one expert instead of two drops one expert's activations (input and SwiGLU: h + 4i values)
    assert eight.bytes_per_sample - eight_top1.bytes_per_sample == 512 * 4 * 2 * (1024 + 4 * 2816)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"num_experts": 8}, r"`experts_per_token` must be an integer from 1 to num_experts=8", id="no-k"),
        pytest.param({"num_experts": 2, "experts_per_token": 3}, r"from 1 to num_experts=2 .* got 3", id="k>E"),
        pytest.param({"experts_per_token": 1}, r"and 0 without, got 1", id="k-dense"),
        pytest.param(
            {"family": "gpt2", "max_position_embeddings": 8, "num_experts": 2},
            r"`num_experts` must be 0 for",
            id="moe-gpt2",
        ),
        pytest.param({"num_decoder_layers": 2}, r"`num_decoder_layers` is not a field of the 'llama' family", id="dec"),
        pytest.param({"family": "t5"}, r"must be integers >= 1 for the 't5' family, got 0 and 0", id="t5-empty"),
        pytest.param(
            {"family": "bert", "max_position_embeddings": 8, "tie_word_embeddings": True},
            r"the encoder has no head",
            id="bert-tied",
        ),
        pytest.param({"partial_rotary_factor": 0.0}, r"`partial_rotary_factor` must be", id="rotary"),
    ],
)
def test_bad_family_fields(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"family": "llama", "vocab_size": 100, "hidden_size": 32, "num_layers": 2}
    with pytest.raises(ValueError, match=message):
        TransformerShape(**{**fields, "num_heads": 4, "intermediate_size": 64, **kwargs})


def test_phi_with_qk_layernorm_is_refused() -> None:
    config = {"model_type": "phi", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1}
    with pytest.raises(ValueError, match="qk_layernorm=true is not supported"):
        from_hf_config({**config, "num_attention_heads": 2, "intermediate_size": 16, "qk_layernorm": True})
