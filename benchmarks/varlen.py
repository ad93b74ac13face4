"""Variable-length fine-tune: the user's fixed micro-batches, a length-grouped sampler and DynamicBatchSize, side by
side in one process.

A Hugging Face GPT-2 built from a config is fine-tuned on long-tailed sequence lengths (lognormal, ``--median``,
clipped to ``--max-len``), right-padded by Hugging Face's ``DataCollatorForLanguageModeling`` (``-100`` labels at the
padding), with the user's DataLoader at ``--batch-size`` and ``accumulate_grad_batches=--accumulate``. Four runs from
the same seed, the same effective batch per optimizer step:

- ``fixed``: the user's own run: shuffled micro-batches of ``--batch-size``, each padded to its own longest;
- ``grouped``: the same, with Hugging Face's ``LengthGroupedSampler`` (what ``group_by_length=True`` does: shuffled
  mega-batches sorted by length, so that a micro-batch holds similar lengths);
- ``dynamic``: the user's loader with ``DynamicBatchSize(loss_weight="tokens")``: each step's samples are ordered by
  length, cut into micro-batches, each trimmed to its own longest, the micro-batch a budget of padded tokens adjusted
  to ``--target`` of the device (on a CPU, of a ``SimulatedMemory`` that charges ``--bytes-per-token`` per padded
  token);
- ``packed``: the same with ``pack=True``: each micro-batch one row of its samples' real tokens with their
  boundaries (padding 0), attention through the model's varlen path where it has one (a GPU's flash-attn; on a CPU
  SDPA's block-diagonal mask, which is slower: the row's length squared).

Reported per run: real (non-pad) tokens/s and samples/s over the optimizer steps after ``--warmup`` (one clock read
per optimizer step, the device synchronised), padded and real tokens (``input_ids.numel()`` and the attention mask
summed over every ``training_step``), the padding share, out-of-memory errors (recovered, for ``dynamic``) and, on a
GPU, the peak reserved memory over the target.

    python benchmarks/varlen.py --out benchmarks/results/varlen_cpu

writes each run's row to ``<out>.jsonl`` and ``<out>.md`` as it ends.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import (  # noqa: E402
    BASELINE,
    EXTRA,
    MARGIN,
    QUIET_TRAINER,
    SCENARIO,
    Cost,
    Row,
    Rows,
    device_name,
    now,
    plan,
    run_header,
    transformer_work,
)

import lightning_tune as lt  # noqa: E402

MODES = ("fixed", "grouped", "dynamic", "packed")
LABELS = {
    "fixed": "the user's fixed micro-batches",
    "grouped": "length-grouped sampler (`group_by_length`)",
    "dynamic": 'DynamicBatchSize (token budget, `loss_weight="tokens"`)',
    "packed": "DynamicBatchSize(pack=True) (padding-free rows)",
}


class Tokens(Dataset):
    """Random token ids of the given lengths, as a tokenizer's output (made from the index, nothing held)."""

    def __init__(self, lengths: list[int], vocab: int) -> None:
        self.lengths, self.vocab = lengths, vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        gen = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(2, self.vocab, (self.lengths[i],), generator=gen).tolist()}


def collator(vocab: int) -> Any:
    """Hugging Face's causal-LM collator over a word-level tokenizer of ``vocab`` ids: right padding, ``-100``
    labels at the padding."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    words = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]"
    )
    return DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")


def lengths_for(args: argparse.Namespace, n: int) -> list[int]:
    """``n`` lognormal lengths (median ``--median``, sigma 1) clipped to [2, ``--max-len``]."""
    rng = np.random.default_rng(0)
    return [int(v) for v in np.clip(rng.lognormal(np.log(args.median), 1.0, n), 2, args.max_len)]


class FineTune(LightningModule):
    def __init__(self, args: argparse.Namespace, lengths: list[int], mode: str) -> None:
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=args.vocab_size, n_positions=args.max_len, n_embd=args.d_model, n_layer=args.layers, n_head=4
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.args, self.lengths, self.mode = args, lengths, mode
        self.padded = self.real = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if torch.is_grad_enabled():  # not the packing guard's check of the first packed row
            self.padded += batch["input_ids"].numel()
            mask = batch.get("attention_mask")  # a packed row has none: every token is real
            self.real += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        from transformers.trainer_pt_utils import LengthGroupedSampler

        data, size = Tokens(self.lengths, self.args.vocab_size), self.args.batch_size
        gen = torch.Generator().manual_seed(0)
        sampler: Any = RandomSampler(data, generator=gen)
        if self.mode == "grouped":
            sampler = LengthGroupedSampler(size, lengths=self.lengths, generator=gen)
        return DataLoader(data, batch_size=size, sampler=sampler, collate_fn=collator(self.args.vocab_size))


class Clock(Callback):
    """The clock and the real tokens so far at the end of every optimizer step (the device synchronised)."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step > len(self.ends):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append((now(), module.real))


