"""The suite's ``eval`` part: validation samples/s of a Llama from its config at a 32k vocabulary, at the batch its
loader gives (plain ``trainer.validate``, no callback), at the largest fixed batch that fits (a sweep of plain runs,
doubling from the loader's batch, each out-of-memory error counted) and under ``DynamicBatchSize``'s evaluation
sizing (``tune/eval_batch_size``), each without and with ``LossSwap(eval=True)``: peak memory against the target and
the out-of-memory errors of each.

Every run validates the same samples; the first batch of a run is its warm-up, left out of samples/s. A validation
batch ticks the suite's watchdog (an optimizer step of nothing), so a run past its deadline is stopped as a training
run is. ``--smoke`` (the suite's) runs it on the CPU against a ``SimulatedMemory`` device whose bytes per sample are
``estimate_memory(..., mode="eval")``'s, with and without the loss swap.
"""

from __future__ import annotations

import gc
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from _data import RandomTokens
from _results import BASELINE, EXTRA, QUIET_TRAINER, SCENARIO, Row, Rows, Work, now
from loss_memory import _config
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune.plan import estimate_memory, from_hf_config

#: the share of the device DynamicBatchSize targets, and the sweep's and the peaks' yardstick
TARGET = 0.9
#: an optimizer over one unused value: each validation batch steps it, so the watchdog's step hook sees the batch
_TICK = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
SETTINGS = {"loader": "the loader's batch", "sweep": "largest fixed batch (sweep)", "dynamic": "DynamicBatchSize"}
ROLES = {("loader", False): BASELINE, ("dynamic", False): SCENARIO, ("dynamic", True): SCENARIO,
         ("sweep", False): SCENARIO, ("loader", True): EXTRA, ("sweep", True): EXTRA}  # fmt: skip


def loss_swap() -> pl.Callback:
    """``LossSwap("chunked", eval=True)``, or an error saying this part needs the evaluation loss swap."""
    try:
        return lt.LossSwap("chunked", eval=True, verbose=False)
    except TypeError as err:
        raise RuntimeError(f"the eval part needs LossSwap(eval=True), which this version lacks: {err}") from err


def dynamic(probe: Any) -> pl.Callback:
    """``DynamicBatchSize`` sizing evaluation (``size_eval=True``), or an error saying this part needs it."""
    try:
        return lt.DynamicBatchSize(target_vram=TARGET, size_eval=True, probe=probe)
    except TypeError as err:
        raise RuntimeError(
            f"the eval part needs DynamicBatchSize(size_eval=True), which this version lacks: {err}"
        ) from err


class _Llama(pl.LightningModule):
    """The validation loss of a Llama built from its config (once: every run validates the same weights); every
    batch's size and end time kept."""

    def __init__(self, config: transformers.LlamaConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config)
        self.batches: list[tuple[int, float]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        loss = self.model(input_ids=ids, labels=targets).loss
        self.log("val_loss", loss)
        return loss

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, *args: Any) -> None:
        _TICK.step()  # the watchdog's clock
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.batches.append((int(batch[0].shape[0]), now()))


class _SimulatedLimit(pl.Callback):
    """A plain run meets the simulated device: a batch too large for it raises as a full GPU would."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, *args: Any) -> None:
        self.probe.before_micro_batch(int(batch[0].shape[0]))


def validate(
    module: _Llama, setting: str, swap: bool, batch: int, sizes: dict[str, Any], probe: Any, samples: int
) -> dict[str, Any]:
    """One ``trainer.validate`` over ``samples`` samples in batches of ``batch``: samples/s after the first batch, the
    peak over the device, whether it ran out of memory, and the batches it ran."""
    module.batches = []
    callbacks = [loss_swap()] if swap else []
    if setting == "dynamic":
        callbacks.append(dynamic(probe))
    elif probe is not None:
        callbacks.append(_SimulatedLimit(probe))
    data = DataLoader(RandomTokens(samples, sizes["seq"], sizes["vocab"]), batch_size=batch)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    elif probe is not None:
        probe.free()
        probe.reset_peak()
    trainer = pl.Trainer(accelerator="auto", devices=1, precision="bf16-mixed" if cuda else "32-true",
                         callbacks=callbacks, **QUIET_TRAINER)  # fmt: skip
    oom = False
    try:
        trainer.validate(module, data, verbose=False)
    except torch.OutOfMemoryError:
        oom = True
    if cuda:
        peak_frac = torch.cuda.max_memory_reserved() / torch.cuda.mem_get_info()[1]
    else:
        peak_frac = probe.peak_bytes() / probe.total_bytes() if probe is not None else None
    del trainer
    if cuda:  # what an out-of-memory error left referenced
        gc.collect()
        torch.cuda.empty_cache()
    timed = module.batches[1:]
    seconds = timed[-1][1] - module.batches[0][1] if timed else 0.0
    return {"oom": oom, "batches": [n for n, _ in module.batches], "peak_frac": peak_frac,
            "samples_per_s": sum(n for n, _ in timed) / seconds if seconds > 0 else None}  # fmt: skip


def sweep(module: _Llama, swap: bool, sizes: dict[str, Any], probe: Any) -> tuple[int, int]:
    """The largest fixed batch whose plain run fits, doubling from the loader's (its own row ran it) up to the cap,
    two batches a try; the out-of-memory errors met on the way."""
    best, ooms, batch = sizes["loader_batch"], 0, 2 * sizes["loader_batch"]
    while batch <= sizes["cap"]:
        if validate(module, "sweep", swap, batch, sizes, probe, 2 * batch)["oom"]:
            ooms += 1
            break
        best, batch = batch, 2 * batch
    return best, ooms


def _work(sizes: dict[str, Any], batch: int, swap: bool) -> Work:
    """A validation batch priced for a rehearsal: the forward FLOPs, and the planner's evaluation memory."""
    plan = estimate_memory(from_hf_config(_config(sizes).to_dict()), sequence_length=sizes["seq"], mode="eval",
                           loss_swap=swap, precision="bf16-mixed")  # fmt: skip
    params, seq = plan.parameters, sizes["seq"]
    flops = batch * (2.0 * params * seq + 2.0 * sizes["layers"] * seq * seq * sizes["hidden"])
    return Work(flops, 0, fixed_bytes=plan.fixed_bytes, bytes_per_sample=plan.bytes_per_sample, micro=batch)


