"""Variable-length fine-tune: the user's fixed micro-batches against DynamicBatchSize, side by side in one process.

A Hugging Face GPT-2 built from a config is fine-tuned on long-tailed sequence lengths (lognormal, ``--median``,
clipped to ``--max-len``), padded by Hugging Face's ``DataCollatorForLanguageModeling``, with the user's DataLoader
at ``--batch-size`` and ``accumulate_grad_batches=--accumulate``. Two runs from the same seed, same samples in the
same order, same effective batch per optimizer step:

- ``fixed``: the user's own run: every micro-batch of ``--batch-size`` is padded to its own longest;
- ``dynamic``: ``DynamicBatchSize(loss_weight="tokens")`` with a ``SimulatedMemory`` that charges ``--bytes-per-token``
  per padded token: each step's samples are grouped by length, each micro-batch trimmed to its own longest, and the
  micro-batch is a budget of padded tokens that the callback adjusts to ``--target`` of the simulated device.

Reported per run: padded tokens (``input_ids.numel()`` summed over every ``training_step`` call), real tokens, the
padding share, samples/s over the optimizer steps after ``--warmup`` (one clock read per optimizer step; on CPU no
device synchronisation is needed), and for ``dynamic`` the allocation failures recovered after the first half of the
run. ``untrimmed`` is what cutting the loader's padded steps without trimming would process (every micro-batch at
the step's longest), counted from the same batches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import QUIET_TRAINER, device_name, header_lines, run_header, write_results  # noqa: E402

import lightning_tune as lt  # noqa: E402

VOCAB = 256


class Tokens(Dataset):
    """Random token ids of the given lengths, as a tokenizer's output."""

    def __init__(self, lengths: list[int]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.samples = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.samples[i]}


def collator() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]"
    )
    return DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")


class FineTune(LightningModule):
    def __init__(self, args: argparse.Namespace, lengths: list[int]) -> None:
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=args.max_len, n_embd=args.d_model, n_layer=args.layers, n_head=4
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.args, self.data = args, Tokens(lengths)
        self.padded = self.real = 0
        self.untrimmed = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.padded += batch["input_ids"].numel()
        self.real += int(batch["attention_mask"].sum())
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.args.batch_size, collate_fn=collator())


