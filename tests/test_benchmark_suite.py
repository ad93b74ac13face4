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
    sys.modules[name] = module  # dataclasses look their module up there
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
        "eval",
    ]
    status = json.loads((out / "suite.json").read_text())
    assert {name: entry["status"] for name, entry in status["parts"].items()} == dict.fromkeys(parts, "ok")
    rows: dict[str, list[dict[str, Any]]] = {}
    for name in parts:
        record = json.loads((out / f"{name}.json").read_text())
        _check_header(record, name)
        assert record["smoke"] is True and "error" not in record and "suite.py" in record["command"]
        rows[name] = _jsonl(out / f"{name}.jsonl")
        measured = [r["row"] for r in rows[name][1:] if r["row"] not in ("text", "table", "cut", "plan")]
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
    # the GPU tests ran from the files that hold them, one line a test, and skipped here (no GPU)
    log = (out / "gpu-tests.log").read_text()
    assert log.count(" SKIPPED") >= 10 and "tests/perf/test_flops.py::" in log and " error" not in log.lower()
    assert rows["gpu-tests"][-1]["text"] == "Full output: `gpu-tests.log`."
    # every part wrote its plan before its first planned row ran, and at this budget kept every planned row
    for name in parts:
        kinds = [r["row"] for r in rows[name]]
        plan = json.loads((out / f"{name}.json").read_text())["plan"]
        assert plan and all(entry["kept"] for entry in plan), name
        before = ("header", "text", "table", "calibration", "skipped", "plan")
        assert kinds.index("plan") < min(i for i, k in enumerate(kinds) if k not in before), name

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
    assert set(varlen) == {"fixed", "grouped", "dynamic", "packed"}
    assert len({r["real_tokens"] for r in varlen.values()}) == 1  # the same samples in every run
    # grouping by length pads less than the user's batches, and the token budget's trimmed micro-batches less still
    assert varlen["dynamic"]["padding_frac"] < varlen["grouped"]["padding_frac"] < varlen["fixed"]["padding_frac"]
    assert varlen["packed"]["padding_frac"] == 0  # and packing none
    # loss: the swap ran on the same batches from the same weights and gave the unswapped losses; liger said why not
    loss = {r["setting"]: r for r in kind("loss", "run")}
    assert set(loss) == {"none", "chunked"} and loss["chunked"]["loss_gap"] < 1e-4
    assert "needs CUDA and liger-kernel" in kind("loss", "skipped")[0]["reason"]
    # eval: the loader's batch, the sweep's largest and DynamicBatchSize's sizing, each without and with the loss swap,
    # on a simulated device where 12 samples fit without the swap: the sweep met its out-of-memory error at 16, the
    # callback met none and chose larger batches than the loader's, larger still with the swap
    evals = {(r["setting"], r["loss_swap"]): r for r in kind("eval", "run")}
    assert set(evals) == {(s, w) for s in ("loader", "sweep", "dynamic") for w in (False, True)}
    assert evals[("sweep", False)]["batch"] == 8 and evals[("sweep", False)]["ooms"] == 1
    assert evals[("dynamic", False)]["ooms"] == evals[("dynamic", True)]["ooms"] == 0
    assert evals[("loader", False)]["batch"] < evals[("dynamic", False)]["batch"] < evals[("dynamic", True)]["batch"]
    assert all(r["peak_frac"] <= 0.9 for (setting, _), r in evals.items() if setting != "sweep")
    # pack: its prior was measured with the batch made on `meta`, another device than the planner's (guards the
    # callable-batch device defect of measure_memory), and all three configurations ran
    assert {r["kind"] for r in kind("pack", "median")} == {"plain", "hand_tuned", "lightning_tune"}


def _run_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: Any, budget: float) -> dict[str, Any]:
    """Run ``part`` as the suite's only part with ``budget`` seconds, on a stand-in clock; its entry in suite.json."""
    suite = _suite()
    import _results

    monkeypatch.setattr(_results, "_clock", _results.StandInClock())
    monkeypatch.setattr(suite, "RUNNERS", {"monitor": part})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    threads = torch.get_num_threads()
    try:
        suite.main(["--smoke", "--out", str(tmp_path), "--only", "monitor", "--budget-s", str(budget)])
    finally:
        torch.set_num_threads(threads)
    return json.loads((tmp_path / "suite.json").read_text())["parts"]["monitor"]


