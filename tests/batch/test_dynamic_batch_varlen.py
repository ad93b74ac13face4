"""DynamicBatchSize on variable-length Hugging Face batches: trimming, token budgets, token-weighted losses, compile."""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader

import lightning_tune as lt
from tests.helpers import fit
from tests.hf_data import VOCAB, TokenDataset, lm_collator, long_tailed_lengths, tokenizer

transformers.logging.set_verbosity_error()


def tiny_gpt2(positions: int = 1024) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=positions,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=2,
        eos_token_id=3,
    )
    return transformers.GPT2LMHeadModel(cfg)


class LM(LightningModule):
    """A Hugging Face model fine-tuned on a padded dataset; records what training_step saw."""

    def __init__(self, model: nn.Module, dataset: Any, collate: Any, batch_size: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.model, self.dataset, self.collate, self.batch_size, self.lr = model, dataset, collate, batch_size, lr
        self.tokens_run = 0  # sum of input_ids.numel() over every training_step call
        self.seen: list[tuple[int, ...]] = []  # each sample trained, by its real tokens

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.tokens_run += batch["input_ids"].numel()
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            self.seen.append(tuple(ids[mask.bool()].tolist()))
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate)


def roomy() -> lt.SimulatedMemory:
    return lt.SimulatedMemory(total_bytes=1 << 40, fixed_bytes=1 << 20, bytes_per_sample=1)


def weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_padded_tokens_at_most_0_8_of_the_fixed_run_and_every_sample_once(tmp_path: Path) -> None:
    lengths = long_tailed_lengths(128, median=64, max_len=1024, seed=1)
    data = TokenDataset(lengths)
    fixed = LM(tiny_gpt2(), data, lm_collator())
    fit(fixed, [], tmp_path, accumulate_grad_batches=8)
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000)
    tuned = LM(tiny_gpt2(), data, lm_collator())
    fit(tuned, [dyn], tmp_path, accumulate_grad_batches=8)
    step_padded = sum(max(lengths[i : i + 64]) * 64 for i in range(0, 128, 64))  # the loader's 64-sample steps
    assert tuned.tokens_run <= 0.8 * fixed.tokens_run, (tuned.tokens_run, fixed.tokens_run)
    assert tuned.tokens_run < 0.25 * step_padded  # far fewer than the untrimmed steps
    assert collections.Counter(tuned.seen) == collections.Counter(fixed.seen) and len(tuned.seen) == 128
    assert dyn.micro_batch_tokens == 8 * max(lengths[:64])  # the configured micro-batch of 8 at the padded length
    assert dyn.step_tokens is not None and dyn.step_tokens[0] == sum(lengths[64:])


def test_tokens_weighting_equals_one_token_mean_over_the_step(tmp_path: Path) -> None:
    lengths = long_tailed_lengths(32, median=16, max_len=64, seed=2)
    data, collate = TokenDataset(lengths), lm_collator()
    step = collate([data[i] for i in range(32)])
    # reference: one forward over the whole step with Hugging Face's own token-mean loss, one SGD step
    reference = tiny_gpt2(64)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(**step).loss.backward()
    opt.step()

    def run(loss_weight: str) -> list[torch.Tensor]:
        dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000, loss_weight=loss_weight)
        module = LM(tiny_gpt2(64), data, collate)
        fit(module, [dyn], tmp_path, accumulate_grad_batches=4, max_steps=1)
        assert dyn.micro_batches > 1  # the step did run in several micro-batches of unequal token counts
        return weights(module.model)

    for got, want in zip(run("tokens"), weights(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gap = max((a - b).abs().max().item() for a, b in zip(run("samples"), weights(reference), strict=True))
    assert gap > 1e-4  # sample weighting of token-mean losses is not the step's token mean


class Labelled(TokenDataset):
    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.samples[i], "labels": i % 3}


def test_trimmed_classifier_run_gives_the_weights_of_the_fixed_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    bert = transformers.BertForSequenceClassification(cfg)
    data = Labelled(long_tailed_lengths(64, median=16, max_len=128, seed=3))
    collate = transformers.DataCollatorWithPadding(tokenizer(), return_tensors="pt")
    fixed, tuned = LM(copy.deepcopy(bert), data, collate), LM(copy.deepcopy(bert), data, collate)
    fit(fixed, [], tmp_path, accumulate_grad_batches=4)
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000)
    fit(tuned, [dyn], tmp_path, accumulate_grad_batches=4)
    assert tuned.tokens_run < fixed.tokens_run
    for got, want in zip(weights(tuned.model), weights(fixed.model), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class Cheap(LightningModule):
    """An embedding LM that costs next to nothing per token, so many steps run in a second."""

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.dataset = dataset

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.emb(batch["input_ids"]))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=8, collate_fn=lm_collator())