class Clock(Callback):
    """One clock read at the end of every optimizer step; the loader's padded steps, for the untrimmed count."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.step_longest: list[int] = []  # longest padded length of each loader batch

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_longest.append(int(batch["input_ids"].shape[1]))
        if not self.ends or trainer.global_step > len(self.ends):
            self.ends.append(time.perf_counter())


def run(args: argparse.Namespace, lengths: list[int], dynamic: bool) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    module, clock = FineTune(args, lengths), Clock()
    callbacks: list[Callback] = [clock]
    dyn = None
    if dynamic:
        probe = lt.SimulatedMemory(
            total_bytes=args.total_bytes,
            fixed_bytes=args.fixed_bytes,
            bytes_per_sample=1,
            bytes_per_token=args.bytes_per_token,
        )
        dyn = lt.DynamicBatchSize(
            target_vram=args.target, probe=probe, adjust_every=args.adjust_every, loss_weight="tokens"
        )
        callbacks.append(dyn)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            default_root_dir=root,
            accelerator="cpu",
            devices=1,
            max_steps=args.steps,
            accumulate_grad_batches=args.accumulate,
            callbacks=callbacks,
            **QUIET_TRAINER,
        )
        oom_at_half: list[int] = []

        class Half(Callback):
            def on_train_batch_end(self, trainer: Trainer, *rest: Any) -> None:
                if dyn is not None and trainer.global_step == args.steps // 2 and not oom_at_half:
                    oom_at_half.append(dyn.oom_recoveries)

        trainer.callbacks.append(Half())
        trainer.fit(module)
    effective = args.batch_size * args.accumulate
    timed = clock.ends[args.warmup :]
    out: dict[str, Any] = {
        "padded_tokens": module.padded,
        "real_tokens": module.real,
        "padding_frac": round(1 - module.real / module.padded, 4),
        "samples_per_sec": round(effective * (len(timed) - 1) / (timed[-1] - timed[0]), 2),
        "steps": trainer.global_step,
    }
    if dyn is not None:
        out["untrimmed_tokens"] = sum(effective * length for length in clock.step_longest)
        out["oom_retries"] = dyn.oom_recoveries
        out["oom_retries_after_settling"] = dyn.oom_recoveries - (oom_at_half[0] if oom_at_half else 0)
        out["micro_batch_tokens"] = dyn.micro_batch_tokens
        decision = dyn.last_decision
        out["predicted_vram_frac"] = None if decision is None else decision.predicted_fraction
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps left out of samples/s")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=8)
    parser.add_argument("--median", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--adjust-every", type=int, default=2)
    parser.add_argument("--total-bytes", type=int, default=40_000_000)
    parser.add_argument("--fixed-bytes", type=int, default=4_000_000)
    parser.add_argument("--bytes-per-token", type=int, default=4_000)
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    n = args.steps * args.batch_size * args.accumulate
    rng = np.random.default_rng(0)
    lengths = [int(v) for v in np.clip(rng.lognormal(np.log(args.median), 1.0, n), 2, args.max_len)]
    device = device_name()
    record: dict[str, Any] = {**run_header("varlen", device), "args": {k: str(v) for k, v in vars(args).items()}}
    record["fixed"] = run(args, lengths, dynamic=False)
    record["dynamic"] = run(args, lengths, dynamic=True)
    fixed, dyn = record["fixed"], record["dynamic"]
    record["ratios"] = {
        "padded_tokens": round(dyn["padded_tokens"] / fixed["padded_tokens"], 3),
        "padded_tokens_vs_untrimmed": round(dyn["padded_tokens"] / dyn["untrimmed_tokens"], 3),
        "samples_per_sec": round(dyn["samples_per_sec"] / fixed["samples_per_sec"], 3),
    }
    lines = [
        f"# Variable-length fine-tune: fixed micro-batches vs DynamicBatchSize — {device}",
        "",
        *header_lines(record),
    ]
    lines += [
        f"GPT-2 ({args.layers} layers, d_model {args.d_model}) from a config; lognormal lengths, median {args.median}, "
        f"max {args.max_len}; DataLoader batch {args.batch_size} x accumulate {args.accumulate}; {args.steps} "
        f"optimizer steps, the first {args.warmup} left out of samples/s.",
        "",
        "| Run | Padded tokens | Real tokens | Padding share | Samples/s | OOM retries after settling |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| fixed ({args.batch_size} x {args.accumulate}) | {fixed['padded_tokens']:,} | {fixed['real_tokens']:,} | "
        f"{fixed['padding_frac']:.1%} | {fixed['samples_per_sec']:.1f} | - |",
        f"| DynamicBatchSize | {dyn['padded_tokens']:,} | {dyn['real_tokens']:,} | {dyn['padding_frac']:.1%} | "
        f"{dyn['samples_per_sec']:.1f} | {dyn['oom_retries_after_settling']} |",
        "",
        f"DynamicBatchSize / fixed: padded tokens {record['ratios']['padded_tokens']}x, samples/s "
        f"{record['ratios']['samples_per_sec']}x. Without trimming, the same steps cut into micro-batches would have "
        f"processed {dyn['untrimmed_tokens']:,} padded tokens ({record['ratios']['padded_tokens_vs_untrimmed']}x of "
        f"that for DynamicBatchSize). Settled budget {dyn['micro_batch_tokens']:,} padded tokens per micro-batch, "
        f"predicted peak {dyn['predicted_vram_frac']} of the simulated device.",
    ]
    write_results(args.out, record, "\n".join([*lines, ""]))


if __name__ == "__main__":
    main()
