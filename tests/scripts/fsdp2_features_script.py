"""Run by test_fsdp2_features.py: the CPU cells of docs/multi_gpu.md for one strategy in one 2-process launch (gloo).

``main(out, strategy=...)`` with ``fsdp2`` (``ModelParallelStrategy``; the module shards itself in ``configure_model``
with ``fully_shard``), ``ddp``, or ``fsdp`` (``FSDPStrategy``, 2 GPUs). Each cell is one or more short ``fit`` runs;
every rank writes what it saw to ``<out>/rank<r>.json`` under the cell's id, and the test compares ranks, runs and
references.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.fsdp import FSDPModule, fully_shard

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from tests.helpers import LRRecorder, finish_ddp

CONFIG = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_layers=2, n_heads=2)
STRATEGY = "fsdp2"  # set by main


class ShardedGPT(DemoGPT):
    """The demo GPT with FSDP2 applied the documented way: each block, then the root, in ``configure_model``."""

    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, ModelParallelStrategy) or isinstance(self.model, FSDPModule):
            return  # DDP replicates the module as it is
        assert self.device_mesh is not None  # set by ModelParallelStrategy before configure_model
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        # each rank reports its own loss: rank 0 improves every epoch, rank 1 stays flat (and alone would reduce)
        value = 1.0 - 0.1 * self.current_epoch if self.global_rank == 0 else 1.0
        self.log("val_loss", torch.tensor(value), batch_size=1)


class RecordingLogger(Logger):
    """Keeps every row logged on *this* rank (Lightning's own loggers write on rank 0 only)."""

    def __init__(self, monitor: lt.ThroughputLatencyMonitor | None = None) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []
        self.local: list[dict[str, float]] = []
        self.monitor = monitor

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({k: float(v) for k, v in metrics.items()})
        if self.monitor is not None and any(k.startswith("perf/train/") for k in metrics):
            self.local.append(dict(self.monitor.last_interval))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class StepCounter(Callback):
    """Counts forward calls of the first block's attention per optimizer step (2 when the block is recomputed)."""

    def __init__(self) -> None:
        self.calls = 0
        self.per_step: list[int] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        pl_module.model.blocks[0].attn.register_forward_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.calls += 1

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.per_step.append(self.calls)
        self.calls = 0


def data() -> SyntheticTokenDataModule:
    # 32 sequences over 2 ranks, batch 4: 4 batches per rank per epoch
    return SyntheticTokenDataModule(4, seq_len=16, vocab_size=32, train_sequences=32, val_sequences=8, seed=0)


def strategy() -> Strategy:
    # a short collective timeout: a rank left waiting fails within a minute instead of the default half hour
    if STRATEGY == "ddp":
        return DDPStrategy(timeout=timedelta(seconds=60))
    if STRATEGY == "fsdp":
        return FSDPStrategy(timeout=timedelta(seconds=60))
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=60))


