"""What every benchmark writes: the run's header (device, date, commit, command, versions), and ``<out>.json`` plus
``<out>.md`` side by side, each flushed to disk before the next figure is taken."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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


#: the environment variable that names the commit of an exported tree (``git archive``), when no checkout can
COMMIT_ENV = "LIGHTNING_TUNE_COMMIT"


def git_commit() -> str:
    """This project's checked-out commit (``+dirty`` when its tree has changes). Outside a git checkout of this project
    (an exported tree, whatever repository holds the current directory): the commit named by the environment variable
    ``LIGHTNING_TUNE_COMMIT``, else by a ``COMMIT`` file at the tree's root (``git rev-parse HEAD > COMMIT`` beside
    ``git archive``), else ``"unknown"``."""
    root = _project_root()
    if root is None:
        named = os.environ.get(COMMIT_ENV, "").strip()
        file = HERE.parent / "COMMIT"
        if not named and file.is_file():
            named = file.read_text().strip()
        return named or "unknown"
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


class StandInClock:
    """A clock that moves only when told: the rehearsal's, and the tests'."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


_clock: Callable[[], float] = time.perf_counter


def now() -> float:
    """The clock every budget reads: the real one, or a stand-in set by :func:`use_clock`."""
    return _clock()


def use_clock(clock: Callable[[], float]) -> None:
    """Read ``clock`` from now on (``time.perf_counter`` is the real one)."""
    global _clock
    _clock = clock


#: how the plan of a row reads: the row a goal's ratio is taken against, the scenario the part exists for, and the rest
BASELINE, SCENARIO, EXTRA = "baseline", "scenario", "extra"
ROLES = (BASELINE, SCENARIO, EXTRA)
#: planned seconds are multiplied by this before a plan is fitted into a share
MARGIN = 1.15
#: how far past its share a row may run before the watchdog stops it
GRACE_S = 5.0


@dataclass
class Row:
    """One row a part means to measure: ``seconds`` is what it is expected to take, its warm-up steps, searches and
    compile included; ``run`` measures it (and writes its line) and returns its result."""

    name: str
    seconds: float
    run: Callable[[], Any]
    role: str = EXTRA


class RowOverrun(Exception):
    """Raised inside a row that ran past its share plus :data:`GRACE_S`."""


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

    def step_s(self) -> float | None:
        """The median gap between two optimizer steps (``None`` before the second step)."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return statistics.median(gaps) if gaps else None


class Watchdog(StepTimes):
    """Stops what runs inside ``with`` once it passes ``deadline``: at the first optimizer step that ends after it
    (any torch optimizer, in a Trainer or not: the stand-in clock sees it too), and, on the real clock in the main
    thread, by an alarm :data:`GRACE_S` later for code that takes no optimizer step (a compile, a search's set-up).
    Either raises :class:`RowOverrun`; the steps timed so far stay in :attr:`times`."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline
        self._alarm = _clock is time.perf_counter and threading.current_thread() is threading.main_thread()

    def _hook(self, *args: Any) -> None:
        super()._hook(*args)
        if self.times[-1] > self.deadline:
            raise RowOverrun(f"past its deadline after {len(self.times)} optimizer steps")

    def _ring(self, *args: Any) -> None:
        raise RowOverrun(f"past its deadline by {GRACE_S:.0f} s, after {len(self.times)} optimizer steps")

    def __enter__(self) -> Watchdog:
        super().__enter__()
        if self._alarm:
            self._previous = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, max(self.deadline - now(), 0.0) + GRACE_S)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
        super().__exit__(*exc)


class Cost:
    """What one run costs: seconds before its first step ends (start-up, first-step warm-up), then per step."""

    def __init__(self, overhead: float, step: float) -> None:
        self.overhead, self.step = overhead, step

    def __call__(self, steps: int) -> float:
        return self.overhead + self.step * steps

    def __repr__(self) -> str:
        return f"Cost({self.overhead:.3f} s + {self.step:.4f} s/step)"


