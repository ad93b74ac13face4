"""The loss swap: linear_cross_entropy against F.cross_entropy, swapped Hugging Face models against unswapped ones."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch import Callback, LightningModule
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune.callbacks import LossSwap
from lightning_tune.plan import measure_memory
from lightning_tune.swaps import linear_cross_entropy, swap_loss
from tests.helpers import Regressor, make_trainer
from tests.hf_data import TokenDataset, lm_collator

VOCAB = 1000
TINY = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


def llama(layers: int = 2) -> nn.Module:
    config = transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": layers}, intermediate_size=64, num_key_value_heads=2
    )
    return transformers.LlamaForCausalLM(config)


def llama_with_bias() -> nn.Module:
    model = llama()
    model.lm_head = nn.Linear(32, VOCAB, bias=True)
    return model


def mistral() -> nn.Module:
    config = transformers.MistralConfig(**TINY, intermediate_size=64, num_key_value_heads=2)
    return transformers.MistralForCausalLM(config)


def qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, intermediate_size=64, num_key_value_heads=2))


def gemma() -> nn.Module:  # tied embeddings, scaled input embeddings
    config = transformers.GemmaConfig(**TINY, intermediate_size=64, num_key_value_heads=2, head_dim=8)
    return transformers.GemmaForCausalLM(config)


def gemma2() -> nn.Module:  # final_logit_softcapping
    config = transformers.Gemma2Config(
        **TINY, intermediate_size=64, num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0
    )
    return transformers.Gemma2ForCausalLM(config)


def gpt2() -> nn.Module:  # tied embeddings, Conv1D layers
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0
    )
    config.eos_token_id = 0
    return transformers.GPT2LMHeadModel(config)


FAMILIES = [
    pytest.param(llama, id="llama"),
    pytest.param(llama_with_bias, id="llama-head-bias"),
    pytest.param(mistral, id="mistral"),
    pytest.param(qwen2, id="qwen2"),
    pytest.param(gemma, id="gemma"),
    pytest.param(gemma2, id="gemma2-softcap"),
    pytest.param(gpt2, id="gpt2"),
]


def build(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory().train()


@functools.cache
def _collated(lengths: tuple[int, ...]) -> dict[str, Tensor]:
    return dict(lm_collator()([TokenDataset(list(lengths))[i] for i in range(len(lengths))]))


def collated(lengths: list[int]) -> dict[str, Tensor]:
    """A Hugging Face collator's batch: right padding, labels -100 at padding."""
    return {key: value.clone() for key, value in _collated(tuple(lengths)).items()}


def padded_batch() -> dict[str, Tensor]:
    batch = collated([12, 5, 9])
    batch["labels"][2] = -100  # a row whose labels are all ignored (a prompt-only sample)
    return batch


BATCHES = [
    pytest.param(lambda: collated([10, 10]), id="no-padding"),
    pytest.param(padded_batch, id="padding-and-an-ignored-row"),
]