class Trace(Callback):
    def __init__(self, dyn: lt.DynamicBatchSize) -> None:
        self.dyn, self.rows = dyn, []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        decision = self.dyn.last_decision
        self.rows.append(
            (self.dyn.oom_recoveries, self.dyn.micro_batch_tokens, decision and decision.predicted_fraction)
        )


@pytest.mark.slow
def test_token_budget_settles_without_oom_retries_near_the_target(tmp_path: Path) -> None:
    per_token, fixed, total = 4000, 2_000_000, 20_000_000  # 8 samples of 1024 tokens would not fit
    probe = lt.SimulatedMemory(total_bytes=total, fixed_bytes=fixed, bytes_per_sample=1, bytes_per_token=per_token)
    dyn = lt.DynamicBatchSize(target_vram=0.9, probe=probe, adjust_every=2)
    trace = Trace(dyn)
    data = TokenDataset(long_tailed_lengths(64 * 24, median=64, max_len=1024, seed=4))
    fit(Cheap(data), [dyn, trace], tmp_path, accumulate_grad_batches=8)
    settled = trace.rows[len(trace.rows) // 2 :]
    assert len({oom for oom, _, _ in settled}) == 1, "an OOM retry after settling"
    target_tokens = (0.9 * total - fixed) / per_token
    for _, tokens, fraction in settled:
        assert tokens is not None and fraction is not None
        assert fraction >= 0.85 * 0.9 and probe.usage(1, tokens) <= 0.9 * total * 1.01, (tokens, target_tokens)
    assert probe.out_of_memory_errors == dyn.oom_recoveries


def test_batches_without_a_mask_are_cut_as_before(tmp_path: Path) -> None:
    data = TokenDataset([16] * 64)

    class NoMask(Cheap):
        def train_dataloader(self) -> DataLoader:
            collate = lm_collator()
            return DataLoader(
                self.dataset,
                batch_size=8,
                collate_fn=lambda b: {k: v for k, v in collate(b).items() if k != "attention_mask"},
            )

    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000)
    fit(NoMask(data), [dyn], tmp_path, accumulate_grad_batches=8)
    assert dyn.micro_batch_tokens is None and dyn.step_tokens is None and dyn.batch_size == 8


def test_unknown_sequence_key_warns_once_and_leaves_the_batch_untrimmed(tmp_path: Path) -> None:
    class Extra(Cheap):
        def train_dataloader(self) -> DataLoader:
            collate = lm_collator()

            def with_weights(b: Any) -> dict[str, Any]:
                out = dict(collate(b))
                return {**out, "token_weights": out["attention_mask"].float()}

            return DataLoader(self.dataset, batch_size=8, collate_fn=with_weights)

    data = TokenDataset(long_tailed_lengths(128, median=16, max_len=64, seed=5))
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Extra(data), [dyn], tmp_path, accumulate_grad_batches=8)
    named = [w for w in caught if "'token_weights'" in str(w.message)]
    assert len(named) == 1 and "trim_keys" in str(named[0].message)
    assert dyn.step_tokens is None
    named_dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000, trim_keys=["token_weights"])
    fit(Extra(data), [named_dyn], tmp_path, accumulate_grad_batches=8)
    assert named_dyn.step_tokens is not None and named_dyn.step_tokens[1] < 64 * 64