def trainer(callbacks: list[Callback] | None = None, **kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "gpu" if STRATEGY == "fsdp" else "cpu",
        "devices": 2,
        "strategy": strategy(),
        "max_epochs": 2,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    defaults.update(kwargs)
    return Trainer(callbacks=callbacks or [], **defaults)


def model() -> ShardedGPT:
    torch.manual_seed(0)
    return ShardedGPT(CONFIG, lr=1e-2)


def shards(module: torch.nn.Module) -> list[float]:
    """This rank's shard of every parameter, summed in float64: equal runs give equal lists on each rank."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
    return [float(p.detach().double().sum()) for p in local]


def elements(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def refused(run: Callable[[], Any]) -> dict[str, Any]:
    try:
        result = run()
    except Exception as err:  # noqa: BLE001 - the refusal is what the cell checks
        return {"refused": True, "type": type(err).__name__, "message": str(err)}
    return {"refused": False, **(result if isinstance(result, dict) else {})}


def cell_plugin_precision() -> dict[str, Any]:
    reference = model()
    torch.manual_seed(1)
    trainer(precision="bf16-mixed", max_epochs=1).fit(reference, datamodule=data())
    ours = model()
    torch.manual_seed(1)
    fitted = trainer(plugins=[lt.TunePlugin("bf16-mixed")], max_epochs=1)
    fitted.fit(ours, datamodule=data())
    return {"reference": shards(reference), "plugin": shards(ours), "precision": fitted.precision}


def cell_lr_monitor() -> dict[str, Any]:
    recorder = LRRecorder()
    plateau = lt.AdaptiveLROnPlateau(patience=0, factor=0.5, min_lr=0.0)
    monitor = lt.ThroughputLatencyMonitor(log_every_n_steps=2)
    logger = RecordingLogger(monitor)
    run = trainer(
        [lt.WarmupCosine(warmup_steps=2, min_lr=1e-4), plateau, monitor, recorder],
        max_epochs=3,
        accumulate_grad_batches=2,
        limit_val_batches=1,
        logger=logger,
    )
    run.fit(model(), datamodule=data())
    perf = [{k: v for k, v in row.items() if k.startswith("perf/train/")} for row in logger.rows]
    return {
        "lrs": recorder.lrs,
        "steps": run.global_step,
        "reductions": plateau.reductions,
        "perf": [row for row in perf if row],
        "local": logger.local,
    }


def schedule_run(out: Path, name: str, *, extra: list[Callback] | None = None, **kwargs: Any) -> dict[str, Any]:
    recorder = LRRecorder()
    counter = StepCounter()
    callbacks = [lt.WarmupCosine(warmup_steps=2, total_steps=8, min_lr=1e-4), recorder, counter, *(extra or [])]
    plugins = kwargs.pop("plugins", [lt.TunePlugin("32-true", optimizer="adamw_fused")])
    run = trainer(callbacks, plugins=plugins, **kwargs)
    module = model()
    run.fit(module, datamodule=data())
    result = {
        "lrs": recorder.lrs,
        "shards": shards(module),
        "steps": run.global_step,
        "optimizer": type(run.optimizers[0]).__name__,
        "fused": bool(run.optimizers[0].param_groups[0].get("fused")),
        "attn_calls": counter.per_step,
    }
    if name == "first_half":
        run.save_checkpoint(out / "resume.ckpt")
        result["checkpoint_is_a_folder"] = (out / "resume.ckpt").is_dir()
    return result


def cell_checkpoint(out: Path) -> dict[str, Any]:
    whole = schedule_run(out, "whole")
    first = schedule_run(out, "first_half", max_epochs=1)
    recorder = LRRecorder()
    run = trainer(
        [lt.WarmupCosine(warmup_steps=2, total_steps=8, min_lr=1e-4), recorder],
        plugins=[lt.TunePlugin("32-true", optimizer="adamw_fused")],
    )
    module = model()
    run.fit(module, datamodule=data(), ckpt_path=out / "resume.ckpt")
    resumed = {"lrs": recorder.lrs, "shards": shards(module), "steps": run.global_step}
    return {"whole": whole, "first": first, "resumed": resumed}


def cell_checkpointing_and_attention(out: Path) -> dict[str, Any]:
    checkpointing = lt.ActivationCheckpointing(verbose=False)
    attention = lt.AttentionSwap("sdpa", verbose=False)
    seen: dict[str, Any] = {}

    class Probe(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            block = pl_module.model.blocks[0]
            seen["block_sharded"] = isinstance(block, FSDPModule)
            seen["checkpointed_blocks"] = len(checkpointing.result.entries) if checkpointing.result else 0
            seen["swapped_attention"] = len(attention.result.entries) if attention.result else 0

    run = schedule_run(out, "composed", extra=[checkpointing, attention, Probe()])
    return {**run, **seen}


def cell_optimizer_swap(out: Path) -> dict[str, Any]:
    swap = lt.OptimizerSwap("adamw_fused")
    logger = RecordingLogger()
    run = schedule_run(out, "callback", extra=[swap], plugins=[], precision="32-true", logger=logger)
    state = [row["tune/optimizer_state_bytes"] for row in logger.rows if "tune/optimizer_state_bytes" in row]
    return {**run, "state_bytes": state, "estimate": swap.state_bytes_before, "elements": elements(model())}


def fit_one_step(callbacks: list[Callback], plugins: list[Any]) -> Trainer:
    run = trainer(callbacks, plugins=plugins, max_steps=1)
    run.fit(model(), datamodule=data())
    return run


def cell_optimizer_8bit() -> dict[str, Any]:
    def optimizer(callbacks: list[Callback], plugins: list[Any]) -> dict[str, Any]:
        return {"optimizer": type(fit_one_step(callbacks, plugins).optimizers[0]).__name__}

    return {
        "callback": refused(lambda: optimizer([lt.OptimizerSwap("adamw8bit")], [])),
        "plugin": refused(lambda: optimizer([], [lt.TunePlugin("32-true", optimizer="adamw8bit")])),
    }


def cell_plugin_attention() -> dict[str, Any]:
    plugin = lt.TunePlugin("32-true", attention="sdpa")
    seen: dict[str, Any] = {}

    class Probe(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            seen["swapped_attention"] = len(plugin.attention_swap.entries) if plugin.attention_swap else 0

    return {**refused(lambda: fit_one_step([Probe()], [plugin])), **seen}


class SGDGPT(ShardedGPT):
    """SGD, whose update is linear in the gradient: micro-batches and retries must leave the weights unchanged."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SeenAndSizes(Callback):
    """Every sample (as its token ids) trained per epoch, the micro-batch size and the collectives of each step."""

    COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "barrier")

    def __init__(self, dyn: lt.DynamicBatchSize | None, probe: lt.SimulatedMemory | None) -> None:
        self.dyn, self.probe = dyn, probe  # the probe's memory is taken in the second block: mid-forward/backward
        self.seen: dict[str, list[list[int]]] = {}
        self.sizes: list[int | None] = []
        self.collectives: list[dict[str, int]] = []
        self._counts: dict[str, int] = {}
        self._originals: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.probe is not None:
            probe = self.probe
            # the second block's output holds the activations (an OOM there is mid-forward) and its gradient needs the
            # backward's transient memory (an OOM there is mid-backward)
            pl_module.model.blocks[1].register_forward_hook(
                lambda module, args, output: probe.with_backward(probe.through(output))
            )
        for name in self.COLLECTIVES:  # FSDP2 and the agreement call these through torch.distributed
            original = self._originals[name] = getattr(torch.distributed, name)

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self._counts[_name] = self._counts.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(torch.distributed, name, counted)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        for name, original in self._originals.items():
            setattr(torch.distributed, name, original)

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._counts = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.setdefault(str(trainer.current_epoch), []).extend(batch[0].tolist())
        self.sizes.append(None if self.dyn is None else self.dyn.batch_size)
        self.collectives.append(self._counts)


