"""The benchmark suite cannot rot between GPU runs: its smoke run executes every part's code on the CPU and writes
every result file with the run's header; a part that fails costs the others nothing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import lightning_tune

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "suite.py"


def _suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_suite", SUITE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_header(record: dict[str, Any], benchmark: str | None = None) -> None:
    from _results import HEADER_FIELDS  # importable once the suite put benchmarks/ on the path

    for field in HEADER_FIELDS:
        assert record.get(field), f"{field!r} missing from {record.get('benchmark')}"
    assert record["lightning_tune"] == lightning_tune.__version__
    assert record["versions"]["torch"] and record["versions"]["lightning"]
    assert "suite.py" in record["command"]
    if benchmark is not None:
        assert record["benchmark"] == benchmark


@pytest.mark.slow
def test_smoke_suite_writes_every_part_with_its_header(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SUITE), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = _suite().PARTS
    status = json.loads((tmp_path / "suite.json").read_text())
    assert {name: entry["status"] for name, entry in status["parts"].items()} == dict.fromkeys(parts, "ok")
    for name in parts:
        record = json.loads((tmp_path / f"{name}.json").read_text())
        _check_header(record)
        assert record["smoke"] is True and "error" not in record
        report = (tmp_path / f"{name}.md").read_text()
        assert record["commit"][:12] in report and record["device"] in report and "Command: `" in report
    assert "skipped" in (tmp_path / "gpu-tests.log").read_text()  # no GPU here: the gpu tests ran and skipped
    # the figures each part promises are there (tiny and meaningless on a CPU, but computed)
    attention = json.loads((tmp_path / "attention.json").read_text())
    for by_len in attention["by_seq_len"].values():
        assert set(by_len["median"]) == {"eager", "sdpa_untouched", "swap_sdpa"}  # no flash-attn: no duplicate row
        assert "flash" in by_len["flash_note"]
    optimizers = json.loads((tmp_path / "optimizers.json").read_text())
    assert set(optimizers["median"]) == {"adamw", "adamw_fused", "adamw8bit", "paged_adamw8bit"}
    planner = json.loads((tmp_path / "planner.json").read_text())
    assert {(r["precision"], r["batch_size"]) for r in planner["rows"]} == {
        (p, b) for p in ("bf16-mixed", "32-true") for b in (1, 2, 4)
    }
    dynamic = json.loads((tmp_path / "dynamic-batch.json").read_text())
    effective = {r["effective_batch"] for r in dynamic["results"].values()}
    assert effective == {32}  # one exact effective batch for the fixed, finder (pick 7) and dynamic runs
    # timed per optimizer step, not per micro-batch: 4 steps of 4 micro-batches of 8 are 4 timed steps
    assert {name: r["steps_done"] for name, r in dynamic["results"].items()} == dict.fromkeys(dynamic["results"], 4)
    assert dynamic["doubling"]["dynamic"]["steps_done"] == 4
    pack = json.loads((tmp_path / "pack.json").read_text())
    assert set(pack["median"]) == {"plain", "hand_tuned", "lightning_tune"}


def test_a_failing_part_keeps_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    suite = _suite()
    from _results import run_header

    def good(smoke: bool) -> tuple[dict[str, Any], str]:
        return {**run_header("monitor", "test device"), "value": 1}, "# monitor\n"

    def bad(smoke: bool) -> tuple[dict[str, Any], str]:
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(suite, "RUNNERS", {"monitor": good, "attention": bad, "optimizers": good})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sys, "argv", ["benchmarks/suite.py", "--only", "monitor,attention,optimizers"])
    threads = torch.get_num_threads()
    try:
        assert suite.main(["--smoke", "--out", str(tmp_path), "--only", "monitor,attention,optimizers"]) == 1
    finally:
        torch.set_num_threads(threads)
    status = json.loads((tmp_path / "suite.json").read_text())["parts"]
    assert [(k, v["status"]) for k, v in status.items()] == [
        ("monitor", "ok"),
        ("attention", "error"),
        ("optimizers", "ok"),
    ]
    assert json.loads((tmp_path / "monitor.json").read_text())["value"] == 1
    failed = json.loads((tmp_path / "attention.json").read_text())
    _check_header(failed, "attention")
    assert "the device fell over" in failed["error"]
    assert "the device fell over" in (tmp_path / "attention.md").read_text()
    assert json.loads((tmp_path / "optimizers.json").read_text())["value"] == 1


@pytest.mark.parametrize(
    ("only", "parts"),
    [
        pytest.param("group1", ["monitor", "attention", "optimizers", "planner"], id="group1"),
        pytest.param("group2", ["dynamic-batch", "pack", "gpu-tests"], id="group2"),
        pytest.param("pack,monitor", ["monitor", "pack"], id="parts-in-suite-order"),
        pytest.param(
            None, ["monitor", "attention", "optimizers", "planner", "dynamic-batch", "pack", "gpu-tests"], id="all"
        ),
    ],
)
def test_only_selects_parts_and_groups(only: str | None, parts: list[str]) -> None:
    assert _suite()._select(only) == parts


def test_only_rejects_an_unknown_part_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, str(SUITE), "--out", "unused", "--only", "monitor,flops"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "`--only` must name parts or groups from" in done.stderr and "'flops'" in done.stderr