def counting_backend() -> tuple[list[int], Any]:
    calls = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls[0] += 1
        return gm.forward

    return calls, backend


@pytest.mark.slow
def test_a_compiled_model_recompiles_a_bounded_number_of_times(tmp_path: Path) -> None:
    torch._dynamo.reset()
    compiles, backend = counting_backend()
    data = TokenDataset(long_tailed_lengths(32 * 50, median=16, max_len=64, seed=6))
    module = LM(torch.compile(tiny_gpt2(64), backend=backend), data, lm_collator())
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000)
    fit(module, [dyn], tmp_path, accumulate_grad_batches=4)
    assert module.trainer.global_step == 50
    assert len(dyn.shapes) > 10  # many micro-batch shapes ran ...
    assert compiles[0] < 8  # ... and Dynamo compiled a few graphs (every graph break's frame included)


def test_warns_once_when_the_recompile_limit_is_near(tmp_path: Path) -> None:
    torch._dynamo.reset()
    _, backend = counting_backend()
    module = Cheap(TokenDataset(long_tailed_lengths(64 * 8, median=16, max_len=64, seed=7)))
    module.emb = torch.compile(module.emb, backend=backend)
    dyn = lt.DynamicBatchSize(probe=roomy(), adjust_every=1000)
    with (
        torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=4),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        fit(module, [dyn], tmp_path, accumulate_grad_batches=8)
    near = [w for w in caught if "recompile limit is 4" in str(w.message)]
    assert len(near) == 1 and "automatic_dynamic_shapes" in str(near[0].message)


class Metrics(Logger):
    """Keeps what is logged, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    name, version = "memory", 0  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Counted(Cheap):
    def __init__(self, dataset: Any) -> None:
        super().__init__(dataset)
        self.real = self.padded = 0
        self.shapes_run: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch["input_ids"].device.type != "meta":  # not the monitor's FLOP count on a meta-device copy
            self.real += int(batch["attention_mask"].sum())
            self.padded += batch["attention_mask"].numel()
            self.shapes_run.append(tuple(batch["input_ids"].shape))  # type: ignore[arg-type]
        return super().training_step(batch, batch_idx)


def torch_step_flops(samples: int, length: int) -> int:
    """torch's own count of one forward and backward of ``Cheap`` on a batch of this shape."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.zeros(samples, length, dtype=torch.long)
    with FlopCounterMode(display=False) as mode:
        Cheap(None).training_step({"input_ids": ids, "labels": ids}, 0).backward()
    return mode.get_total_flops()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.slow
def test_the_monitor_reports_the_padding_and_flops_of_the_micro_batches_run(tmp_path: Path, dynamic: bool) -> None:
    module = Counted(TokenDataset(long_tailed_lengths(64 * 4, median=64, max_len=1024, seed=8)))
    logger = Metrics()
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=4, peak_flops=1e12)
    callbacks: list[Callback] = [monitor]
    if dynamic:
        callbacks.append(lt.DynamicBatchSize(probe=roomy(), adjust_every=1000))
    fit(module, callbacks, tmp_path, accumulate_grad_batches=8, logger=logger, log_every_n_steps=4)
    logged = [row["perf/train/padding_frac"] for row in logger.rows if "perf/train/padding_frac" in row]
    assert logged == [pytest.approx(1 - module.real / module.padded)]
    assert (logged[0] < 0.35) if dynamic else (logged[0] > 0.6)  # what trimming saved shows
    # MFU counts the FLOPs of the (trimmed) micro-batches that ran, not of the padded batch they were cut from
    ran = sum(torch_step_flops(*shape) for shape in module.shapes_run)
    assert monitor.stats.total.flops == pytest.approx(ran, rel=1e-9)


