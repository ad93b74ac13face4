"""The benchmark suite cannot rot between GPU runs: its smoke run executes every part's code on the CPU, calibrating
and writing each row as it is measured; a part stopped by the time budget keeps its rows and says what it cut; a part
that fails costs the others nothing; every file names the project's own commit and the source it ran."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import lightning_tune

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "suite.py"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _suite() -> ModuleType:
    return _load(SUITE, "benchmark_suite")  # puts benchmarks/ on the path


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_header(record: dict[str, Any], benchmark: str | None = None) -> None:
    from _results import HEADER_FIELDS  # importable once the suite put benchmarks/ on the path

    for field in HEADER_FIELDS:
        assert record.get(field), f"{field!r} missing from {record.get('benchmark')}"
    assert record["lightning_tune"] == lightning_tune.__version__
    assert record["versions"]["torch"] and record["versions"]["lightning"]
    assert record["source"].startswith("sha256:")
    if benchmark is not None:
        assert record["benchmark"] == benchmark


@pytest.mark.slow
def test_smoke_suite_calibrates_and_writes_every_part_row_by_row(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(SUITE), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = list(_suite().PARTS)
    assert parts == [
        "gpu-tests",
        "pack",
        "dynamic-batch",
        "varlen",
        "loss",
        "monitor",
        "optimizers",
        "attention",
        "planner",
    ]
    status = json.loads((out / "suite.json").read_text())
    assert {name: entry["status"] for name, entry in status["parts"].items()} == dict.fromkeys(parts, "ok")
    rows: dict[str, list[dict[str, Any]]] = {}
    for name in parts:
        record = json.loads((out / f"{name}.json").read_text())
        _check_header(record, name)
        assert record["smoke"] is True and "error" not in record and "suite.py" in record["command"]
        rows[name] = _jsonl(out / f"{name}.jsonl")
        measured = [r["row"] for r in rows[name][1:] if r["row"] not in ("text", "table", "cut")]
        assert rows[name][0]["row"] == "header" and measured == [r["row"] for r in record["rows"]]  # as measured
        report = (out / f"{name}.md").read_text()
        assert record["commit"][:12] in report and record["device"] in report and "Command: `" in report
        if name != "gpu-tests":  # every part times one short run at each size before sizing itself
            assert any(r["row"] == "calibration" and r["step_s"] > 0 for r in rows[name]), name
            assert record["sizes"], name
    # the summary is printed last, and one archive holds every file
    assert done.stdout.rstrip().endswith((out / "summary.md").read_text().rstrip())
    with tarfile.open(out / "suite-results.tar.gz") as tar:
        archived = {Path(n).name for n in tar.getnames()}
    assert archived == {p.name for p in out.iterdir()} - {"suite-results.tar.gz"}
    assert "skipped" in (out / "gpu-tests.log").read_text()  # no GPU here: the gpu tests ran and skipped

    def kind(name: str, row: str) -> list[dict[str, Any]]:
        return [r for r in rows[name] if r["row"] == row]

    # the figures each part promises are there (tiny and meaningless on a CPU, but computed)
    attention = kind("attention", "median")
    assert {(r["seq_len"], r["setting"]) for r in attention} == {
        (s, k) for s in (32, 64) for k in ("eager", "sdpa_untouched", "swap_sdpa")
    }  # no flash-attn here: no duplicate row, and a note saying why
    assert all("flash" in r["flash_note"] for r in kind("attention", "flash_note"))
    assert {r["setting"] for r in kind("optimizers", "median")} == {
        "adamw",
        "adamw_fused",
        "adamw8bit",
        "paged_adamw8bit",
    }
    assert {(r["precision"], r["batch_size"]) for r in kind("planner", "peak")} == {
        (p, b) for p in ("bf16-mixed", "32-true") for b in (1, 2, 4)
    }
    # dynamic-batch: sized from the (simulated) device: 17 samples fit in the target, the effective batch is ~4x that
    sizes = json.loads((out / "dynamic-batch.json").read_text())["sizes"]
    assert (sizes["fits_in_one_micro_batch"], sizes["effective_batch"]) == (17, 64)
    runs = {r["row"]: r for r in rows["dynamic-batch"] if "effective_batch" in r and r["row"] != "sweep"}
    assert set(runs) == {"dynamic", "fixed", "best_fixed", "finder", "doubling_dynamic", "doubling_finder_kept"}
    assert {r["effective_batch"] for r in runs.values()} == {64}
    assert runs["fixed"]["micro_batch"] == 8 and runs["dynamic"]["steps_done"] == sizes["steps"]
    sweep = kind("dynamic-batch", "sweep")
    assert [r["micro_batch"] for r in sweep] == [8, 16, 32] and sweep[-1]["oom_at_step"] == 1  # 32 > what fits
    varlen = {r["mode"]: r for r in kind("varlen", "run")}
    assert set(varlen) == {"fixed", "grouped", "dynamic"}
    assert len({r["real_tokens"] for r in varlen.values()}) == 1  # the same samples in every run
    # grouping by length pads less than the user's batches, and the token budget's trimmed micro-batches less still
    assert varlen["dynamic"]["padding_frac"] < varlen["grouped"]["padding_frac"] < varlen["fixed"]["padding_frac"]
    # loss: the swap ran on the same batches from the same weights and gave the unswapped losses; liger said why not
    loss = {r["setting"]: r for r in kind("loss", "run")}
    assert set(loss) == {"none", "chunked"} and loss["chunked"]["loss_gap"] < 1e-4
    assert "needs CUDA and liger-kernel" in kind("loss", "skipped")[0]["reason"]
    # pack: its prior was measured with the batch made on `meta`, another device than the planner's (guards the
    # callable-batch device defect of measure_memory), and all three configurations ran
    assert {r["kind"] for r in kind("pack", "median")} == {"plain", "hand_tuned", "lightning_tune"}


def test_a_part_stopped_by_the_budget_keeps_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each optimizer step of a calibration run takes one second on the suite's clock (nothing else takes any): the
    planner's first run (a warm-up step and 3 steps) calibrates 1 s a step + 1 s of start-up, so with 13 s for the
    part (18 s less 5 s kept for the archive) the second batch size (twice the first: 8 s) runs, and the third (16 s,
    9 s left) is cut, with the reason; the rows measured before it are kept."""
    suite = _suite()
    import _results

    clock = [0.0]
    hook = _results.StepTimes._hook

    def one_second_a_step(self: Any, *args: Any) -> None:
        clock[0] += 1.0
        hook(self, *args)

    monkeypatch.setattr(_results, "now", lambda: clock[0])
    monkeypatch.setattr(_results.StepTimes, "_hook", one_second_a_step)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    threads = torch.get_num_threads()
    try:
        assert suite.main(["--smoke", "--out", str(tmp_path), "--only", "planner", "--budget-s", "18"]) == 0
    finally:
        torch.set_num_threads(threads)
    entry = json.loads((tmp_path / "suite.json").read_text())["parts"]["planner"]
    assert entry["status"] == "cut" and entry["rows"] == 3  # the calibration run's row and the next one
    assert entry["cut"] == [
        {"what": "bf16-mixed, batch 4", "reason": "needs about 16.0 s, 9.0 s of the part's share left"}
    ]
    kept = [r for r in _jsonl(tmp_path / "planner.jsonl") if r["row"] in ("calibration", "peak", "cut")]
    assert [(r["row"], r.get("batch_size")) for r in kept] == [
        ("calibration", None),
        ("peak", 1),
        ("peak", 2),
        ("cut", None),
    ]
    assert kept[0]["step_s"] == 1.0 and kept[0]["overhead_s"] == 1.0
    report = (tmp_path / "planner.md").read_text()
    assert report.count("| bf16-mixed |") == 2 and "cut by the time budget: bf16-mixed, batch 4" in report
    assert "| planner | cut |" in (tmp_path / "summary.md").read_text()