def loss_and_grads(model: nn.Module, batch: dict[str, Tensor], **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got: tuple[Tensor, dict[str, Tensor]], want: tuple[Tensor, dict[str, Tensor]], atol: float) -> None:
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=0)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------------------ the function


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, 3.0)], ids=["plain", "bias-softcap"])
def test_linear_cross_entropy_matches_cross_entropy(reduction: str, bias: bool, softcap: float | None) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    head_bias = torch.randn(50, requires_grad=True) if bias else None
    labels = torch.randint(0, 50, (3, 7))
    labels[0] = -100
    labels[1, 3] = -100
    got = linear_cross_entropy(
        hidden,
        weight,
        labels,
        bias=head_bias,
        reduction=reduction,
        shift=True,
        chunk_size=4,
        softcap=softcap,  # type: ignore[arg-type]
    )
    logits = F.linear(hidden, weight, head_bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    want = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), reduction=reduction).view_as(got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    upstream = torch.randn_like(got)
    inputs = [t for t in (hidden, weight, head_bias) if t is not None]
    for g, w in zip(
        torch.autograd.grad(got, inputs, upstream), torch.autograd.grad(want, inputs, upstream), strict=True
    ):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_all_ignored_labels_give_nan_as_cross_entropy_does_and_no_gradient() -> None:
    hidden, weight = torch.randn(2, 4, 8, requires_grad=True), torch.randn(11, 8)
    labels = torch.full((2, 4), -100)
    assert torch.isnan(linear_cross_entropy(hidden, weight, labels))
    assert torch.isnan(F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten()))
    loss = linear_cross_entropy(hidden, weight, labels, reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and not hidden.grad.any()


def test_frozen_weight_gets_no_gradient_and_grads_keep_the_input_dtype() -> None:
    hidden = torch.randn(2, 6, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(30, 8)  # float32, frozen: autocast runs the product in bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, torch.randint(0, 30, (2, 6)))
    assert loss.dtype == torch.float32
    loss.backward()
    assert weight.grad is None and hidden.grad is not None and hidden.grad.dtype == torch.bfloat16


class LogitChunks(TorchDispatchMode):
    """Rows of every matrix product whose output is one chunk's logits (``vocab`` columns)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


@pytest.mark.parametrize(
    ("tokens", "vocab", "hidden", "chunk"),
    [
        pytest.param(4096, 128_256, 64, 261, id="128k-vocab-hidden-64"),  # was 3 tokens a chunk
        pytest.param(4096, 128_256, 512, 261, id="128k-vocab-hidden-512"),  # was 17
        pytest.param(4096, 256_000, 64, 256, id="256k-vocab-the-minimum"),
        pytest.param(16_384, 32_000, 512, 1048, id="32k-vocab"),  # was 261
        pytest.param(300, 32_000, 64, 300, id="fewer-tokens-than-a-chunk"),
    ],
)
def test_default_chunk_is_a_budget_of_logits_of_at_least_256_tokens(
    tokens: int, vocab: int, hidden: int, chunk: int
) -> None:
    """Each chunk's logits are a matrix product of their own, forward and backward: chunks of a few tokens repeat the
    vocab x hidden weight gradient once per chunk (a step several times slower), one chunk of every token keeps all
    the logits. The default holds 128 MiB of float32 logits, at least 256 tokens (on fake tensors: no memory used)."""
    with FakeTensorMode():
        hidden_states = torch.empty(tokens, hidden, requires_grad=True)
        weight = torch.empty(vocab, hidden, requires_grad=True)
        labels = torch.zeros(tokens, dtype=torch.long)
        with LogitChunks(vocab) as seen:
            linear_cross_entropy(hidden_states, weight, labels).backward()
    chunks = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
    assert seen.rows == chunks + chunks  # forward, then backward
    assert chunk * vocab * 4 <= max(128 * 2**20, 256 * vocab * 4)


def torch_loss(logits: Tensor, labels: Tensor, reduction: str = "mean", **options: Any) -> tuple[Tensor, Tensor]:
    """``F.cross_entropy`` of the full logits with Liger's z-loss (as its tests' ``CrossEntropyWithZLoss``), and the
    z-loss."""
    scale = options.pop("lse_square_scale", 0.0)
    logits, labels = logits.float().flatten(0, -2), labels.flatten()
    loss = F.cross_entropy(logits, labels, reduction=reduction, **options)
    z = torch.where(labels != -100, scale * torch.logsumexp(logits, -1) ** 2, 0.0)
    z = {"mean": z.sum() / (labels != -100).sum(), "sum": z.sum(), "none": z}[reduction]
    return loss + z, z


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"label_smoothing": 0.1}, id="label_smoothing"),
        pytest.param({"weight": "rand"}, id="ce_weight"),
        pytest.param({"lse_square_scale": 1e-2}, id="z-loss"),
        pytest.param({"label_smoothing": 0.2, "weight": "rand", "lse_square_scale": 1e-3}, id="all"),
    ],
)
def test_liger_options_match_torch_cross_entropy(reduction: str, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50, requires_grad=True)
    labels = torch.randint(0, 50, (40,))
    labels[::3] = -100
    options = {k: torch.rand(50) + 0.5 if k == "weight" else v for k, v in options.items()}
    want, want_z = torch_loss(F.linear(hidden, weight, bias), labels, reduction, **options)
    ours = {("ce_weight" if k == "weight" else k): v for k, v in options.items()}
    got = linear_cross_entropy(
        hidden, weight, labels, bias=bias, reduction=reduction, chunk_size=7, return_z_loss=True, **ours
    )
    torch.testing.assert_close(got.loss, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.z_loss, want_z, atol=1e-6, rtol=1e-5)
    upstream = torch.rand_like(want) + 0.5
    inputs = (hidden, weight, bias)
    for g, w in zip(
        torch.autograd.grad(got.loss, inputs, upstream), torch.autograd.grad(want, inputs, upstream), strict=True
    ):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_token_accuracy_is_the_argmax_of_the_logits_per_labelled_token() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 30, 8), torch.randn(5, 8)  # 5 classes: many right guesses
    labels = torch.randint(0, 5, (2, 30))
    labels[1, 20:] = -100
    right = ((hidden @ weight.T).argmax(-1) == labels) & (labels != -100)
    got = linear_cross_entropy(hidden, weight, labels, chunk_size=7, return_token_accuracy=True)
    assert got.z_loss is None and got.token_accuracy == right.sum() / (labels != -100).sum()
    torch.testing.assert_close(got.loss, linear_cross_entropy(hidden, weight, labels))
    per_token = linear_cross_entropy(hidden, weight, labels, reduction="none", return_token_accuracy=True)
    assert torch.equal(per_token.token_accuracy, right.float())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"reduction": "avg"}, ValueError, "`reduction` must be one of", id="reduction"),
        pytest.param(
            {"label_smoothing": 1.5}, ValueError, r"`label_smoothing` must be in \[0, 1\], got 1.5", id="smoothing"
        ),
        pytest.param(
            {"lse_square_scale": -1e-4}, ValueError, r"`lse_square_scale` must be in \[0, inf", id="z-loss-scale"
        ),
        pytest.param(
            {"ce_weight": torch.ones(8)},
            ValueError,
            r"`ce_weight` must have shape \(9,\), .* got shape \(8,\)",
            id="cw",
        ),
        pytest.param(
            {"ce_weight": torch.ones(9, dtype=torch.long)}, TypeError, "`ce_weight` must hold floating", id="cw-dtype"
        ),
        pytest.param({"return_z_loss": 1}, TypeError, "`return_z_loss` must be True or False, got 1", id="z-flag"),
        pytest.param({"chunk_size": 0}, ValueError, "`chunk_size` must be an integer >= 1, got 0", id="chunk"),
        pytest.param({"softcap": -1.0}, ValueError, r"`softcap` must be in \(0, inf\], got -1.0", id="softcap"),
        pytest.param({"ignore_index": None}, TypeError, "`ignore_index` must be an integer, got None", id="ignore"),
        pytest.param(
            {"labels": torch.zeros(2, 4)}, TypeError, "`labels` must hold integer class ids", id="float-labels"
        ),
        pytest.param(
            {"labels": torch.zeros(2, 5, dtype=torch.long)}, ValueError, r"`labels` must have shape", id="shape"
        ),
        pytest.param({"weight": torch.zeros(9, 7)}, ValueError, r"`weight` must have shape \[vocab, 8\]", id="weight"),
    ],
)
def test_linear_cross_entropy_bad_inputs(kwargs: dict[str, Any], error: type, message: str) -> None:
    args: dict[str, Any] = {"hidden": torch.zeros(2, 4, 8), "weight": torch.zeros(9, 8), "labels": torch.zeros(2, 4)}
    args["labels"] = args["labels"].long()
    args.update(kwargs)
    with pytest.raises(error, match=message):
        linear_cross_entropy(**args)


# ------------------------------------------------------------------------------------------- Hugging Face models


@pytest.mark.parametrize("make_batch", BATCHES)
@pytest.mark.parametrize("factory", FAMILIES)
def test_swapped_model_matches_hugging_face_loss_and_gradients(
    factory: Callable[[], nn.Module], make_batch: Callable[[], dict[str, Tensor]]
) -> None:
    model, batch = build(factory), make_batch()
    want = loss_and_grads(model, batch)
    with swap_loss(model, "chunked", chunk_size=7) as result:
        got = loss_and_grads(model, batch)
    assert [entry.module_type for entry in result.entries] == [type(model).__name__]  # it was swapped
    assert_same(got, want, atol=1e-5)


def test_num_items_in_batch_and_shift_labels_are_honoured() -> None:
    model, batch = build(llama), padded_batch()
    shifted = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:].contiguous()
    for kwargs in ({"num_items_in_batch": torch.tensor(40)}, {"shift_labels": shifted}):
        want = loss_and_grads(model, batch, **kwargs)
        with swap_loss(model, "chunked"):
            got = loss_and_grads(model, batch, **kwargs)
        assert_same(got, want, atol=1e-5)


def test_with_hugging_face_gradient_checkpointing() -> None:
    model, batch = build(qwen2), padded_batch()
    model.gradient_checkpointing_enable()
    want = loss_and_grads(model, batch)
    with swap_loss(model, "chunked"):
        got = loss_and_grads(model, batch)
    assert_same(got, want, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16-mixed", "16-mixed"])
def test_autocast_stays_within_the_unswapped_autocast_error(dtype: torch.dtype) -> None:
    model, batch = build(llama), padded_batch()
    exact = loss_and_grads(model, batch)
    with torch.autocast("cpu", dtype=dtype):
        plain = loss_and_grads(model, batch)
        with swap_loss(model, "chunked"):
            swapped = loss_and_grads(model, batch)
    plain_error = (plain[0] - exact[0]).abs().item()
    assert (swapped[0] - exact[0]).abs().item() <= 2 * plain_error + 1e-3
    for name, grad in exact[1].items():
        assert swapped[1][name].dtype == grad.dtype == torch.float32
        bound = 2 * (plain[1][name] - grad).abs().max().item() + 1e-3
        assert (swapped[1][name] - grad).abs().max().item() <= bound, name


def test_swap_passes_the_loss_options_on() -> None:
    """``swap_loss(..., label_smoothing=, ce_weight=, lse_square_scale=)``: the model's shifted token-mean loss with
    ``F.cross_entropy``'s label smoothing and class weights, plus Liger's z-loss, from the unswapped model's logits."""
    model, batch = build(llama), padded_batch()
    ce_weight = torch.rand(VOCAB) + 0.5
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    want, _ = torch_loss(logits, labels, label_smoothing=0.1, weight=ce_weight, lse_square_scale=1e-3)
    want.backward()
    expected = (want.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    with swap_loss(model, "chunked", label_smoothing=0.1, ce_weight=ce_weight, lse_square_scale=1e-3):
        got = loss_and_grads(model, batch)
    assert_same(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"`ce_weight` must have shape \(1000,\), one weight per class, got shape"):
        swap_loss(model, "chunked", ce_weight=torch.ones(10))
    with pytest.raises(ValueError, match=r"`label_smoothing` must be in \[0, 1\], got -0.1"):
        LossSwap("chunked", label_smoothing=-0.1)


def test_swap_is_per_instance_and_restored() -> None:
    model, other, batch = build(llama), build(llama), padded_batch()
    result = swap_loss(model, "chunked")
    assert other(**batch).logits.shape == (3, 12, VOCAB)  # a second model of the class is untouched
    assert "forward" not in vars(other) and "forward" not in vars(other.lm_head)
    with pytest.raises(AttributeError, match=r"has no `logits`.*LossSwap / TunePlugin\(loss=\.\.\.\)"):
        _ = model(**batch).logits
    assert model(input_ids=batch["input_ids"]).logits.shape == (3, 12, VOCAB)  # no labels: the model as it was
    model.eval()
    assert model(**batch).logits.shape == (3, 12, VOCAB)  # eval (validation, predict): the model as it was
    model.train()
    result.restore()
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)
    assert model(**batch).logits.shape == (3, 12, VOCAB)


@pytest.mark.parametrize("train_head", [False, True], ids=["frozen-head", "trained-head"])
def test_peft_lora(train_head: bool) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(build(llama), config).train()
    model.get_output_embeddings().weight.requires_grad_(train_head)
    batch = padded_batch()
    want = loss_and_grads(model, batch)
    with swap_loss(model, "chunked"):
        got = loss_and_grads(model, batch)
    assert_same(got, want, atol=1e-5)
    trained = {name for name in got[1] if "lora_" not in name}
    assert got[1] and trained == ({"base_model.model.lm_head.weight"} if train_head else set())
    with_head = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(TypeError, match=r"its LM head is ModulesToSaveWrapper.*requires_grad_\(True\)"):
        swap_loss(peft.get_peft_model(build(llama), with_head), "chunked")


def test_refusals_name_what_is_wrong() -> None:
    scaled = build(llama)
    scaled.config.logit_scale = 0.5
    with pytest.raises(ValueError, match=r"scales its logits \(config.logit_scale=0.5\)"):
        swap_loss(scaled, "chunked")
    assert "forward" not in vars(scaled)
    with pytest.raises(ValueError, match=r"`backend='liger'` needs a CUDA device.*got device 'cpu'"):
        swap_loss(build(llama), "liger", device="cpu")
    with pytest.raises(ValueError, match=r"`backend` must be one of 'auto', 'chunked', 'liger', got 'fast'"):
        LossSwap("fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`loss` must be one of 'auto', 'chunked', 'liger', got 'fused'"):
        lt.TunePlugin(loss="fused")  # type: ignore[arg-type]


def test_auto_is_chunked_off_cuda_and_says_so() -> None:
    said: list[str] = []
    result = swap_loss(build(gpt2), "auto", device="cpu", notify=said.append)
    assert result.backend == "chunked" and said == [
        "Loss swap: backend 'auto' chose 'chunked' (the device is cpu, not CUDA)"
    ]


@pytest.mark.slow
def test_torch_compile_of_a_swapped_model_gives_its_loss_and_gradients_in_one_graph() -> None:
    """Dynamo and AOTAutograd (backend "aot_eager": inductor's code generation aside) capture the swapped forward, the
    chunked loss's autograd function included, in one graph, compiled once; only the output without logits is built
    outside it. Loss and gradients are the unswapped Hugging Face model's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, batch = build(functools.partial(llama, layers=1)), padded_batch()  # one layer: less to trace
    want = loss_and_grads(model, batch)
    with swap_loss(model, "chunked", chunk_size=7):
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            assert_same(loss_and_grads_of(lambda: compiled(**batch).loss, model), want, atol=1e-5)
        with pytest.raises(AttributeError, match=r"has no `logits`"):
            _ = compiled(**batch).logits
    assert counters["stats"]["unique_graphs"] == 1
    (reason,) = counters["graph_break"]  # one break: where the output without logits is built
    assert "_without_logits" in reason


# ------------------------------------------------------------------------------------------------- in a Trainer


class CausalLM(LightningModule):
    """A user's module: training reads only the loss, validation reads the logits (accuracy)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.model = build(functools.partial(llama, layers=layers))
        self.val_accuracy: list[float] = []
        self.kept_logits: list[bool] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(**batch)
        self.kept_logits.append("logits" in out)
        return out.loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self.model(**batch).logits
        self.val_accuracy.append((logits.argmax(-1) == batch["input_ids"]).float().mean().item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("how", ["callback", "plugin"])
def test_trainer_run_matches_the_unswapped_run(tmp_path: Any, how: str) -> None:
    batches = [padded_batch(), collated([10, 10])]

    def fit(swap: bool) -> CausalLM:
        module = CausalLM()
        extra: dict[str, Any] = {"max_steps": 2, "limit_val_batches": 1, "val_check_interval": 2}
        if swap and how == "plugin":
            extra["plugins"] = [lt.TunePlugin("32-true", loss="chunked")]
        callbacks = [LossSwap("chunked")] if swap and how == "callback" else []
        loaders = DataLoader(batches, batch_size=None), DataLoader(batches[:1], batch_size=None)
        make_trainer(tmp_path, callbacks, **extra).fit(module, *loaders)
        return module

    plain, swapped = fit(False), fit(True)
    assert plain.kept_logits == [True, True] and swapped.kept_logits == [False, False]
    assert "forward" not in vars(swapped.model)  # teardown restored it
    assert swapped.val_accuracy == plain.val_accuracy and len(plain.val_accuracy) == 1  # validation had its logits
    for (name, want), got in zip(plain.named_parameters(), swapped.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_torch_compile_callback_and_the_loss_swap_compose_in_either_order(tmp_path: Any) -> None:
    """TorchCompile compiles whatever forward the model has at its setup: the swapped one (LossSwap first), or the
    model's own, which then calls the swapped head (TorchCompile first, as under TunePlugin(loss=...)). Either way the
    run trains the unswapped weights, compiles once (not at every step) and leaves the model as it was."""
    from torch._dynamo.utils import counters

    batches = [padded_batch(), padded_batch()]

    def fit(callbacks: list[Callback]) -> CausalLM:
        module = CausalLM(layers=1)
        make_trainer(tmp_path, callbacks, max_steps=2).fit(module, DataLoader(batches, batch_size=None))
        return module

    plain = fit([])
    for order in ("swap-then-compile", "compile-then-swap"):
        torch._dynamo.reset()
        counters.clear()
        swap, compile_ = LossSwap("chunked", verbose=False), lt.TorchCompile(backend="eager", verbose=False)
        swapped = fit([swap, compile_] if order == "swap-then-compile" else [compile_, swap])
        assert swapped.kept_logits == [False, False], order
        assert counters["stats"]["unique_graphs"] == 1, order
        assert "forward" not in vars(swapped.model) and "forward" not in vars(swapped.model.lm_head), order
        for (name, want), got in zip(plain.named_parameters(), swapped.parameters(), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, n=name, o=order: f"{o} {n}: {m}")


class LateCausalLM(CausalLM):
    """Builds its model in ``configure_model``, as large models are built under FSDP2."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        self.kept_logits = []

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = build(llama)


@pytest.mark.parametrize(
    ("how", "module", "message"),
    [
        pytest.param("callback", Regressor, r"found no causal language model in Regressor", id="callback"),
        pytest.param("plugin", Regressor, r"found no causal language model in Regressor", id="plugin"),
        pytest.param(
            "callback", LateCausalLM, r"built in `configure_model` .* TunePlugin\(loss='chunked'\)", id="late"
        ),
    ],
)
def test_a_swap_that_finds_no_causal_lm_is_an_error(tmp_path: Any, how: str, module: type, message: str) -> None:
    kwargs: dict[str, Any] = {"max_steps": 1}
    if how == "plugin":
        kwargs["plugins"] = [lt.TunePlugin("32-true", loss="chunked")]
    trainer = make_trainer(tmp_path, [LossSwap("chunked")] if how == "callback" else [], **kwargs)
    loaders = [] if module is Regressor else [DataLoader([padded_batch()], batch_size=None)]
    with pytest.raises(ValueError, match=message) as raised:
        trainer.fit(module(), *loaders)
    # it says what it looks for and what to do instead
    assert "`*ForCausalLM`" in str(raised.value) and "lightning_tune.linear_cross_entropy(" in str(raised.value)


def test_the_plugin_swaps_a_model_built_in_configure_model(tmp_path: Any) -> None:
    module = LateCausalLM()
    trainer = make_trainer(tmp_path, [], max_steps=1, plugins=[lt.TunePlugin("32-true", loss="chunked")])
    trainer.fit(module, DataLoader([padded_batch()], batch_size=None))
    assert module.kept_logits == [False] and "forward" not in vars(module.model)


# ------------------------------------------------------------------------------------------------------ memory


@pytest.mark.slow
def test_measured_bytes_per_sample_fall_by_the_logits_and_become_batch(tmp_path: Any) -> None:
    """A large-vocabulary, narrow model on fake tensors: the logits are most of what a sample costs. DynamicBatchSize
    on a device priced from the two measurements settles at a micro-batch as much larger as a sample is cheaper."""
    config = transformers.LlamaConfig(
        vocab_size=32_000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()

    def batch(size: int) -> dict[str, Tensor]:
        ids = torch.randint(0, 32_000, (size, 128))
        return {"input_ids": ids, "labels": ids}

    plain = measure_memory(model, batch, precision="bf16-mixed")
    with swap_loss(model, "chunked", chunk_size=32):
        swapped = measure_memory(model, batch, precision="bf16-mixed")
    before, after = plain.bytes_per_sample, swapped.bytes_per_sample
    logits = 128 * 32_000 * 4  # one sample's logits in float32
    assert before - after >= 2 * logits  # at least the float32 logits and their gradient are gone
    assert after < 0.1 * before

    from tests.batch.test_dynamic_batch import Net, fit

    settled = []
    for estimate in (plain, swapped):  # a device on which 8 unswapped samples fit under the 0.9 target
        budget = estimate.fixed_bytes + 8 * before
        memory = lt.SimulatedMemory(
            total_bytes=int(budget / 0.9) + 1,
            fixed_bytes=estimate.fixed_bytes,
            bytes_per_sample=estimate.bytes_per_sample,
        )
        dyn = lt.DynamicBatchSize(0.9, adjust_every=1, keep="none", max_batch_size=1024, probe=memory)
        fit(Net(batch_size=2, n=20_000), [dyn], tmp_path, max_steps=6)
        settled.append(dyn.batch_size)
    assert settled[0] == 8
    fit_swapped = (budget - swapped.fixed_bytes) // after  # as many samples as fit at the swapped cost: 221
    assert settled[1] == fit_swapped // 8 * 8  # on DynamicBatchSize's grid (multiple_of=8): 27x the unswapped batch


def test_demo_gpt_loss_and_gradients_match_and_it_trains_with_the_callback(tmp_path: Any) -> None:
    from lightning_tune.demos import GPT, DemoGPT, GPTConfig, SyntheticTokenDataModule

    config = GPTConfig(vocab_size=500, seq_len=16, d_model=32, n_layers=2, n_heads=4, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(config).train()
    ids, targets = torch.randint(0, 500, (2, 16)), torch.randint(0, 500, (2, 16))
    targets[1, 5:] = -100
    want = loss_and_grads_of(lambda: model(ids, targets), model)
    with swap_loss(model, "chunked", chunk_size=5) as result:
        assert [entry.module_type for entry in result.entries] == ["GPT"]
        got = loss_and_grads_of(lambda: model(ids, targets), model)
        assert model(ids).shape == (2, 16, 500)  # no targets: the logits
    assert_same(got, want, atol=1e-5)

    module = DemoGPT(config)
    data = SyntheticTokenDataModule(4, seq_len=16, vocab_size=500, train_sequences=8, val_sequences=4)
    swapped: list[bool] = []

    class Seen(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            swapped.append("forward" in vars(pl_module.model))

    make_trainer(tmp_path, [LossSwap("chunked"), Seen()], max_steps=2).fit(module, datamodule=data)
    assert swapped == [True, True] and "forward" not in vars(module.model)


def loss_and_grads_of(run: Callable[[], Tensor], model: nn.Module) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_estimate_memory_shows_the_logits_term_and_what_the_swap_leaves() -> None:
    plain = lt.estimate_memory("llama-3.2-1b", sequence_length=2048, precision="bf16-mixed")
    swapped = lt.estimate_memory("llama-3.2-1b", sequence_length=2048, precision="bf16-mixed", loss_swap=True)
    vocab, hidden = 128_256, 2048
    assert plain.bytes_per_sample - swapped.bytes_per_sample == 2048 * (vocab * (2 + 8) - 2 * hidden * 4)
    assert plain.fixed_bytes == swapped.fixed_bytes
    assert "logits and loss: 2.45 GiB per sample (the loss swap leaves 32.0 MiB)" in plain.notes
    assert "logits and loss: 32.0 MiB per sample with the loss swap (2.45 GiB without)" in swapped.notes


@pytest.fixture(scope="module")
def ranks(two_ranks: Callable[[str], list[Any]]) -> list[dict[str, Any]]:
    """Both ranks' runs of tests/scripts/ddp_loss_swap_script.py: DDP and FSDP2 on CPU."""
    return two_ranks("loss_swap")


def assert_same_run(run: dict[str, Any]) -> None:
    """A swapped run against the unswapped one, on one rank (its shard under FSDP2)."""
    assert "error" not in run, run.get("error")
    assert run["kept_logits"] == [[True, True], [False, False]] and run["restored"]
    assert run["steps"] == [2, 2]
    for plain, swapped in zip(*run["losses"], strict=True):
        assert swapped == pytest.approx(plain, abs=1e-5)
    assert run["grads"] <= 1e-5  # every step's gradient
    assert run["weights"] <= 1e-5  # and the weights they trained


@pytest.mark.slow
def test_ddp_replicas_match_the_unswapped_ddp_run(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert_same_run(rank["ddp/llama-callback"])
    # gradients were all-reduced: identical replicas
    assert ranks[0]["ddp/llama-callback"]["checksum"] == ranks[1]["ddp/llama-callback"]["checksum"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "head_own_unit"),
    [
        pytest.param("fsdp2/llama-callback", True, id="head-sharded-alone-callback"),
        pytest.param("fsdp2/llama-plugin", True, id="head-sharded-alone-plugin"),
        pytest.param("fsdp2/gemma-tied-callback", False, id="tied-head-in-the-root"),
    ],
)
def test_fsdp2_shards_match_the_unswapped_fsdp2_run(ranks: list[dict[str, Any]], run: str, head_own_unit: bool) -> None:
    """Under FSDP2 the head's weight is a sharded DTensor gathered by its unit's forward hooks (the head's own when it
    is sharded alone, freed after its forward and gathered again for its backward; the root's when tied): the swapped
    loss must see the gathered weight in forward and backward, and give each rank's shard the unswapped gradients."""
    for rank in ranks:
        assert_same_run(rank[run])
        assert rank[run]["head_own_unit"] is head_own_unit


def test_token_weighted_dynamic_batches_give_the_unswapped_weights(tmp_path: Any) -> None:
    """DynamicBatchSize cuts each step of padded long-tailed batches into micro-batches and weights their losses by
    tokens; the swapped loss (no logits) must give that run's weights."""
    from tests.batch.test_dynamic_batch_varlen import LM, tiny_gpt2
    from tests.hf_data import long_tailed_lengths

    class Recording(LM):
        kept_logits: list[bool]

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            out = self.model(**batch)
            self.kept_logits.append("logits" in out)
            return out.loss

    data, collate = TokenDataset(long_tailed_lengths(32, median=16, max_len=64, seed=2)), lm_collator()

    def run(swap: bool) -> Recording:
        memory = lt.SimulatedMemory(total_bytes=1 << 40, fixed_bytes=1 << 20, bytes_per_sample=1)
        dyn = lt.DynamicBatchSize(probe=memory, adjust_every=1000, loss_weight="tokens")
        module = Recording(tiny_gpt2(64), data, collate)
        module.kept_logits = []
        callbacks: list[Callback] = [dyn, LossSwap("chunked", chunk_size=7, verbose=False)] if swap else [dyn]
        make_trainer(tmp_path, callbacks, accumulate_grad_batches=4, max_steps=1).fit(module)
        assert dyn.micro_batches > 1  # the step really ran in micro-batches of unequal token counts
        return module

    plain, swapped = run(False), run(True)
    assert set(plain.kept_logits) == {True} and set(swapped.kept_logits) == {False}
    assert len(swapped.kept_logits) == len(plain.kept_logits) > 1
    for (name, want), got in zip(plain.named_parameters(), swapped.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"vocab": 0}, ValueError, r"`vocab` must be an integer >= 1, got 0", id="vocab"),
        pytest.param({"itemsize": 0}, ValueError, r"`itemsize` must be an integer >= 1, got 0", id="itemsize"),
        pytest.param({"tokens": 10.5}, TypeError, r"`tokens` must be an integer", id="tokens-float"),
    ],
)
def test_default_chunk_size_bad_inputs(kwargs: dict[str, Any], error: type, message: str) -> None:
    from lightning_tune.swaps.cross_entropy import default_chunk_size

    with pytest.raises(error, match=message):
        default_chunk_size(**({"tokens": 1024, "vocab": 32_000} | kwargs))