def run(args: argparse.Namespace, lengths: list[int], mode: str, steps: int) -> dict[str, Any]:
    """One run of ``steps`` optimizer steps in ``mode``; an out-of-memory error ends it and is reported."""
    cuda = torch.cuda.is_available()
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seed_everything(0, verbose=False)
    module, clock = FineTune(args, lengths, mode), Clock()
    callbacks: list[Callback] = [clock]
    dyn = None
    if mode in ("dynamic", "packed"):
        probe = None
        if not cuda:
            probe = lt.SimulatedMemory(
                total_bytes=args.total_bytes,
                fixed_bytes=args.fixed_bytes,
                bytes_per_sample=1,
                bytes_per_token=args.bytes_per_token,
            )
        dyn = lt.DynamicBatchSize(
            target_vram=args.target,
            probe=probe,
            adjust_every=args.adjust_every,
            loss_weight="tokens",
            pack=mode == "packed",
        )
        callbacks.append(dyn)
    oom_at = None
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            default_root_dir=root,
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            precision=args.precision if cuda else "32-true",  # type: ignore[arg-type]
            max_steps=steps,
            accumulate_grad_batches=args.accumulate,
            callbacks=callbacks,
            **QUIET_TRAINER,
        )
        try:
            trainer.fit(module)
        except torch.OutOfMemoryError:
            oom_at = trainer.global_step + 1
    effective = args.batch_size * args.accumulate
    timed = clock.ends[min(args.warmup, max(len(clock.ends) - 2, 0)) :]
    seconds = timed[-1][0] - timed[0][0] if len(timed) > 1 else float("nan")
    out: dict[str, Any] = {
        "mode": mode,
        "steps_done": trainer.global_step,
        "oom_at_step": oom_at,
        "padded_tokens": module.padded,
        "real_tokens": module.real,
        "padding_frac": 1 - module.real / module.padded if module.padded else float("nan"),
        "real_tokens_per_sec": (timed[-1][1] - timed[0][1]) / seconds if len(timed) > 1 else float("nan"),
        "samples_per_sec": effective * (len(timed) - 1) / seconds if len(timed) > 1 else float("nan"),
        "timed_steps": len(timed) - 1,
        "peak_reserved_over_target": None,
        "oom_recoveries": None,
    }
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        out["peak_reserved_over_target"] = torch.cuda.max_memory_reserved() / total / args.target
    if dyn is not None:
        out["oom_recoveries"] = dyn.oom_recoveries
        out["micro_batch_tokens"] = dyn.micro_batch_tokens
        decision = dyn.last_decision
        out["predicted_vram_frac"] = None if decision is None else decision.predicted_fraction
    del trainer, module
    return out


def _cells(result: dict[str, Any]) -> list[Any]:
    def fmt(key: str, spec: str) -> str:
        value = result.get(key)
        return "-" if value is None else format(value, spec)

    oom = f"at step {result['oom_at_step']}" if result["oom_at_step"] else fmt("oom_recoveries", "d") + " recovered"
    if result["oom_recoveries"] is None and not result["oom_at_step"]:
        oom = "none"
    return [
        LABELS[result["mode"]],
        fmt("real_tokens_per_sec", ",.0f"),
        fmt("samples_per_sec", ",.1f"),
        f"{result['padded_tokens']:,}",
        f"{result['real_tokens']:,}",
        fmt("padding_frac", ".1%"),
        oom,
        fmt("peak_reserved_over_target", ".3f"),
    ]


HEADER = (
    "Run",
    "Real tokens/s",
    "Samples/s",
    "Padded tokens",
    "Real tokens",
    "Padding share",
    "Out-of-memory errors",
    "Peak reserved / target",
)


ROLES = {"fixed": BASELINE, "dynamic": SCENARIO, "packed": SCENARIO, "grouped": EXTRA}