def test_a_plan_that_cannot_fit_drops_extras_then_scenarios_never_a_baseline_and_says_so_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 45 s budget leaves the only part 40 s: with a 15 % margin, 34.8 s of rows. The baseline (20 s) and the short
    scenario (10 s) fit; the long scenario (20 s) and the extra are dropped before anything runs, and the baseline,
    listed last, runs first."""
    _suite()
    from _results import BASELINE, EXTRA, SCENARIO, Row, now

    ran: list[tuple[str, float]] = []

    def part(rows: Any, *, smoke: bool) -> str:
        def row(name: str, seconds: float) -> Row:
            return Row(name, seconds, lambda: ran.append((name, now())) or rows.add("value", {"name": name}))

        plan = [row("long scenario", 20.0), row("extra", 5.0), row("short scenario", 10.0), row("baseline", 20.0)]
        for entry, role in zip(plan, (SCENARIO, EXTRA, SCENARIO, BASELINE), strict=True):
            entry.role = role
        rows.run_plan(plan)
        return "planned"

    entry = _run_part(tmp_path, monkeypatch, part, 45)
    assert [name for name, _ in ran] == ["baseline", "short scenario"]
    assert [c["what"] for c in entry["cut"]] == ["long scenario", "extra"]
    assert all(c["reason"].startswith("dropped by the plan") for c in entry["cut"])
    assert [(e["what"], e["role"], e["kept"]) for e in entry["plan"]] == [
        ("baseline", "baseline", True),
        ("long scenario", "scenario", False),
        ("short scenario", "scenario", True),
        ("extra", "extra", False),
    ]
    kinds = [r["row"] for r in _jsonl(tmp_path / "monitor.jsonl")]
    assert kinds.index("plan") < kinds.index("cut") < kinds.index("value")  # said before anything ran
    assert "cannot hold every row" in (tmp_path / "monitor.md").read_text()


def test_an_overrunning_row_is_stopped_within_its_share_and_keeps_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row planned at 10 s takes optimizer steps of 1 s each on the stand-in clock and never ends by itself: the
    watchdog stops it at its first step past the part's 40 s share plus the 5 s grace, and it is recorded as cut with
    the steps it took and their time; the row after it is not started."""
    _suite()
    from _results import BASELINE, SCENARIO, Row, StandInClock

    stopped_at: list[float] = []

    def part(rows: Any, *, smoke: bool) -> str:
        import _results

        clock = _results._clock
        assert isinstance(clock, StandInClock)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def forever() -> None:
            try:
                while True:
                    clock.advance(1.0)
                    optimizer.step()
            finally:
                stopped_at.append(clock())

        rows.run_plan([Row("forever", 10.0, forever, BASELINE), Row("after", 5.0, lambda: None, SCENARIO)])
        return "stopped"

    entry = _run_part(tmp_path, monkeypatch, part, 45)
    share = entry["share_s"]
    assert share == 40 and share < stopped_at[0] <= share + 10
    assert entry["status"] == "cut" and entry["ran"] == []
    forever, after = entry["cut"]
    assert forever["what"] == "forever" and "stopped by the watchdog" in forever["reason"]
    assert forever["steps_done"] == stopped_at[0] and forever["step_s"] == 1.0
    assert after["what"] == "after" and after["reason"].startswith("needs about 5.0 s")
    assert "| monitor | cut |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_rehearsal_on_an_h100_keeps_every_goal_row_at_420_s_and_every_baseline_at_300_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole suite planned on the CPU at H100 prices (nothing trained): at 420 s every baseline and scenario row
    of every part runs and the rehearsed run, imports included, ends within the budget; at 300 s every baseline still
    runs. The scenario rows named by the parts' goals are in the plans."""
    suite = _suite()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for budget, kept_roles in ((420, ("baseline", "scenario")), (300, ("baseline",))):
        out = tmp_path / str(budget)
        assert suite.main(["--rehearse", "H100", "--budget-s", str(budget), "--out", str(out)]) == 0
        status = json.loads((out / "suite.json").read_text())
        assert status["import_s"] == 10.0 and status["wall_s"] <= budget
        assert f"Wall time {status['wall_s']:.1f} s of the {budget} s budget" in (out / "summary.md").read_text()
        for name, entry in status["parts"].items():
            goal_rows = [e["what"] for e in entry["plan"] if e["role"] in kept_roles]
            assert goal_rows and set(goal_rows) <= set(entry["ran"]), (budget, name, entry["cut"])
        if budget == 420:
            plans = {name: {e["what"]: e["role"] for e in entry["plan"]} for name, entry in status["parts"].items()}
            assert plans["dynamic-batch"]["DynamicBatchSize, sequences doubling"] == "scenario"
            assert plans["dynamic-batch"]["BatchSizeFinder's pick kept, sequences doubling"] == "scenario"
            assert plans["dynamic-batch"]["fixed micro-batch 8"] == "baseline"
            assert plans["varlen"]['DynamicBatchSize (token budget, `loss_weight="tokens"`)'] == "scenario"
            assert plans["loss"]['swap_loss("chunked")'] == "scenario" and plans["loss"]["no swap (the model's logits)"]
            assert status["parts"]["loss"]["sizes"]["vocab"] == 128_256
            assert plans["pack"]["round 1: plain"] == "baseline" and plans["pack"]["round 1: lightning_tune"]
            assert plans["optimizers"]["optimizers, round 1: adamw"] == "baseline"
            assert plans["attention"]["2048, round 1: eager"] == "baseline"
            assert plans["eval"]["the loader's batch"] == "baseline"
            assert plans["eval"]["DynamicBatchSize, LossSwap(eval=True)"] == "scenario"
            assert plans["eval"]["largest fixed batch (sweep)"] == "scenario"


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
            [
                "gpu-tests",
                "pack",
                "dynamic-batch",
                "varlen",
                "loss",
                "monitor",
                "optimizers",
                "attention",
                "planner",
                "eval",
            ],
            id="all",
        ),  # fmt: skip
    ],
)
def test_only_selects_parts(only: str | None, parts: list[str]) -> None:
    assert _suite()._select(only) == parts