def part(rows: Rows, *, smoke: bool) -> str:
    """The suite's part: one calibration at the loader's batch, then the plan, the loader's batch first."""
    sizes: dict[str, Any]
    if smoke:
        sizes = {"vocab": 512, "hidden": 32, "layers": 1, "seq": 32, "loader_batch": 4, "cap": 16, "samples": 32}
    else:
        sizes = {"vocab": 32_000, "hidden": 1024, "layers": 8, "seq": 1024, "loader_batch": 8, "cap": 512,
                 "samples": 1024}  # fmt: skip
    per_sample = {swap: _work(sizes, 1, swap).bytes_per_sample for swap in (False, True)}
    probes: dict[bool, Any] = {swap: None for swap in (False, True)}
    if not torch.cuda.is_available() and rows.device is None:  # 12 samples fit unswapped, all of them swapped
        fixed = 1 << 20
        total = int((fixed + 12 * per_sample[False]) / TARGET)
        probes = {swap: lt.SimulatedMemory(total, fixed, per_sample[swap]) for swap in (False, True)}
    rows.text(f"Llama from its config, {sizes}, {'bf16-mixed' if torch.cuda.is_available() else 'fp32'}; the "
              f"target is {TARGET:.0%} of the device; planner (mode=\"eval\"): {per_sample[False] / 2**20:.1f} MiB a "
              f"sample, {per_sample[True] / 2**20:.1f} MiB with the loss swap. Samples/s leave out each run's first "
              "batch.")  # fmt: skip
    b0, n = sizes["loader_batch"], sizes["samples"]
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialised where it runs: seconds on a CPU
        module = _Llama(_config(sizes)) if rows.device is None else None

    def calibration(steps: int) -> Any:
        return validate(module, "loader", False, b0, sizes, probes[False], steps * b0)

    cost, _ = rows.calibrate("loader's batch", calibration, steps=4, work=_work(sizes, b0, False), batch=b0)
    rows.choose(**sizes)

    def seconds(setting: str, swap: bool) -> float:
        """A run of ``n`` samples costs about the same at any batch (steps grow with it); a sweep adds its tries."""
        run = cost.overhead + cost.step * n / b0
        tries = [b0 * 2**k for k in range(1, 12) if b0 * 2**k <= sizes["cap"]]
        return run + (sum(cost.overhead + cost.step * 2 * b / b0 for b in tries) if setting == "sweep" else 0.0)

    rows.table("Setting", "loss swap", "batch", "samples/s", "vs loader's batch", "peak / device", "OOMs")
    measured: dict[tuple[str, bool], dict[str, Any]] = {}

    def measure(setting: str, swap: bool) -> dict[str, Any]:
        batch, ooms = sweep(module, swap, sizes, probes[swap]) if setting == "sweep" else (b0, 0)
        got = validate(module, setting, swap, batch, sizes, probes[swap], n)
        ooms += got["oom"]
        batch = max(got["batches"], default=batch)
        base = measured.get(("loader", False), {}).get("samples_per_s")
        rate = got["samples_per_s"]
        ratio = rate / base if rate and base else None
        measured[(setting, swap)] = got = {**got, "batch": batch, "ooms": ooms, "vs_loader": ratio}
        peak = "-" if got["peak_frac"] is None else f"{got['peak_frac']:.2f} (target {TARGET})"
        rows.add("run", {"setting": setting, "loss_swap": swap, **got}, [
            SETTINGS[setting], "yes" if swap else "no", batch, "-" if rate is None else f"{rate:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x", peak, ooms])  # fmt: skip
        return got

    rows.run_plan([Row(f"{SETTINGS[s]}{', LossSwap(eval=True)' if swap else ''}", seconds(s, swap),
                       partial(measure, s, swap), role) for (s, swap), role in ROLES.items()])  # fmt: skip
    lines = [
        f"{SETTINGS[s]}{' +swap' if w else ''}: batch {r['batch']}, "
        + ("-" if r["vs_loader"] is None else f"{r['vs_loader']:.2f}x")
        + f", {r['ooms']} OOM"
        for (s, w), r in measured.items()
        if (s, w) != ("loader", False)
    ]
    return "; ".join(lines) or "nothing measured"
