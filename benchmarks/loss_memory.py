"""Training memory per sample of a Llama-shaped causal LM with and without the loss swap, on fake tensors (CPU).

``measure_memory`` runs real training steps of the model on fake tensors (no data, no memory of its size) and
reports the bytes each sample adds to the step's peak. The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers,
32 heads, 8 key/value heads, MLP 8192, tied embeddings), trained at sequence length 2048 under bf16-mixed, with a
vocabulary of 128,256 (Llama 3) and of 32,000 (Llama 2, Mistral). The swap's claim: at 128k the bytes per sample
fall by at least 40 %.

The evaluation rows do the same for a validation step (eval mode, no gradients, labels given: the loss, as a
``validation_step`` computes it), without the swap and with ``swap_loss(model, "chunked", eval=True)``: the peak of
one forward pass on fake tensors at two batch sizes, whose slope is the bytes per sample.

    python benchmarks/loss_memory.py

:func:`part` is the suite's ``loss`` part: real training steps of a Llama-shaped model built from its config at
Llama 3's 128k vocabulary, without the swap (first), with ``swap_loss(model, "chunked")`` and with ``"liger"`` (CUDA
with liger-kernel installed; elsewhere the row says why it was not measured): peak reserved memory, tokens/s and each
step's loss against the unswapped run's, on the same batches from the same initial weights; the first step of each
run (cuBLAS start-up, liger-kernel's Triton compile) is timed apart from its tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import BASELINE, EXTRA, MARGIN, SCENARIO, Row, Rows, plan, transformer_work  # noqa: E402

from lightning_tune import _imports  # noqa: E402
from lightning_tune.plan import measure_memory  # noqa: E402
from lightning_tune.plan.measured import LiveBytes, _fake_modes  # noqa: E402
from lightning_tune.swaps import swap_loss  # noqa: E402

GIB = float(1 << 30)


def llama(vocab: int, *, hidden: int = 2048, layers: int = 16, intermediate: int = 8192) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def per_sample(model: torch.nn.Module, vocab: int, seq: int, precision: str) -> int:
    def batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (size, seq))
        return {"input_ids": ids, "labels": ids}

    return measure_memory(model, batch, precision=precision, for_device="cuda").bytes_per_sample  # type: ignore[arg-type]


def eval_per_sample(model: torch.nn.Module, vocab: int, seq: int, precision: str) -> int:
    """Bytes each sample adds to the peak of a validation forward (eval mode, no grad, labels) on fake tensors."""
    mixed = precision.endswith("-mixed")
    dtype = torch.float32 if mixed or precision == "32-true" else torch.bfloat16
    peaks = []
    for size in (1, 2):
        counter = LiveBytes()
        fake_mode, tracker = _fake_modes(counter)
        with fake_mode, tracker, torch.no_grad():
            state = {name: torch.empty(p.shape, dtype=dtype) for name, p in model.named_parameters()}
            state.update({name: torch.empty(b.shape, dtype=b.dtype) for name, b in model.named_buffers()})
            ids = torch.randint(0, vocab, (size, seq))
            counter.reset_peak()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                loss = torch.func.functional_call(model.eval(), state, (), {"input_ids": ids, "labels": ids}).loss
            peaks.append(counter.peak)
            del loss, state
    return peaks[1] - peaks[0]


#: the suite part's settings: name -> label
LOSS_ROWS = {"none": "no swap (the model's logits)", "chunked": 'swap_loss("chunked")', "liger": 'swap_loss("liger")'}
ROLES = {"none": BASELINE, "chunked": SCENARIO, "liger": EXTRA}
#: seconds allowed for liger-kernel's Triton compile on top of the chunked run's (an allowance, not a measurement)
LIGER_COMPILE_S = 20.0


def _config(sizes: dict[str, int]) -> transformers.LlamaConfig:
    heads = max(sizes["hidden"] // 64, 2)
    return transformers.LlamaConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"],
                                    intermediate_size=4 * sizes["hidden"], num_hidden_layers=sizes["layers"],
                                    num_attention_heads=heads, num_key_value_heads=heads // 2)  # fmt: skip


def train(setting: str, sizes: dict[str, int], device: torch.device, steps: int) -> dict[str, Any]:
    """``steps`` AdamW steps of a fresh Llama (seed 0) on seeded random batches, with the loss swapped or not; the
    first step (cuBLAS start-up, liger-kernel's Triton compile) is timed apart from the rest."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(sizes)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    shape = (sizes["batch"], sizes["seq"])
    batches = [torch.randint(0, sizes["vocab"], shape, generator=generator).to(device) for _ in range(steps)]
    swap = None if setting == "none" else swap_loss(model, setting, device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    losses, ends = [], [time.perf_counter()]
    for ids in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if cuda and len(ends) == 1:
            torch.cuda.synchronize(device)
        if len(ends) == 1:
            ends.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize(device)
    ends.append(time.perf_counter())
    if swap is not None:
        swap.restore()
    peak = torch.cuda.max_memory_reserved(device) / GIB if cuda else None
    timed = max(steps - 1, 1)
    seconds = ends[-1] - ends[1]
    return {"losses": [float(x) for x in losses], "first_step_s": ends[1] - ends[0], "seconds": seconds,
            "peak_reserved_gib": peak, "tokens_per_s": timed * sizes["batch"] * sizes["seq"] / seconds}  # fmt: skip


def part(rows: Rows, *, smoke: bool) -> str:
    """The suite's part: the unswapped run calibrated, then the plan, no swap first, each run a row: peak reserved,
    tokens/s after the first step, the first step's seconds apart (cuBLAS start-up; liger-kernel's compile) and each
    step's loss against the unswapped run's."""
    if smoke:
        sizes, device = {"vocab": 512, "hidden": 32, "layers": 1, "seq": 32, "batch": 2}, torch.device("cpu")
    else:  # Llama 3's vocabulary, where the logits dominate a step's memory
        sizes, device = {"vocab": 128_256, "hidden": 1024, "layers": 8, "seq": 2048, "batch": 8}, torch.device("cuda")
    settings = ["none", "chunked", "liger"]
    if not (device.type == "cuda" and _imports.is_available("liger_kernel")):
        settings.remove("liger")
        reason = f"needs CUDA and liger-kernel; device {device.type}, liger-kernel " + (
            "installed" if _imports.is_available("liger_kernel") else "not installed"
        )
        rows.add("skipped", {"setting": "liger", "reason": reason})
        rows.text(f"{LOSS_ROWS['liger']}: not measured ({reason}).")
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.LlamaForCausalLM(_config(sizes)).parameters())
    work = transformer_work(params=params, layers=sizes["layers"], width=sizes["hidden"], seq=sizes["seq"],
                            vocab=sizes["vocab"], samples=sizes["batch"], micro=sizes["batch"])  # fmt: skip
    rows.text(f"Llama from its config, {sizes}, {params / 1e6:.0f} M parameters, AdamW, "
              f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}. Tokens/s over the steps after the first; the "
              "first step (cuBLAS start-up, liger-kernel's Triton compile) is timed apart.")  # fmt: skip
    cost = rows.calibrate("none", lambda n: train("none", sizes, device, n), steps=2, work=work, setting="none")[0]
    steps, _ = plan(rows.left() / MARGIN - LIGER_COMPILE_S * ("liger" in settings), [cost] * len(settings), lo=3,
                    hi=4 if smoke else 30)  # fmt: skip
    rows.choose(steps=steps, timed_steps=steps - 1, **sizes)
    rows.table("Loss", "peak reserved GiB", "tokens/s", "vs no swap", "largest loss gap to no swap", "first step s")
    measured: dict[str, dict[str, Any]] = {}

    def measure(setting: str) -> dict[str, Any]:
        got = measured[setting] = train(setting, sizes, device, steps)
        base = measured.get("none")
        gap = max(abs(a - b) for a, b in zip(got["losses"], base["losses"], strict=True)) if base else None
        ratio = got["tokens_per_s"] / base["tokens_per_s"] if base else None
        got["loss_gap"] = gap
        rows.add("run", {"setting": setting, "steps": steps, **sizes, **got}, [
            LOSS_ROWS[setting], "-" if got["peak_reserved_gib"] is None else f"{got['peak_reserved_gib']:.2f}",
            f"{got['tokens_per_s']:.0f}", "-" if ratio is None else f"{ratio:.2f}x",
            "-" if gap is None else f"{gap:.2e}", f"{got['first_step_s']:.2f}"])  # fmt: skip
        return got

    rows.run_plan([Row(LOSS_ROWS[s], cost(steps) + LIGER_COMPILE_S * (s == "liger"), partial(measure, s), ROLES[s])
                   for s in settings])  # fmt: skip
    base = measured.get("none")
    return (
        "; ".join(
            f"{s}: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, loss gap {r['loss_gap']:.1e}"
            + (
                ""
                if r["peak_reserved_gib"] is None
                else f", {r['peak_reserved_gib']:.1f} vs {base['peak_reserved_gib']:.1f} GiB"
            )
            for s, r in measured.items()
            if s != "none" and base
        )
        or "no swapped run measured"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    print(f"Llama-shaped, hidden 2048, {args.layers} layers, sequence {args.seq}, {args.precision}, fake tensors")
    print(f"{'vocabulary':>10}  {'no swap GiB/sample':>18}  {'swapped GiB/sample':>18}  {'saving':>7}  seconds")
    for vocab in (128_256, 32_000):
        start = time.perf_counter()
        model = llama(vocab, layers=args.layers)
        before = per_sample(model, vocab, args.seq, args.precision)
        with swap_loss(model, "chunked"):
            after = per_sample(model, vocab, args.seq, args.precision)
        saving = 1 - after / before
        elapsed = time.perf_counter() - start
        print(f"{vocab:>10,}  {before / GIB:>18.3f}  {after / GIB:>18.3f}  {saving:>7.1%}  {elapsed:.0f}")
    print(f"\nEvaluation (eval mode, no grad, labels), {args.precision}, fake tensors")
    print(f"{'vocabulary':>10}  {'no swap GiB/sample':>18}  {'eval=True GiB/sample':>20}  {'saving':>7}  seconds")
    for vocab in (128_256, 32_000):
        start = time.perf_counter()
        model = llama(vocab, layers=args.layers)
        before = eval_per_sample(model, vocab, args.seq, args.precision)
        with swap_loss(model, "chunked", eval=True):
            after = eval_per_sample(model, vocab, args.seq, args.precision)
        saving = 1 - after / before
        elapsed = time.perf_counter() - start
        print(f"{vocab:>10,}  {before / GIB:>18.3f}  {after / GIB:>20.3f}  {saving:>7.1%}  {elapsed:.0f}")


if __name__ == "__main__":
    main()