def test_a_failing_part_keeps_its_rows_and_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    suite = _suite()

    def good(rows: Any, *, smoke: bool) -> str:
        rows.add("value", {"value": 1})
        return "one row"

    def bad(rows: Any, *, smoke: bool) -> str:
        rows.add("value", {"value": 2})
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
        ("optimizers", "ok"),
        ("attention", "error"),
    ]
    failed = json.loads((tmp_path / "attention.json").read_text())
    _check_header(failed, "attention")
    assert "the device fell over" in failed["error"]
    assert [r["value"] for r in failed["rows"]] == [2]  # the row measured before the failure is kept
    assert "the device fell over" in (tmp_path / "attention.md").read_text()
    assert json.loads((tmp_path / "optimizers.json").read_text())["rows"][0]["value"] == 1


def test_shares_and_plan() -> None:
    suite = _suite()
    from _results import Cost, plan

    shares = suite.shares(100.0, ["attention", "planner"])  # weights 0.09 and 0.08
    assert shares == pytest.approx({"attention": 100 * 0.09 / 0.17, "planner": 100 * 0.08 / 0.17})
    costs = [Cost(1.0, 0.5), Cost(1.0, 0.5)]
    assert plan(10.0, costs, lo=2, hi=100, max_rounds=3) == (8, 1)  # 2 s of start-up, 8 steps of 1 s
    assert plan(10.0, costs, lo=2, hi=3, max_rounds=3) == (3, 2)  # steps capped: the rest goes to rounds
    assert plan(1.0, costs, lo=2, hi=3, max_rounds=3) == (2, 1)  # never below lo: the rows will say they were cut


