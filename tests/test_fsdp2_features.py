"""docs/multi_gpu.md's strategy × feature table, kept true: FSDP2 and DDP cells run on CPU with 2 gloo processes.

The suite's 2-process launch runs every cell of each strategy (``tests/scripts/fsdp2_features_script.py``); each test
below checks one row of the table against what both ranks recorded, and reads the status it must agree with from the
table itself.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_tune.lr import warmup_cosine_lr
from tests.helpers import ROOT, launch_two_ranks

TABLE = ROOT / "docs" / "multi_gpu.md"
STRATEGIES = ("DDP", "FSDP2", "FSDP", "DeepSpeed")
STATUSES = ("works", "refused", "pending", "n/a")


def table() -> list[dict[str, str]]:
    """The rows of the strategy × feature table, keyed by its header."""
    lines = [line for line in TABLE.read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def status(test_name: str, strategy: str) -> str:
    """The status the table gives, for ``strategy``, to the row this test keeps true."""
    rows = [row for row in table() if f"`{test_name}`" in row["Tests"]]
    assert rows, f"no row of {TABLE.name} names {test_name}"
    return rows[0][strategy].split(" (")[0]


def checked(ranks: list[dict[str, Any]], strategy: str) -> list[dict[str, Any]]:
    """Both ranks' cells, failing on the first cell that raised."""
    for rank in ranks:
        for name, cell in rank.items():
            assert "error" not in cell, f"{strategy} cell {name!r} failed:\n{cell['error']}"
    return ranks


@pytest.fixture(scope="module", params=["DDP", "FSDP2"])
def ranks(request: pytest.FixtureRequest, two_ranks: Callable[[str], list[Any]]) -> tuple[str, list[dict]]:
    strategy = request.param
    return strategy, checked(two_ranks(f"features_{strategy.lower()}"), strategy)


def both(ranks: list[dict], cell: str) -> tuple[dict, dict]:
    return ranks[0][cell], ranks[1][cell]


# ---------------------------------------------------------------------------------------------------- the table


def test_every_cell_has_a_status_and_every_row_names_tests_that_exist() -> None:
    rows = table()
    assert len(rows) >= 12
    sources = {path.name: path.read_text() for path in (ROOT / "tests").rglob("test_*.py")}
    for row in rows:
        for strategy in STRATEGIES:
            assert row[strategy].split(" (")[0] in STATUSES, (row["Feature"], strategy, row[strategy])
            assert re.fullmatch(r"[a-z/]+( \(\d+\))?", row[strategy]), (row["Feature"], row[strategy])
        names = re.findall(r"`(\w+)`", row["Tests"])
        defined = {name: [file for file, text in sources.items() if f"def {name}(" in text] for name in names}
        assert all(defined.values()), (row["Feature"], {n: f for n, f in defined.items() if not f})
        # a CPU column that is not pending is checked by a 2-process test; a GPU column by a GPU-marked test (or, for
        # what Lightning decides before any device is used, a CPU test of the plugin with that strategy)
        files = {file for found in defined.values() for file in found}
        if any(row[s].split(" (")[0] in ("works", "refused") for s in ("DDP", "FSDP2")):
            assert files & {"test_fsdp2_features.py", "test_dynamic_batch_ddp.py"}, row["Feature"]
        if any(row[s].split(" (")[0] in ("works", "refused") for s in ("FSDP", "DeepSpeed")):
            checked = [n for n in names for f in defined[n] if _gpu_marked(sources[f], n)]
            checked += [n for n in names if "test_plugin_strategies.py" in defined[n]]
            assert checked, row["Feature"]


def _gpu_marked(source: str, name: str) -> bool:
    marked_module = "pytestmark = pytest.mark.gpu" in source
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return marked_module or any("gpu" in ast.unparse(d) for d in node.decorator_list)
    return False


def test_every_note_of_the_table_is_written() -> None:
    text = TABLE.read_text()
    used = {int(n) for row in table() for s in STRATEGIES for n in re.findall(r"\((\d+)\)", row[s])}
    for number in used:
        assert re.search(rf"^{number}\. ", text, flags=re.MULTILINE), number


# ---------------------------------------------------------------------------------------------------- the cells


