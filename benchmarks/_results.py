"""What every benchmark writes: the run's header (device, date, commit, command, versions), and ``<out>.json`` plus
``<out>.md`` side by side, each flushed to disk before the next figure is taken."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_tune.bench.files import write_atomically

#: Header fields every result file carries (checked by the suite's smoke test).
HEADER_FIELDS = ("benchmark", "device", "date", "commit", "source", "command", "torch", "lightning_tune", "versions")

HERE = Path(__file__).resolve().parent

#: Trainer arguments of every timed run: it writes nothing of its own (no logs, checkpoints, progress bar or summary).
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}

# distributions whose versions change the figures; a missing one is recorded as "not installed"
_DISTRIBUTIONS = ("torch", "lightning", "transformers", "bitsandbytes", "flash-attn", "flash-attn-4", "triton")


def _project_root() -> Path | None:
    """The git checkout holding this file, when that checkout is this project (its ``pyproject.toml`` names
    lightning-tune); ``None`` otherwise (an exported copy sitting inside some other checkout, or no git at all)."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    pyproject = Path(top) / "pyproject.toml"
    try:
        named = re.search(r'^name\s*=\s*"lightning-tune"\s*$', pyproject.read_text(), re.MULTILINE) is not None
    except OSError:
        return None
    return Path(top) if named and (Path(top) / "benchmarks").resolve() == HERE else None


def git_commit() -> str:
    """This project's checked-out commit (``+dirty`` when its tree has changes), or ``"unknown"`` when the benchmarks
    do not sit in a git checkout of this project, whatever repository holds the current directory."""
    root = _project_root()
    if root is None:
        return "unknown"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    return (commit or "unknown") + ("+dirty" if commit and dirty else "")


def source_digest() -> str:
    """What identifies the imported package's code, installed or not: ``sha256:`` of its ``.py`` files (relative
    names and contents, in name order), first 16 hex digits, with the number of files."""
    import lightning_tune

    package = Path(lightning_tune.__file__).resolve().parent
    digest = hashlib.sha256()
    files = sorted(package.rglob("*.py"))
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"sha256:{digest.hexdigest()[:16]} of {len(files)} files"


def versions() -> dict[str, str]:
    """Python, CUDA and the versions of the packages that shape the figures."""
    import torch

    import lightning_tune

    found = {"python": platform.python_version(), "lightning_tune": lightning_tune.__version__}
    for name in _DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["cuda"] = str(torch.version.cuda) if torch.version.cuda else "none"
    return found