def compare(rows: Rows, args: argparse.Namespace, *, calibrate_first: bool = False, max_steps: int = 40) -> str:
    """The three runs at the same effective batch, the user's fixed one first, each a row as it ends. With
    ``calibrate_first``, two short runs of sequences at ``--max-len`` (micro-batches of 1 and 2) size the user's
    micro-batch (the largest whose longest padded batch fits in the target), the effective batch (``--accumulate`` of
    them) and the steps, for the time left; on a GPU the memory per padded token is the device's own."""
    step_s, overhead = 0.0, 0.0
    if calibrate_first:
        longest = [args.max_len] * 4
        costs, peaks = {}, {}
        params = _params(args)
        for micro in (1, 2):
            step_args = argparse.Namespace(**(vars(args) | {"batch_size": micro, "accumulate": 1, "warmup": 0}))
            work = transformer_work(params=params, layers=args.layers, width=args.d_model, seq=args.max_len,
                                    vocab=args.vocab_size, samples=micro, micro=micro)  # fmt: skip
            costs[micro], result = rows.calibrate(
                "fixed at --max-len",
                lambda n, a=step_args: run(a, longest, "fixed", n),
                steps=2,
                work=work,
                like=lambda peak, total: {"peak_reserved_over_target": peak / total / args.target},
                micro_batch=micro,
            )
            peaks[micro] = (result["peak_reserved_over_target"] or 0.0) * args.target
        if peaks[2] > peaks[1]:  # a real device's (or a rehearsal's priced) memory
            per_sample = peaks[2] - peaks[1]
            args.batch_size = max(1, int((args.target - (peaks[1] - per_sample)) / per_sample))
        token_s = costs[2].step / (2 * args.max_len)
        effective = args.batch_size * args.accumulate
        step_s = token_s * effective * args.max_len / 2  # fixed micro-batches padded to about half the longest
        overhead = costs[2].overhead
        args.steps, _ = plan(rows.left() / MARGIN, [Cost(overhead, step_s)] * len(MODES), lo=args.warmup + 3,
                             hi=max_steps)  # fmt: skip
    rows.choose(
        user_micro_batch=args.batch_size,
        accumulate=args.accumulate,
        effective_batch=args.batch_size * args.accumulate,
        steps=args.steps,
        warmup=args.warmup,
        lengths=f"lognormal median {args.median} max {args.max_len}",
        vocab=args.vocab_size,
    )
    rows.text(f"Rates over the optimizer steps after the first {args.warmup} (warm-up, not timed).")
    lengths = lengths_for(args, args.steps * args.batch_size * args.accumulate)
    rows.table(*HEADER)
    results = {}

    def measure(mode: str) -> dict[str, Any]:
        results[mode] = run(args, lengths, mode, args.steps)
        rows.add("run", results[mode], _cells(results[mode]))
        return results[mode]

    rows.run_plan([Row(LABELS[m], overhead + args.steps * step_s, partial(measure, m), ROLES[m]) for m in MODES])
    if "fixed" not in results or "dynamic" not in results:
        return f"{len(results)} of {len(MODES)} runs measured"
    ratio = results["dynamic"]["real_tokens_per_sec"] / results["fixed"]["real_tokens_per_sec"]
    grouped = results.get("grouped")
    against = ""
    if grouped:
        against = f", {results['dynamic']['real_tokens_per_sec'] / grouped['real_tokens_per_sec']:.2f}x grouped"
    if "packed" in results:
        packed = results["packed"]["real_tokens_per_sec"] / results["dynamic"]["real_tokens_per_sec"]
        against += f"; packed {packed:.2f}x the token budget"
    return (
        f"DynamicBatchSize real tokens/s {ratio:.2f}x fixed{against}; padding {results['fixed']['padding_frac']:.0%} "
        f"fixed, {results['dynamic']['padding_frac']:.0%} dynamic"
    )


def _params(args: argparse.Namespace) -> int:
    """Parameters of the fine-tuned GPT-2 (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in FineTune(args, [], "fixed").parameters())


def part(rows: Rows, *, smoke: bool) -> str:
    """The suite's part: GPU sizes (32k vocabulary, lengths median 256 up to 4096) calibrated to the device, or tiny
    ones on the CPU against a simulated device."""
    if smoke:
        argv = "--vocab-size 512 --median 8 --max-len 32 --d-model 32 --layers 1 --batch-size 4 --accumulate 2 "
        argv += "--steps 4 --warmup 1 --adjust-every 1 --total-bytes 400000 --fixed-bytes 40000 --bytes-per-token 4000"
        return compare(rows, build_parser().parse_args(argv.split()), calibrate_first=True, max_steps=4)
    argv = "--vocab-size 32768 --median 256 --max-len 4096 --d-model 512 --layers 6 --accumulate 4 --warmup 3 "
    argv += "--adjust-every 2"
    return compare(rows, build_parser().parse_args(argv.split()), calibrate_first=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps left out of the rates")
    parser.add_argument("--batch-size", type=int, default=8, help="the user's DataLoader batch")
    parser.add_argument("--accumulate", type=int, default=8)
    parser.add_argument("--median", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed", help="on a GPU (a CPU runs 32-true)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--adjust-every", type=int, default=2)
    parser.add_argument("--total-bytes", type=int, default=40_000_000, help="simulated device (CPU only)")
    parser.add_argument("--fixed-bytes", type=int, default=4_000_000, help="simulated device (CPU only)")
    parser.add_argument("--bytes-per-token", type=int, default=4_000, help="simulated device (CPU only)")
    parser.add_argument("--out", type=Path, default=Path("varlen"), help="writes <out>.jsonl and <out>.md")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rows = Rows(args.out, run_header("varlen", device_name()), "Variable-length fine-tune batches")
    print(compare(rows, args))


if __name__ == "__main__":
    main()
