"""DynamicBatchSize(pack=True): padding-free micro-batches as Hugging Face's flattening collator makes them, guarded."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune.batch.pack import PackingError, no_cache, pack
from lightning_tune.batch.trim import padding_layout
from lightning_tune.perf.counting import count_step_flops
from tests.batch.test_dynamic_batch_varlen import Metrics
from tests.helpers import make_trainer
from tests.hf_data import VOCAB, TokenDataset, lm_collator, long_tailed_lengths

transformers.logging.set_verbosity_error()

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "mistral": transformers.MistralConfig,
    "gemma": transformers.GemmaConfig,
}


def tiny(name: str = "llama", attention: str = "sdpa") -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = CONFIGS[name](
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def lengths(n: int = 32) -> list[int]:
    """Long-tailed lengths; the first step (16 samples) holds two of the longest, 40 tokens."""
    found = long_tailed_lengths(n, median=10, max_len=40, seed=3)
    found[0] = found[5] = 40
    return found


def padded(side: str, n: int = 8) -> dict[str, torch.Tensor]:
    data = TokenDataset(lengths(n))
    return dict(lm_collator(side)([data[i] for i in range(n)]))


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_packed_row_is_what_hugging_faces_flattening_collator_makes(side: str) -> None:
    batch = padded(side)
    mask = batch["attention_mask"].bool()
    order = [3, 0, 7, 5]
    features = [{"input_ids": batch["input_ids"][i][mask[i]], "labels": batch["labels"][i][mask[i]]} for i in order]
    flattening = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    want = flattening(features)
    got = pack(batch, padding_layout(batch), order)
    assert got.keys() == want.keys()  # no attention_mask
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def token_sum_grads(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss * (batch["labels"][:, 1:] != -100).sum()  # Hugging Face's token mean, times its tokens
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.slow
def test_the_packed_loss_and_every_gradient_are_the_padded_ones(name: str, attention: str, side: str) -> None:
    batch = padded(side)
    layout = padding_layout(batch)
    first = [0 if side == "right" else layout.padded - n for n in layout.lengths]
    batch["labels"][range(8), first] = -100  # no sample's first token is a target, padded or packed
    if side == "left":  # positions from the mask, as Hugging Face's generate builds them
        batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    model = tiny(name, attention).train()
    want = token_sum_grads(model, {**batch, "use_cache": False})
    row = pack(batch, padding_layout(batch), range(8))
    with no_cache([model]):
        got = token_sum_grads(model, row)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # with the cache Hugging Face turns on in train() by default, the row attends across its samples
    mixed = token_sum_grads(model, row)
    assert mixed[0] != pytest.approx(want[0], rel=1e-6)


class CausalLM(LightningModule):
    def __init__(self, batch_size: int, side: str = "right", attention: str = "sdpa") -> None:
        super().__init__()
        self.model, self.batch_size, self.collate = tiny(attention=attention), batch_size, lm_collator(side)
        self.dataset = TokenDataset(lengths())
        self.packed: list[bool] = []  # whether each training_step call got a packed row

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.packed.append("cu_seq_lens_q" in batch and "attention_mask" not in batch)
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate)


def fit(module: LightningModule, callbacks: list[Callback], tmp_path: Path, **kwargs: Any) -> Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    kwargs.setdefault("enable_checkpointing", any(isinstance(c, ModelCheckpoint) for c in callbacks))
    trainer = make_trainer(tmp_path, callbacks, max_epochs=1, **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def small_device() -> lt.SimulatedMemory:
    """A simulated device on which a packed row of more than 60 tokens runs out of memory."""
    return lt.SimulatedMemory(
        total_bytes=(1 << 20) + 60 * 1024, fixed_bytes=1 << 20, bytes_per_sample=1, bytes_per_token=1024
    )


class FirstLabels:
    """Hugging Face's causal-LM collator with each sample's first label -100 (as in a packed row), for the reference."""

    def __init__(self, side: str) -> None:
        self.inner = lm_collator(side)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = dict(self.inner(samples))
        first = batch["attention_mask"].argmax(1)
        batch["labels"][torch.arange(len(first)), first] = -100
        return batch


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_packed_fit_trains_as_the_whole_step_token_mean_run_through_an_oom(tmp_path: Path, side: str) -> None:
    reference = CausalLM(batch_size=16, side=side)  # plain Lightning: the effective batch in one padded batch
    reference.collate = FirstLabels(side)
    fit(reference, [], tmp_path)
    memory = small_device()
    dyn = lt.DynamicBatchSize(probe=memory, pack=True)
    tuned = CausalLM(batch_size=4, side=side)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DynamicBatchSize: out of memory")
        fit(tuned, [dyn], tmp_path, accumulate_grad_batches=4)
    assert dyn.oom_recoveries >= 1 and memory.out_of_memory_errors == dyn.oom_recoveries
    assert tuned.packed.count(False) == 1 and dyn.weighting == "tokens"  # packed, but for the guard's padded forward
    assert dyn.micro_batch_tokens is not None and dyn.micro_batch_tokens <= 60  # the budget is the row's length
    assert dyn.step_tokens == (sum(lengths()[16:]),) * 2  # real tokens only: no padding
    for got, want in zip(tuned.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def boundary_blind(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """Causal attention over the whole row: it reads the positions (rotary) but never the sample boundaries."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=kwargs["scaling"])
    return out.transpose(1, 2).contiguous(), None