def device_name() -> str:
    """The CUDA device's name, or the CPU with its thread count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_header(benchmark: str, device: str) -> dict[str, Any]:
    """The fields every result starts with: what ran, where, when, at which commit, by which command, with which
    versions."""
    import torch

    import lightning_tune

    return {
        "benchmark": benchmark,
        "device": device,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "source": source_digest(),
        "command": shlex.join(["python", *sys.argv]),
        "torch": torch.__version__,
        "lightning_tune": lightning_tune.__version__,
        "versions": versions(),
    }


def header_lines(record: dict[str, Any]) -> list[str]:
    """The Markdown lines that state the header of ``record``."""
    shown = ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v != "not installed")
    return [
        f"{record['device']}, {record['date']}, commit `{record['commit'][:12]}`, lightning_tune "
        f"{record['lightning_tune']} (source {record.get('source', 'not recorded')}).",
        "",
        f"Command: `{record['command']}`",
        "",
        f"Versions: {shown}.",
        "",
    ]


def write_results(out: Path | None, record: dict[str, Any], report: str) -> None:
    """Print the Markdown report and, when ``out`` is given, write ``<out>.json`` and ``<out>.md`` (each written to a
    temporary file, flushed, and renamed into place)."""
    print(report, flush=True)
    if out is None:
        return
    write_atomically(out.with_suffix(".json"), (json.dumps(record, indent=2, default=str) + "\n").encode())
    write_atomically(out.with_suffix(".md"), report.encode())


def now() -> float:
    """The clock every budget reads (one place, so a test can stand in for it)."""
    return time.perf_counter()


class Rows:
    """One part's figures, each row appended to ``<stem>.jsonl`` and to the table in ``<stem>.md`` as soon as it is
    measured, so that a part stopped between rows (or a process killed) keeps every row already taken.

    ``deadline`` is when the part's share of the budget ends (on :func:`now`'s clock): :meth:`fits` refuses a row
    whose expected seconds would pass it, and records the row as cut, with the reason, in :attr:`cuts`.
    """

    def __init__(self, stem: Path, header: dict[str, Any], title: str, *, deadline: float = float("inf")) -> None:
        self.stem, self.header, self.deadline = stem, header, deadline
        self.rows: list[dict[str, Any]] = []
        self.cuts: list[dict[str, Any]] = []
        self.sizes: dict[str, Any] = {}
        self._columns: list[str] | None = None
        stem.with_suffix(".jsonl").write_text(json.dumps({"row": "header", **header}, default=str) + "\n")
        stem.with_suffix(".md").write_text("\n".join([f"# {title} — {header['device']}", "", *header_lines(header)]))

    def left(self) -> float:
        """Seconds before the part's deadline."""
        return self.deadline - now()

    def _append(self, row: dict[str, Any], line: str | None) -> None:
        with self.stem.with_suffix(".jsonl").open("a") as jsonl:
            jsonl.write(json.dumps(row, default=str) + "\n")
        if line is not None:
            with self.stem.with_suffix(".md").open("a") as md:
                md.write(line + "\n")
        print(line if line is not None else json.dumps(row, default=str), flush=True)

    def text(self, text: str) -> None:
        """A paragraph of the report (a new table starts after it)."""
        self._columns = None
        self._append({"row": "text", "text": text}, "\n" + text + "\n")

    def table(self, *columns: str) -> None:
        """Start a table; the rows added next are its lines."""
        self._columns = list(columns)
        self._append(
            {"row": "table", "columns": self._columns},
            "\n".join(["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]),
        )

    def add(self, kind: str, data: dict[str, Any], cells: list[Any] | None = None) -> dict[str, Any]:
        """Record one measured row (and its line of the current table, when ``cells`` are given)."""
        row = {"row": kind, **data}
        self.rows.append(row)
        self._append(row, None if cells is None else "| " + " | ".join(str(c) for c in cells) + " |")
        return row

    def choose(self, **sizes: Any) -> None:
        """Record the sizes the part chose after calibrating."""
        self.sizes.update(sizes)
        self.text("Sizes chosen for this budget: " + ", ".join(f"{k} {v}" for k, v in sizes.items()) + ".")

    def fits(self, seconds: float, what: str) -> bool:
        """Whether a row expected to take ``seconds`` ends before the deadline; if not it is recorded as cut."""
        left = self.left()
        if seconds <= left:
            return True
        cut = {"what": what, "reason": f"needs about {seconds:.1f} s, {max(left, 0.0):.1f} s of the part's share left"}
        self.cuts.append(cut)
        self._append({"row": "cut", **cut}, None)
        with self.stem.with_suffix(".md").open("a") as md:
            md.write(f"\nNot measured, cut by the time budget: {what} ({cut['reason']}).\n")
        return False


class StepTimes:
    """The clock at the end of every optimizer step of any torch optimizer while inside ``with`` (a global post-step
    hook, the device synchronised first), whatever Trainer or loop takes the steps."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def _hook(self, *args: Any) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(now())

    def __enter__(self) -> StepTimes:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


class Cost:
    """What one run costs: seconds before its first step ends (start-up, first-step warm-up), then per step."""

    def __init__(self, overhead: float, step: float) -> None:
        self.overhead, self.step = overhead, step

    def __call__(self, steps: int) -> float:
        return self.overhead + self.step * steps

    def __repr__(self) -> str:
        return f"Cost({self.overhead:.3f} s + {self.step:.4f} s/step)"


def calibrate(rows: Rows, what: str, run: Any, steps: int = 3, **size: Any) -> tuple[Cost, Any]:
    """Time ``run(steps)`` (one short run at one size) and write its calibration row: the steady step time is the
    median gap between optimizer steps after the first, the rest of the wall time is per-run overhead."""
    start = now()
    with StepTimes() as clock:
        result = run(steps)
    total = now() - start
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    step = sorted(gaps)[len(gaps) // 2] if gaps else total / max(steps, 1)
    cost = Cost(max(total - step * max(len(clock.times) - 1, 0), 0.0), step)
    rows.add(
        "calibration",
        {
            "what": what,
            **size,
            "steps": len(clock.times),
            "seconds": total,
            "step_s": step,
            "overhead_s": cost.overhead,
        },
    )
    return cost, result


def plan(seconds: float, costs: list[Cost], *, lo: int, hi: int, max_rounds: int = 1) -> tuple[int, int]:
    """Steps per run (``lo``..``hi``) and rounds (1..``max_rounds``) so that every run of ``costs``, once per round,
    fits in ``seconds``: steps grow first, then rounds."""
    overhead, per_step = sum(c.overhead for c in costs), sum(c.step for c in costs)
    steps = int((seconds - overhead) / per_step) if per_step > 0 else hi
    steps = min(max(steps, lo), hi)
    one_round = overhead + per_step * steps
    rounds = min(max(int(seconds // one_round) if one_round > 0 else max_rounds, 1), max_rounds)
    return steps, rounds