@pytest.mark.parametrize(("make", "name"), [("loss_swap", "LossSwap"), ("dynamic", "DynamicBatchSize")])
def test_the_eval_part_says_plainly_when_the_callbacks_lack_evaluation(
    make: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _suite()
    part = _load(ROOT / "benchmarks" / "eval.py", "eval_part")

    def older(*args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{name}.__init__() got an unexpected keyword argument")

    monkeypatch.setattr(part.lt, name, older)
    with pytest.raises(RuntimeError, match=rf"the eval part needs {name}\(.*=True\), which this version lacks"):
        getattr(part, make)(None) if make == "dynamic" else getattr(part, make)()


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
    exported = _load(export / "benchmarks" / "_results.py", "exported_results")
    assert exported.git_commit() == "unknown"
    # ... unless the commit is written beside the tree, or named in the environment (which wins)
    (export / "COMMIT").write_text("5d2ad385f3b95c05a6425e5e8a86d522f2986536\n")
    assert exported.git_commit() == "5d2ad385f3b95c05a6425e5e8a86d522f2986536"
    monkeypatch.setenv("LIGHTNING_TUNE_COMMIT", "abc1234")
    assert exported.git_commit() == "abc1234"


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


@pytest.mark.parametrize(
    ("source", "message"),
    [
        pytest.param("import not_a_module_here\n", "pytest exited 2", id="import-error-at-collection"),
        pytest.param("def test_on_the_cpu():\n    pass\n", "pytest exited 5", id="no-gpu-test-collected"),
    ],
)
def test_gpu_tests_that_collect_nothing_or_fail_to_import_are_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, message: str
) -> None:
    suite = _suite()
    test_file = tmp_path / "tests" / "test_marked.py"
    test_file.parent.mkdir()
    test_file.write_text(source)
    monkeypatch.setattr(suite, "gpu_test_files", lambda: [str(test_file)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    threads = torch.get_num_threads()
    try:
        assert suite.main(["--smoke", "--out", str(tmp_path / "out"), "--only", "gpu-tests"]) == 1
    finally:
        torch.set_num_threads(threads)
    entry = json.loads((tmp_path / "out" / "suite.json").read_text())["parts"]["gpu-tests"]
    assert entry["status"] == "error" and message in entry["error"]


def test_the_gpu_tests_are_the_files_that_hold_them() -> None:
    files = _suite().gpu_test_files()
    assert "tests/perf/test_flops.py" in files and "tests/swaps/test_plugin_gpu.py" in files
    assert "tests/upstream/test_accelerate_memory.py" not in files
    assert all("mark.gpu" in (ROOT / f).read_text() for f in files)


#: a meta path finder in a fresh interpreter, as if the optional packages were not installed: ``None`` in
#: ``sys.modules`` makes their import fail and ``find_spec`` say absent (peft requires accelerate: without accelerate
#: there is no peft either)
_WITHOUT_OPTIONAL = """
import sys
for name in ("accelerate", "peft", "liger_kernel", "flash_attn", "bitsandbytes"):
    sys.modules[name] = None
import pytest
sys.exit(pytest.main(["-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]))
"""


@pytest.mark.slow
def test_gpu_tests_collect_without_the_optional_packages() -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_OPTIONAL], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "error" not in done.stdout.splitlines()[-1] and " collected" in done.stdout.splitlines()[-1]


#: flash-attn-4 4.0.0b36's set as the package index serves it: each wheel's own Requires-Dist (trimmed of extras
#: that decide nothing here)
_FLASH_ATTN_4 = {
    "flash-attn-4": ["nvidia-cutlass-dsl>=4.6.2", "torch", "einops", "typing_extensions", "apache-tvm-ffi<0.2,>=0.1.11",
                     "torch-c-dlpack-ext", "quack-kernels>=0.5.3", 'nvidia-cutlass-dsl[cu13]>=4.6.2; extra == "cu13"',
                     'pytest; extra == "dev"'],
    "nvidia-cutlass-dsl": ["nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-cu12==4.8.1",
                           'nvidia-cutlass-dsl-libs-cu13==4.8.1; extra == "cu13"',
                           'nvidia-cutlass-dsl-libs-qnx-cu12==4.8.1; extra == "qnx"'],
    "nvidia-cutlass-dsl-libs-base": ["typing-extensions>=4.10.0", "cuda-bindings>=12.8", "protobuf>=4.21.12",
                                     'backports.strenum; python_version < "3.11"',
                                     "nvidia-cutlass-dsl-libs-core==4.8.1",
                                     'nvidia-cuda-nvdisasm<14,>=13.4.0rc1; extra == "sass"'],
    "nvidia-cutlass-dsl-libs-core": ["typing-extensions>=4.10.0", "cuda-bindings>=12.8", "protobuf>=4.21.12"],
    "quack-kernels": ["nvidia-cutlass-dsl>=4.7", "torch", "apache-tvm-ffi<0.2,>=0.1.6", "torch-c-dlpack-ext",
                      "einops", 'nvidia-cutlass-dsl[cu13]>=4.7; extra == "cu13"', 'jax; extra == "jax"'],
    "cuda-bindings": ["cuda-pathfinder>=1.4.2", 'cuda-toolkit==13.*; extra == "all"'],
}  # fmt: skip


def test_the_flash_attn_4_set_resolves_every_requirement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fetched for CUDA 13 and Python 3.12 (wheels made from the metadata above instead of downloaded): everything
    flash-attn-4 needs that a CUDA PyTorch install lacks, the library holding the ``cutlass`` package included; not
    the CUDA 12 or QNX libraries, nor what PyTorch brings."""
    wheels = _load(ROOT / "benchmarks" / "_wheels.py", "wheels")

    def download(requirement: str, dest: Path, python: str) -> Path:
        from packaging.requirements import Requirement

        name = wheels._normalise(Requirement(requirement).name)
        wheel = dest / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
        requires = "".join(f"Requires-Dist: {line}\n" for line in _FLASH_ATTN_4.get(name, []))
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n{requires}")
        return wheel

    monkeypatch.setattr(wheels, "_download", download)
    fetched = wheels.resolve(["flash-attn-4>=4.0.0b0"], tmp_path, python="3.12", cuda="13")
    assert sorted(w.name.split("-1.0-")[0].replace("_", "-") for w in fetched) == [
        "apache-tvm-ffi",
        "cuda-bindings",
        "cuda-pathfinder",
        "einops",
        "flash-attn-4",
        "nvidia-cutlass-dsl",
        "nvidia-cutlass-dsl-libs-base",
        "nvidia-cutlass-dsl-libs-core",
        "nvidia-cutlass-dsl-libs-cu13",
        "protobuf",
        "quack-kernels",
        "torch-c-dlpack-ext",
    ]


def test_install_says_installed_only_when_the_package_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flash-attn-4 whose ``flash_attn.cute`` is found but cannot import (its ``cutlass`` package missing, as when
    ``nvidia-cutlass-dsl-libs-core`` was left out) is reported unusable, with the import's error."""
    wheels = _load(ROOT / "benchmarks" / "_wheels.py", "wheels")
    package = tmp_path / "site" / "flash_attn" / "cute"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import cutlass.cute\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))  # found here and in a fresh interpreter
    monkeypatch.syspath_prepend(tmp_path / "site")
    monkeypatch.delitem(wheels.ENABLES, "bitsandbytes")
    wheels.install([tmp_path / "no-wheels-here"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("flash-attn-4:"))
    assert line.startswith("flash-attn-4: not usable (ModuleNotFoundError: No module named 'cutlass')")