def test_label_shift_and_compiled_modules_are_found_as_hugging_face_and_torch_see_them() -> None:
    from lightning_tune.batch.step import has_compiled as _has_compiled
    from lightning_tune.batch.trim import causal_lm_shift as _causal_lm_shift
    from lightning_tune.swaps.compile import compile_modules

    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
    )
    assert _causal_lm_shift(nn.ModuleDict({"lm": tiny_gpt2(8)})) == 1  # as Trainer's `_loss_shifts_labels`
    assert _causal_lm_shift(bert) == 0 and _causal_lm_shift(nn.Linear(2, 2)) == 0
    assert not _has_compiled(bert)
    assert _has_compiled(nn.Sequential(torch.compile(nn.Linear(2, 2), backend="eager")))
    compile_modules(bert, backend="eager")  # the TorchCompile preset's way: compiled instance forwards
    assert _has_compiled(bert)


@pytest.mark.slow
def test_the_token_budget_and_its_memory_model_survive_a_checkpoint(tmp_path: Path) -> None:
    probe = lt.SimulatedMemory(total_bytes=20_000_000, fixed_bytes=2_000_000, bytes_per_sample=1, bytes_per_token=4000)
    data = TokenDataset(long_tailed_lengths(64 * 6, median=64, max_len=1024, seed=9))
    dyn = lt.DynamicBatchSize(probe=probe, adjust_every=2)
    fit(Cheap(data), [dyn], tmp_path, accumulate_grad_batches=8)
    assert dyn.token_controller is not None and dyn.token_controller.model.sizes_seen >= 2
    resumed = lt.DynamicBatchSize(probe=probe, adjust_every=1000)
    resumed.load_state_dict(dyn.state_dict())
    fit(Cheap(data), [resumed], tmp_path, accumulate_grad_batches=8, max_steps=1)
    assert resumed.micro_batch_tokens == dyn.micro_batch_tokens
    assert resumed.token_controller is not None
    assert resumed.token_controller.state_dict() == dyn.token_controller.state_dict()


@pytest.mark.slow
def test_ddp_ranks_keep_one_token_budget_and_train_every_sample_once(two_ranks: Callable[[str], list[Any]]) -> None:
    ranks = two_ranks("varlen")
    # the first budget is the configured micro-batch at the longest first step of the ranks, every decision is
    # taken on the ranks' agreed figures: one budget on both
    assert ranks[0]["budgets"] == ranks[1]["budgets"] and ranks[0]["decisions"] >= 2
    assert len(set(ranks[0]["budgets"])) > 1  # the budget did change, on both ranks alike
    assert ranks[0]["steps"] == ranks[1]["steps"] == 6
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == ranks[0]["expected"]
    assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"], rel=1e-6)  # gradients were all-reduced


class ShapeMemory(lt.SimulatedMemory):
    """A simulated device that records each micro-batch's (samples, padded length) before it runs."""

    ran: list[tuple[int, int | None]]

    def before_micro_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        self.ran.append((batch_size, seq_len))
        super().before_micro_batch(batch_size, seq_len)


def test_a_token_budget_stops_at_once_when_the_fewest_samples_at_a_length_do_not_fit(tmp_path: Path) -> None:
    # 1 MiB per sample at 64 positions: a batch of short samples fits, one 1024-position sample (16 MiB) never does
    memory = ShapeMemory(total_bytes=12 << 20, fixed_bytes=1 << 20, bytes_per_sample=1 << 20, seq_len=64)
    memory.ran = []
    module = Cheap(TokenDataset([16] * 15 + [1024]))
    with pytest.raises(torch.OutOfMemoryError, match=r"smallest allowed micro-batch \(min_batch_size=1\) on this"):
        fit(module, [lt.DynamicBatchSize(probe=memory, adjust_every=1000)], tmp_path, accumulate_grad_batches=2)
    # one failure with the lone long sample, then the clear error: no retries at ever smaller budgets
    assert memory.ran.count((1, 1024)) == 1