@pytest.mark.slow
def test_lr_schedules_and_plateau_agree_on_every_rank(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    assert status("test_lr_schedules_and_plateau_agree_on_every_rank", strategy) == "works"
    zero, one = both(results, "lr_monitor")
    assert zero["lrs"] == one["lrs"]
    # 16 sequences per rank, batch 4, accumulation 2: 2 optimizer steps per epoch, 3 epochs
    assert zero["steps"] == one["steps"] == 6
    expected = [warmup_cosine_lr(s, base_lr=1e-2, warmup_steps=2, total_steps=6, min_lr=1e-4) for s in range(6)]
    assert [lr[0] for lr in zero["lrs"]] == pytest.approx(expected)
    # rank 1's flat loss alone would have reduced the LR; rank 0's improving loss decided for both
    assert zero["reductions"] == one["reductions"] == 0


@pytest.mark.slow
def test_monitor_logs_the_same_global_figures_on_every_rank(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    assert status("test_monitor_logs_the_same_global_figures_on_every_rank", strategy) == "works"
    zero, one = both(results, "lr_monitor")
    assert len(zero["perf"]) == len(one["perf"]) == 3  # steps 2, 4 and 6
    for row0, row1, local0, local1 in zip(zero["perf"], one["perf"], zero["local"], one["local"], strict=True):
        for key in ("samples_per_sec", "tokens_per_sec", "batches_per_sec", "straggler_ratio"):
            assert row0[f"perf/train/{key}"] == row1[f"perf/train/{key}"], key
        # the global rate is the sum of the ranks' own rates over the same interval
        total = local0["samples_per_sec"] + local1["samples_per_sec"]
        assert row0["perf/train/samples_per_sec"] == pytest.approx(total, rel=1e-6)


@pytest.mark.slow
def test_resume_from_a_checkpoint_matches_an_uninterrupted_run(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    assert status("test_resume_from_a_checkpoint_matches_an_uninterrupted_run", strategy) == "works"
    for cell in both(results, "checkpoint"):
        whole, first, resumed = cell["whole"], cell["first"], cell["resumed"]
        assert first["checkpoint_is_a_folder"] is (strategy == "FSDP2")  # sharded: one file per rank
        assert (first["steps"], resumed["steps"], whole["steps"]) == (4, 8, 8)
        assert first["lrs"] + resumed["lrs"] == whole["lrs"]
        # model and optimizer state were restored (a fresh optimizer would have given other weights)
        assert resumed["shards"] == pytest.approx(whole["shards"], rel=1e-6, abs=1e-9)
        assert first["shards"] != pytest.approx(whole["shards"], rel=1e-6, abs=1e-9)


@pytest.mark.slow
def test_plugin_precision_equals_trainer_precision(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    assert status("test_plugin_precision_equals_trainer_precision", strategy) == "works"
    for cell in both(results, "plugin_precision"):
        assert cell["precision"] == "bf16-mixed"
        assert cell["plugin"] == cell["reference"]  # bit for bit what Trainer(precision="bf16-mixed") trains


@pytest.mark.slow
def test_fused_adamw_swap_steps_the_strategys_parameters(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    assert status("test_fused_adamw_swap_steps_the_strategys_parameters", strategy) == "works"
    for rank in results:
        cell, plugin_run = rank["optimizer_fused"], rank["checkpoint"]["whole"]
        assert (cell["optimizer"], cell["fused"], plugin_run["optimizer"], plugin_run["fused"]) == (
            "AdamW",
            True,
            "AdamW",
            True,
        )
        # OptimizerSwap (callback) and TunePlugin(optimizer=...) train the same weights
        assert cell["shards"] == pytest.approx(plugin_run["shards"], rel=1e-6, abs=1e-9)
        # the logged state is what this rank holds: all of AdamW's 8 bytes per parameter under DDP, about half
        # under FSDP2 with 2 ranks; and it matches the estimate for the optimizer it replaced
        assert cell["state_bytes"] == [cell["estimate"]]
        share = cell["state_bytes"][0] / (8 * cell["elements"])
        assert share == pytest.approx(1.0 if strategy == "DDP" else 0.5, abs=0.05)


@pytest.mark.slow
def test_8bit_optimizers_under_the_strategy(ranks: tuple[str, list[dict]]) -> None:
    pytest.importorskip("bitsandbytes")
    strategy, results = ranks
    documented = status("test_8bit_optimizers_under_the_strategy", strategy)
    for rank in results:
        for entry in ("callback", "plugin"):
            cell = rank["optimizer_8bit"][entry]
            assert cell["refused"] is (documented == "refused"), (entry, cell)
            if cell["refused"]:
                assert "DTensors" in cell["message"] and "Use 'adamw_fused'" in cell["message"]
            else:
                assert cell["optimizer"] == "AdamW8bit"


@pytest.mark.slow
def test_plugin_attention_swap_under_the_strategy(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    documented = status("test_plugin_attention_swap_under_the_strategy", strategy)
    for cell in both(results, "plugin_attention"):
        assert cell["refused"] is (documented == "refused"), cell
        if cell["refused"]:
            assert cell["type"] == "MisconfigurationException"
            assert "callbacks=[AttentionSwap('sdpa')]" in cell["message"]
        else:
            assert cell["swapped_attention"] == 2  # both blocks' attention


@pytest.mark.slow
def test_attention_swap_and_activation_checkpointing_compose_with_the_strategy(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    name = "test_attention_swap_and_activation_checkpointing_compose_with_the_strategy"
    assert status(name, strategy) == "works"
    for rank in results:
        cell, plain = rank["composed"], rank["checkpoint"]["whole"]
        assert cell["block_sharded"] is (strategy == "FSDP2")  # configure_model sharded the wrapped blocks
        assert cell["checkpointed_blocks"] == cell["swapped_attention"] == 2
        # every step ran the first block's attention twice (forward, then recomputed in backward) ...
        assert cell["attn_calls"] == [2] * 8 and plain["attn_calls"] == [1] * 8
        # ... and trained exactly what the run without either callback trained
        assert cell["lrs"] == plain["lrs"]
        assert cell["shards"] == pytest.approx(plain["shards"], rel=1e-6, abs=1e-9)


@pytest.mark.slow
def test_dynamic_batch_recovers_an_oom_on_one_rank_or_fails_every_rank(ranks: tuple[str, list[dict]]) -> None:
    strategy, results = ranks
    if strategy == "DDP":
        pytest.skip("DynamicBatchSize under DDP: tests/batch/test_dynamic_batch_ddp.py")
    assert status("test_dynamic_batch_recovers_an_oom_on_one_rank_or_fails_every_rank", strategy) == "works"
    zero, one = both(results, "dynamic_batch")
    reference = zero["reference"]
    for where in ("forward", "backward"):  # rank 1 alone ran out of memory inside the second block ...
        ours = zero[where], one[where]
        assert (ours[0]["local_ooms"], ours[1]["local_ooms"]) == (0, 1), where
        assert ours[0]["oom_recoveries"] == ours[1]["oom_recoveries"] == 1, where  # ... and both ranks retried
        assert ours[0]["sizes"] == ours[1]["sizes"] and ours[0]["sizes"][0] == 4, where
        assert ours[0]["steps"] == ours[1]["steps"] == reference["steps"] == 4, where
        for epoch in ("0", "1"):  # each sample once per epoch over both ranks, as without the callback
            trained = sorted(ours[0]["seen"][epoch] + ours[1]["seen"][epoch])
            assert trained == sorted(zero["reference"]["seen"][epoch] + one["reference"]["seen"][epoch]), where
        for rank, ref in ((ours[0], zero["reference"]), (ours[1], one["reference"])):
            # SGD and the split micro-batches: the same weights as without the callback, OOM retries included
            assert rank["shards"] == pytest.approx(ref["shards"], rel=1e-5, abs=1e-6), where
            # the micro-batches ran no collective: per step one all-gather per sharded module (plain FSDP2 gathers
            # again for backward), one reduce-scatter per module, and the agreement; a retry gathers once more
            modules = rank["sharded_modules"]
            assert ref["collectives"] == [{"all_gather_single": 5, "reduce_scatter_single": 3}] * 4
            retried = {"all_gather_single": 2 * modules, "reduce_scatter_single": modules, "all_reduce": 2}
            plain = {"all_gather_single": modules, "reduce_scatter_single": modules, "all_reduce": 1}
            assert rank["collectives"] == [retried] + [plain] * 3, where
    # where the smallest micro-batch fails, both ranks raise the same error at once (no collective timeout)
    failed = zero["unrecoverable"], one["unrecoverable"]
    assert all(cell["refused"] and cell["type"] == "OutOfMemoryError" for cell in failed), failed
    assert "on another rank" in failed[0]["message"] and "on this rank" in failed[1]["message"]
    assert all("smallest allowed micro-batch (min_batch_size=8)" in cell["message"] for cell in failed)
    assert zero["seconds"] < 120  # nothing waited for a collective's 60 s timeout


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_fsdp_strategy_refuses_dynamic_batch_on_every_rank(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert status("test_gpu_fsdp_strategy_refuses_dynamic_batch_on_every_rank", "FSDP") == "refused"
    for rank in checked(launch_two_ranks(tmp_path, "features_fsdp")["features_fsdp"], "FSDP"):
        cell = rank["dynamic_batch_refused"]
        assert cell["refused"] and cell["type"] == "MisconfigurationException", cell
        assert "cannot drive FSDPStrategy" in cell["message"] and "fully_shard" in cell["message"]


@pytest.mark.parametrize(
    ("strategy", "options", "message"),
    [
        ("fsdp", {}, "cannot drive FSDPStrategy: its forward all-gathers"),
        ("tensor_parallel", {}, "tensor_parallel_size=2"),
        ("fsdp2", {"sync_oom": False}, "needs `sync_oom=True` under FSDP2"),
    ],
)
def test_dynamic_batch_refuses_what_could_leave_a_rank_waiting(strategy: str, options: dict, message: str) -> None:
    from types import SimpleNamespace

    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    import lightning_tune as lt

    built = {
        "fsdp": FSDPStrategy,
        "tensor_parallel": lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    }[strategy]()
    trainer = SimpleNamespace(strategy=built, world_size=2, callbacks=[])
    dyn = lt.DynamicBatchSize(probe=lt.SimulatedMemory(10_000, 2_000, 100), **options)
    with pytest.raises(MisconfigurationException, match=re.escape(message)):
        dyn.setup(trainer, SimpleNamespace(automatic_optimization=True), "fit")  # type: ignore[arg-type]