def test_the_guard_stops_an_attention_that_ignores_the_boundaries(tmp_path: Path) -> None:
    transformers.AttentionInterface.register("boundary_blind", boundary_blind)
    transformers.AttentionMaskInterface.register("boundary_blind", transformers.masking_utils.sdpa_mask)
    # (by name: the suite's doctests import the module once more, with a class of that name of their own)
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM \(config._attn_implementation='boundary_blind'\)") as err:
        fit(CausalLM(batch_size=4, attention="boundary_blind"), [lt.DynamicBatchSize(pack=True)], tmp_path)
    assert type(err.value).__name__ == PackingError.__name__
    # turned off, the same run trains on mixed samples, with no padded forward to compare
    blind = CausalLM(batch_size=4, attention="boundary_blind")
    fit(blind, [lt.DynamicBatchSize(pack=True, pack_guard=False)], tmp_path)
    assert blind.packed and all(blind.packed)


def test_attention_flops_of_a_packed_row_are_its_sequences_and_its_padding_is_none(tmp_path: Path) -> None:
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=1, peak_flops=1e12)
    module = CausalLM(batch_size=16)
    roomy = lt.SimulatedMemory(total_bytes=1 << 30, fixed_bytes=1 << 20, bytes_per_sample=1)
    dyn = lt.DynamicBatchSize(probe=roomy, pack=True)
    logger = Metrics()
    fit(module, [monitor, dyn], tmp_path, max_steps=1, logger=logger, log_every_n_steps=1)
    assert [row["perf/train/padding_frac"] for row in logger.rows if "perf/train/padding_frac" in row] == [0.0]

    def counted(n: int) -> float:  # the step's FLOPs on one unpadded sequence of n tokens
        ids = torch.zeros(1, n, dtype=torch.long)
        return count_step_flops(module.model, {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss, samples=1)[
            0
        ].total

    per_sequence = sum(counted(n) for n in lengths()[:16])
    assert monitor.stats.total.flops == pytest.approx(per_sequence, rel=1e-9)
    rows = dyn.step_shapes
    assert rows == [(16, sum(lengths()[:16]))]  # one row: counted as one sequence, it would be
    assert counted(rows[0][1]) > 1.3 * per_sequence


BAD = [
    pytest.param({"keep": "lr"}, "`keep` must be 'effective', got 'lr'", id="keep"),
    pytest.param({"loss_weight": "samples"}, "`loss_weight` must be 'tokens' or 'auto', got 'samples'", id="weight"),
    pytest.param({"split_batch": lambda b, s: [b]}, "`split_batch` must be None", id="split_batch"),
    pytest.param({"pack": 1}, "`pack` must be True or False, got 1 (int)", id="pack-type"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_arguments_packing_cannot_train_with_are_refused(kwargs: dict[str, Any], message: str) -> None:
    error = TypeError if kwargs.get("pack") == 1 else ValueError
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        lt.DynamicBatchSize(**{"pack": True, **kwargs})


def test_a_batch_without_labels_is_refused_naming_what_packing_needs(tmp_path: Path) -> None:
    module = CausalLM(batch_size=4)
    inner = module.collate
    module.collate = lambda samples: {k: v for k, v in inner(samples).items() if k != "labels"}
    with pytest.raises(TypeError, match="`pack=True` needs mapping batches with a 2-D `attention_mask` and `labels`"):
        fit(module, [lt.DynamicBatchSize(pack=True)], tmp_path)


@pytest.mark.parametrize("extra", ["loss-swap", "attention-swap", "checkpointing", "hf-checkpointing", "resume"])
@pytest.mark.slow
def test_a_packed_fit_trains_as_the_whole_step_token_mean_run_with_a_loss_swap_checkpointing_and_across_a_resume(
    tmp_path: Path, extra: str
) -> None:
    reference = CausalLM(batch_size=16)
    reference.collate = FirstLabels("right")
    fit(reference, [], tmp_path)
    tuned = CausalLM(batch_size=4)
    callbacks: list[Callback] = {
        "loss-swap": [lt.LossSwap(verbose=False)],
        "attention-swap": [lt.AttentionSwap(verbose=False)],
        "checkpointing": [lt.ActivationCheckpointing(verbose=False)],
    }.get(extra, [])
    if extra == "hf-checkpointing":  # Hugging Face's own activation checkpointing
        tuned.model.gradient_checkpointing_enable()
    kwargs: dict[str, Any] = {"accumulate_grad_batches": 4}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DynamicBatchSize: out of memory")
        if extra == "resume":  # two steps, a checkpoint after each; the second step again from the first's
            saving = ModelCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=1, save_top_k=-1)
            fit(tuned, [saving, lt.DynamicBatchSize(probe=small_device(), pack=True)], tmp_path, **kwargs)
            (path,) = (tmp_path / "steps").glob("*step=1.ckpt")
            tuned, kwargs["ckpt_path"] = CausalLM(batch_size=4), path
        fit(tuned, [*callbacks, lt.DynamicBatchSize(probe=small_device(), pack=True)], tmp_path, **kwargs)
    assert tuned.packed.count(False) == 1  # the guard's padded forward, once a fit (the resumed one's included)
    for got, want in zip(tuned.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_under_ddp_and_fsdp2_a_packed_fit_trains_as_the_trimmed_ddp_one(two_ranks: Callable[[str], list[Any]]) -> None:
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        runs[strategy] = two_ranks(f"pack_{strategy}")
        for rank in runs[strategy]:
            assert (rank["oom"] >= 1) == (strategy == "ddp") and rank["steps"] == 2
            assert rank["packed_calls"].count(False) == 1  # the guard's padded forward
    for ddp, fsdp2 in zip(runs["ddp"], runs["fsdp2"], strict=True):
        for packed, trimmed, sharded in zip(ddp["packed"], ddp["trimmed"], fsdp2["packed"], strict=True):
            torch.testing.assert_close(torch.tensor(packed), torch.tensor(trimmed), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.tensor(sharded), torch.tensor(trimmed), rtol=1e-5, atol=1e-5)
    assert runs["ddp"][0]["packed"] == runs["ddp"][1]["packed"]  # the gradients were all-reduced


@pytest.mark.slow
def test_dropout_does_not_trip_the_guard(tmp_path: Path) -> None:
    module = CausalLM(batch_size=4)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=16, n_layer=1, n_head=2)
    module.model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 in its embeddings, attention and residuals
    fit(module, [lt.DynamicBatchSize(pack=True)], tmp_path)
    assert module.packed.count(False) == 1 and module.model.training  # the guard compared in eval mode, then back