#: activation bytes per token, layer and unit of width of a transformer step under bf16 autocast: the H200 run's
#: (dynamic-batch, d_model 1024, 12 layers, sequence 1024: (73,496 - 6,560) MiB over 120 more samples)
ACTIVATION_BYTES = 47.6
#: bytes per token and vocabulary entry: bf16 logits, their fp32 copy for the loss and its gradient
LOGIT_BYTES = 10.0


@dataclass(frozen=True)
class Work:
    """What one run does, for pricing it without running it: per optimizer step its FLOPs (forward and backward), its
    micro-batches and the parameters the optimizer updates; the memory of one micro-batch of ``micro`` samples."""

    flops: float
    params: int
    micro_batches: int = 1
    precision: str = "bf16"
    fixed_bytes: float = 0.0
    bytes_per_sample: float = 0.0
    micro: int = 1


def transformer_work(
    *, params: int, layers: int, width: int, seq: int, vocab: int, samples: int, micro: int, fp32: bool = False
) -> Work:
    """A decoder's optimizer step of ``samples`` sequences of ``seq`` tokens in micro-batches of ``micro``: 6 FLOPs per
    parameter and token plus causal attention; weights, gradients and AdamW state in fp32 plus 1 GiB of workspace;
    activations of :data:`ACTIVATION_BYTES` and logits of :data:`LOGIT_BYTES` per token (twice in fp32)."""
    flops = samples * (6.0 * params * seq + 6.0 * layers * seq * seq * width)
    per_sample = seq * (layers * width * ACTIVATION_BYTES + vocab * LOGIT_BYTES) * (2 if fp32 else 1)
    return Work(flops, params, -(-samples // micro), "fp32" if fp32 else "bf16", 16.0 * params + (1 << 30),
                per_sample, micro)  # fmt: skip


@dataclass(frozen=True)
class Device:
    """A GPU as a rehearsal prices it (see :data:`DEVICES` for where each figure comes from)."""

    name: str
    memory_bytes: int
    bf16_flops: float  # sustained training FLOP/s under bf16 autocast
    fp32_flops: float
    micro_batch_s: float  # the least one micro-batch and its step take (launch-bound)
    optimizer_s_per_param: float
    start_s: float  # a run's start-up and first step: start_s + start_s_per_param x parameters
    start_s_per_param: float
    gpu_tests_s: float
    import_s: float

    def cost(self, work: Work) -> Cost:
        rate = self.bf16_flops if work.precision == "bf16" else self.fp32_flops
        step = max(work.flops / rate, work.micro_batches * self.micro_batch_s)
        return Cost(
            self.start_s + work.params * self.start_s_per_param, step + work.params * self.optimizer_s_per_param
        )

    def peak_bytes(self, work: Work) -> float:
        return work.fixed_bytes + work.bytes_per_sample * work.micro

    def memory(self, work: Work) -> Any:
        """A ``SimulatedMemory`` of this device holding ``work``'s fixed memory, at its bytes per sample."""
        import lightning_tune as lt

        return lt.SimulatedMemory(self.memory_bytes, int(work.fixed_bytes), max(1, int(work.bytes_per_sample)))


_H200 = Device(
    name="NVIDIA H200",
    memory_bytes=143_771 << 20,
    bf16_flops=380e12,  # dynamic-batch: 376.5 samples/s x 1.01 TFLOP a sample (d_model 1024, 12 layers, seq 1024)
    fp32_flops=380e12 / 8,  # not measured: fp32 steps taken as 8x the bf16 ones
    micro_batch_s=6.9e-3,  # monitor: 6.9 ms a step of a model too small to count
    optimizer_s_per_param=6.2e-11,  # optimizers: AdamW's 29.9 ms step less its FLOPs at bf16_flops, 151.8 M params
    start_s=0.2,  # monitor: (35 s - 21 runs x 200 steps x 7.2 ms) over 24 runs
    start_s_per_param=1.2e-8,  # optimizers: about 2 s a run of 151.8 M parameters beyond its steps
    gpu_tests_s=52.3,  # gpu-tests: 52.3 s
    import_s=10.0,  # not measured: torch, Lightning and transformers imported cold
)
#: The devices a rehearsal prices. The H200's figures are the 2026-11-26 run's (benchmarks/results/h200-2026-11-26).
#: The H100 (SXM, 80 GB) has the H200's dense bf16 peak and 3.35 of its 4.8 TB/s of memory bandwidth: every step
#: on it is priced 4.8 / 3.35 = 1.43x the H200's (as if every step were bound by memory: the pessimistic end), start-up
#: and host work the same, and 81,559 MiB of memory.
DEVICES = {
    "H200": _H200,
    "H100": Device(
        **{
            **_H200.__dict__,
            "name": "NVIDIA H100 80GB HBM3",
            "memory_bytes": 81_559 << 20,
            "bf16_flops": _H200.bf16_flops / 1.43,
            "fp32_flops": _H200.fp32_flops / 1.43,
            "micro_batch_s": _H200.micro_batch_s * 1.43,
            "optimizer_s_per_param": _H200.optimizer_s_per_param * 1.43,
            "gpu_tests_s": _H200.gpu_tests_s * 1.43,
        }
    ),
}


class Rows:
    """One part's figures, each row appended to ``<stem>.jsonl`` and to the table in ``<stem>.md`` as soon as it is
    measured, so that a part stopped between rows (or a process killed) keeps every row already taken.

    ``deadline`` is when the part's share of the budget ends and ``hard_deadline`` when the whole run's does (on
    :func:`now`'s clock). :meth:`run_plan` fits a part's rows into its share before it starts and runs each under a
    :class:`Watchdog`. With ``device`` (a rehearsal) nothing is trained: calibrations and rows are priced on that
    device and move the stand-in clock by what they would take.
    """

    def __init__(
        self,
        stem: Path,
        header: dict[str, Any],
        title: str,
        *,
        deadline: float = float("inf"),
        hard_deadline: float = float("inf"),
        device: Device | None = None,
    ) -> None:
        self.stem, self.header, self.deadline, self.device = stem, header, deadline, device
        self.hard_deadline = max(hard_deadline, deadline)
        self.rows: list[dict[str, Any]] = []
        self.cuts: list[dict[str, Any]] = []
        self.sizes: dict[str, Any] = {}
        self.plan: list[dict[str, Any]] = []
        self.done: list[str] = []  # the planned rows that ran to their end (or were rehearsed)
        self.row_deadline = self.deadline + GRACE_S
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

    def cut(self, what: str, reason: str, **measured: Any) -> None:
        """Record ``what`` as cut by the time budget, with the reason and what it measured before it was stopped."""
        cut = {"what": what, "reason": reason, **measured}
        self.cuts.append(cut)
        self._append({"row": "cut", **cut}, None)
        with self.stem.with_suffix(".md").open("a") as md:
            md.write(f"\nNot measured, cut by the time budget: {what} ({reason}).\n")

    def fits(self, seconds: float, what: str) -> bool:
        """Whether a row expected to take ``seconds`` ends before the deadline; if not it is recorded as cut."""
        left = self.left()
        if seconds <= left:
            return True
        self.cut(what, f"needs about {seconds:.1f} s, {max(left, 0.0):.1f} s of the part's share left")
        return False

    def calibrate(
        self,
        what: str,
        run: Callable[[int], Any],
        steps: int = 3,
        *,
        work: Work | None = None,
        like: Callable[[float, int], Any] | None = None,
        **size: Any,
    ) -> tuple[Cost, Any]:
        """Time ``run(steps)`` (one short run at one size) and write its calibration row: the steady step time is the
        median gap between optimizer steps, the rest of the wall time is per-run overhead. It runs under a watchdog
        at the part's deadline. In a rehearsal ``work`` is priced instead, and the result is ``like(peak bytes,
        device memory)`` (``{}`` without ``like``)."""
        start = now()
        if self.device is not None:
            cost = self.device.cost(work or Work(0.0, 0))
            _clock.advance(cost(steps))  # type: ignore[attr-defined]
            result = like(self.device.peak_bytes(work), self.device.memory_bytes) if like and work else {}
            counted = steps
        else:
            with Watchdog(self.deadline + GRACE_S) as clock:
                result = run(steps)
            counted = len(clock.times)
            step = clock.step_s() or (now() - start) / max(steps, 1)
            cost = Cost(max(now() - start - step * max(counted - 1, 0), 0.0), step)
        rows = {"what": what, **size, "steps": counted, "seconds": now() - start}
        self.add("calibration", {**rows, "step_s": cost.step, "overhead_s": cost.overhead})
        return cost, result

    def run_plan(self, plan: list[Row]) -> dict[str, Any]:
        """Run ``plan``'s rows, baselines first, then scenarios, then extras, each under a :class:`Watchdog`; return
        their results by name.

        Before anything runs, the plan is fitted into what is left of the share (seconds x :data:`MARGIN`): extra rows
        are dropped from the last, then scenario rows from the last, never a baseline; the plan and what it dropped
        are written first. A row is stopped once it passes its deadline (the share less what the rows after it
        need, but never before its own seconds, a baseline's at the latest when the whole run's budget ends, plus
        :data:`GRACE_S`), and is recorded as cut with the optimizer steps it took and their median time.
        """
        order = sorted(plan, key=lambda r: ROLES.index(r.role))  # stable: in the order given within a role
        kept, left = list(order), self.left()

        def fit(rows: list[Row]) -> bool:
            return sum(r.seconds for r in rows) * MARGIN <= left

        for row in reversed(order):  # the least important first: extras from the last, then scenarios
            if not fit(kept) and row.role != BASELINE:
                kept.remove(row)
        for row in order:  # a dropped row that fits in what the drops left is taken back, the most important first
            if row not in kept and fit([*kept, row]):
                kept.append(row)
        kept.sort(key=order.index)
        self.table("Planned row", "role", "seconds", "plan")
        for row in order:
            entry = {"what": row.name, "role": row.role, "seconds": round(row.seconds, 1), "kept": row in kept}
            self.plan.append(entry)
            self._append({"row": "plan", **entry}, f"| {row.name} | {row.role} | {row.seconds:.1f} | "
                         f"{'run' if row in kept else 'dropped'} |")  # fmt: skip
        if len(kept) < len(order):
            total = sum(r.seconds for r in order) * MARGIN
            self.text(f"The share ({left:.0f} s) cannot hold every row ({total:.0f} s with a {MARGIN - 1:.0%} margin): "
                      "the rows marked dropped are not run.")  # fmt: skip
        for row in order:
            if row not in kept:
                self.cut(row.name, f"dropped by the plan ({row.role}, about {row.seconds:.0f} s)")
        results: dict[str, Any] = {}
        for index, row in enumerate(kept):
            later = sum(r.seconds for r in kept[index + 1 :])
            end = self.hard_deadline if row.role == BASELINE else self.deadline
            if now() + row.seconds > end:
                self.cut(row.name, f"needs about {row.seconds:.1f} s, {max(end - now(), 0.0):.1f} s left")
                continue
            self.row_deadline = min(max(self.deadline - later, now() + row.seconds), end) + GRACE_S
            if self.device is not None:
                _clock.advance(row.seconds)  # type: ignore[attr-defined]
                self.done.append(row.name)
                continue
            start = now()
            dog = Watchdog(self.row_deadline)
            try:
                with dog:
                    results[row.name] = row.run()
                self.done.append(row.name)
            except RowOverrun as stop:
                self.cut(row.name, f"stopped by the watchdog: {stop}", seconds=now() - start,
                         steps_done=len(dog.times), step_s=dog.step_s())  # fmt: skip
        self.row_deadline = self.deadline + GRACE_S
        return results


def plan(seconds: float, costs: list[Cost], *, lo: int, hi: int, max_rounds: int = 1) -> tuple[int, int]:
    """Steps per run (``lo``..``hi``) and rounds (1..``max_rounds``) so that every run of ``costs``, once per round,
    fits in ``seconds``: steps grow first, then rounds."""
    overhead, per_step = sum(c.overhead for c in costs), sum(c.step for c in costs)
    steps = int((seconds - overhead) / per_step) if per_step > 0 else hi
    steps = min(max(steps, lo), hi)
    one_round = overhead + per_step * steps
    rounds = min(max(int(seconds // one_round) if one_round > 0 else max_rounds, 1), max_rounds)
    return steps, rounds