@pytest.mark.parametrize(
    ("only", "parts"),
    [
        pytest.param("pack,monitor", ["pack", "monitor"], id="parts-in-priority-order"),
        pytest.param(
            None,
            ["gpu-tests", "pack", "dynamic-batch", "varlen", "loss", "monitor", "optimizers", "attention", "planner"],
            id="all",
        ),  # fmt: skip
    ],
)
def test_only_selects_parts(only: str | None, parts: list[str]) -> None:
    assert _suite()._select(only) == parts


def test_only_and_budget_reject_bad_values_in_one_line() -> None:
    for args, message in (
        (["--only", "monitor,flops"], "`--only` must name parts from"),
        (["--budget-s", "3"], "`--budget-s` must be more than 5, got 3"),
    ):
        done = subprocess.run([sys.executable, str(SUITE), "--out", "unused", *args], capture_output=True, text=True)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr and message in done.stderr


def _git(cwd: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
def test_the_commit_is_the_projects_own_whatever_repository_holds_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _suite()
    import _results

    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    (other / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    _git(other, "add", "pyproject.toml")
    _git(other, "commit", "-q", "-m", "other")
    monkeypatch.chdir(other)
    # run from inside another checkout, the project's files still name the project's commit
    assert _results.git_commit().split("+")[0] == _git(ROOT, "rev-parse", "HEAD")
    # an exported copy of the project (`git archive`) placed inside that other checkout names no commit rather than
    # the other checkout's
    export = other / "export"
    (export / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", export / "pyproject.toml")
    shutil.copy(ROOT / "benchmarks" / "_results.py", export / "benchmarks" / "_results.py")
    assert _load(export / "benchmarks" / "_results.py", "exported_results").git_commit() == "unknown"


def test_the_source_is_identified_by_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _suite()
    import _results

    package = tmp_path / "lightning_tune"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (package / "sub" / "a.py").write_text("y = 2\n")
    monkeypatch.setattr(lightning_tune, "__file__", str(package / "__init__.py"))
    first = _results.source_digest()
    assert first.startswith("sha256:") and first.endswith("of 2 files")
    assert _results.source_digest() == first  # the same files, the same digest
    (package / "sub" / "a.py").write_text("y = 3\n")
    assert _results.source_digest() != first  # one changed byte, another source


def _fake_bitsandbytes(path: Path) -> Path:
    """A wheel laid out as bitsandbytes 0.50's: a CPU library and one per CUDA and ROCm build, RECORD listing all."""
    wheel = path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    names = ["bitsandbytes/__init__.py", "bitsandbytes/libbitsandbytes_cpu.so"]
    names += [f"bitsandbytes/libbitsandbytes_cuda{v}.so" for v in (118, 128, 130, 132)]
    names += ["bitsandbytes/libbitsandbytes_rocm64.so", "bitsandbytes-0.50.2.dist-info/METADATA"]
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in names:
            archive.writestr(name, name.encode() * 100)
        archive.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "\n".join(f"{n},," for n in names) + "\n")
    return wheel


@pytest.mark.parametrize(
    ("cuda", "kept"),
    [
        pytest.param("13.0", ["cpu", "cuda130"], id="one-version"),
        pytest.param("13", ["cpu", "cuda130", "cuda132"], id="one-major"),
    ],
)
def test_bitsandbytes_wheel_is_cut_to_one_cuda_version(tmp_path: Path, cuda: str, kept: list[str]) -> None:
    wheels = _load(ROOT / "benchmarks" / "_wheels.py", "wheels")
    wheel = wheels.cut_cuda_libraries(_fake_bitsandbytes(tmp_path), cuda)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        libraries = sorted(n.split("libbitsandbytes_")[1][:-3] for n in names if "libbitsandbytes_" in n)
        assert libraries == kept
        record = archive.read("bitsandbytes-0.50.2.dist-info/RECORD").decode().splitlines()
        # RECORD lists exactly what is left, each file with its own sha256 and size (what pip checks on install)
        for line in record[:-1]:
            name, digest, size = line.split(",")
            data = archive.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data)
        assert sorted(line.split(",")[0] for line in record) == sorted(names)
    with pytest.raises(ValueError, match="no CUDA 12.4 library"):
        wheels.cut_cuda_libraries(_fake_bitsandbytes(tmp_path), "12.4")


def test_a_split_wheel_is_joined_only_when_whole(tmp_path: Path) -> None:
    wheels = _load(ROOT / "benchmarks" / "_wheels.py", "wheels")
    folder = tmp_path / "fetched"
    folder.mkdir()
    content = bytes(range(256)) * (10 * 1024 + 3)  # 2.5 MiB and a bit: three pieces of at most 1 MiB
    wheel = folder / "big-1.0-py3-none-any.whl"
    wheel.write_bytes(content)
    (folder / "small-1.0-py3-none-any.whl").write_bytes(b"small")
    pieces = wheels.split(wheel, 1)
    assert [p.name for p in pieces] == [f"big-1.0-py3-none-any.whl.part.0{i}" for i in range(3)] and not wheel.exists()
    # the files travel in groups that each fit one transfer, and are joined from all of them
    groups = wheels.transfers(sorted(folder.iterdir()), limit_mib=2)
    assert all(sum(p.stat().st_size for p in g) <= 2 << 20 for g in groups) and len(groups) == 2
    files = {p.name: p for p in folder.iterdir()}
    joined, missing = wheels.join(files, tmp_path)
    assert missing == [] and [p.read_bytes() for p in joined] == [content]
    del files[pieces[1].name]  # the second transfer did not arrive
    joined, missing = wheels.join(files, tmp_path)
    assert joined == [] and missing == ["big-1.0-py3-none-any.whl: 1 of 3 pieces absent"]
    pieces[1].write_bytes(b"not the piece")
    joined, missing = wheels.join({p.name: p for p in folder.iterdir()}, tmp_path)
    assert joined == [] and missing == ["big-1.0-py3-none-any.whl: the joined pieces do not match its sha256"]