def cell_dynamic_batch() -> dict[str, Any]:
    """Rank 1 alone runs out of memory mid-forward, then mid-backward, then where nothing is left to try: both ranks
    must retry together (and train as without the callback), or fail together."""

    def run(rank1: dict[str, int] | None, **options: Any) -> dict[str, Any]:
        # batch 8 on rank 0: 2000 + 8 x 100 bytes; rank 1 gets `rank1`'s figures
        probe = lt.SimulatedMemory(10_000, 2_000, 100, activations="tensors") if rank1 is not None else None
        dyn = lt.DynamicBatchSize(multiple_of=2, probe=probe, agree_timeout=60, **options) if probe else None
        record = SeenAndSizes(dyn, probe)
        run = trainer([record, *([dyn] if dyn else [])], max_epochs=2)
        if probe is not None and rank1 is not None and run.global_rank == 1:
            probe.bytes_per_sample = rank1["forward"]
            probe.backward_bytes_per_sample = rank1["backward"]
        torch.manual_seed(0)
        module = SGDGPT(CONFIG)
        run.fit(module, datamodule=SyntheticTokenDataModule(8, seq_len=16, vocab_size=32, train_sequences=32, seed=0))
        return {
            "shards": shards(module),
            "seen": record.seen,
            "sizes": record.sizes,
            "collectives": record.collectives,
            "sharded_modules": sum(isinstance(m, FSDPModule) for m in module.modules()),
            "steps": run.global_step,
            "oom_recoveries": dyn.oom_recoveries if dyn else 0,
            "local_ooms": probe.out_of_memory_errors if probe else 0,
        }

    return {
        "reference": run(None),
        # at 8 samples: 2000 + 8 x 1100 = 10800 > 10000 bytes when the second block's forward ends
        "forward": run({"forward": 1100, "backward": 0}, adjust_every=2),
        # at 8 samples the forward fits (2000 + 8 x 600 bytes), but the backward's 2000 + 8 x 1100 do not: in the last
        # (and only) micro-batch's backward, where FSDP2 would reduce-scatter the gradients
        "backward": run({"forward": 600, "backward": 1100}, adjust_every=100),
        # nothing smaller to try: both ranks fail at once, with the same error
        "unrecoverable": refused(lambda: run({"forward": 1100, "backward": 0}, min_batch_size=8)),
    }


def cell_dynamic_batch_refused() -> dict[str, Any]:
    dyn = lt.DynamicBatchSize(probe=lt.SimulatedMemory(10_000, 2_000, 100))
    return refused(lambda: fit_one_step([dyn], []))


def main(out: Path, *, strategy: str, only: tuple[str, ...] = ()) -> None:
    global STRATEGY
    STRATEGY = strategy
    cells: dict[str, Callable[[], dict[str, Any]]] = {
        "plugin_precision": cell_plugin_precision,
        "lr_monitor": cell_lr_monitor,
        "checkpoint": lambda: cell_checkpoint(out),
        "composed": lambda: cell_checkpointing_and_attention(out),
        "optimizer_fused": lambda: cell_optimizer_swap(out),
        "optimizer_8bit": cell_optimizer_8bit,
        "plugin_attention": cell_plugin_attention,
        "dynamic_batch": cell_dynamic_batch,
        "dynamic_batch_refused": cell_dynamic_batch_refused,
    }
    results: dict[str, Any] = {}
    rank = 0
    for name, run in cells.items():
        # DynamicBatchSize's DDP cell is tests/scripts/ddp_dynamic_batch_script.py; its refusal is FSDPStrategy's cell
        elsewhere = {"ddp": ("dynamic_batch", "dynamic_batch_refused"), "fsdp2": ("dynamic_batch_refused",)}
        if (only and name not in only) or name in elsewhere.get(STRATEGY, ()):
            continue
        start = time.perf_counter()
        try:
            results[name] = run()
        except Exception:  # noqa: BLE001 - recorded so the test names the failing cell
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = time.perf_counter() - start
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    finish_ddp(out, rank, results)
