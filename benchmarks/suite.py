"""Every GPU figure of lightning_tune in one process, plus the GPU tests: ``python benchmarks/suite.py --out DIR``.

Parts (``--only NAME[,NAME]``, names or group names):

=================  ======  =============================================================================================
Part               Group   What it measures (script that holds its code)
=================  ======  =============================================================================================
``monitor``        1       no monitor / Lightning ThroughputMonitor / ThroughputLatencyMonitor, short steps
                           (``monitor_overhead.py``)
``attention``      1       eager / the model's own SDPA / ``AttentionSwap("sdpa")`` / flash-attn at 2048 and 4096, bf16
                           (``swaps.py``)
``optimizers``     1       AdamW / fused AdamW / AdamW8bit / PagedAdamW8bit: state bytes, step time, loss (``swaps.py``)
``planner``        1       ``estimate_memory`` / ``measure_memory`` against allocated and reserved peaks, three batch
                           sizes, two precisions (``planner_accuracy.py``)
``dynamic-batch``  2       DynamicBatchSize / fixed micro-batch 8 / BatchSizeFinder's pick at one exact effective
                           batch, and sequences doubling mid-run (``dynamic_batch.py``)
``pack``           2       plain Lightning / hand-tuned / lightning_tune on the ~125M demo GPT (``pack.py``)
``gpu-tests``      2       ``pytest -m gpu`` in a subprocess, its output saved
=================  ======  =============================================================================================

Each part writes ``DIR/<part>.json`` and ``DIR/<part>.md`` as soon as it finishes (device, date, commit, command,
versions, ``lightning_tune.__version__``); ``DIR/suite.json`` says which parts finished, failed or were running when
the process stopped. A part that raises is recorded (its files hold the error) and the next part runs.

``--smoke`` runs every part's code at tiny sizes on the CPU (CUDA hidden), in about a minute: the test suite runs it
so the suite cannot rot between GPU runs. Its figures say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: part -> group; the order is the order parts run in.
PARTS: dict[str, str] = {
    "monitor": "group1",
    "attention": "group1",
    "optimizers": "group1",
    "planner": "group1",
    "dynamic-batch": "group2",
    "pack": "group2",
    "gpu-tests": "group2",
}
GROUPS: dict[str, list[str]] = {
    group: [part for part, g in PARTS.items() if g == group] for group in dict.fromkeys(PARTS.values())
}

Report = tuple[dict[str, Any], str]


def _monitor(smoke: bool) -> Report:
    from monitor_overhead import measure

    from lightning_tune.demos import GPTConfig

    if smoke:
        config = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
        return measure(rounds=1, steps=4, warmup=1, batch_size=4, accelerator="cpu", config=config)
    # the demo GPT's default shape at batch 64: steps of a few milliseconds, where a per-step sync shows
    return measure(rounds=7, steps=200, warmup=20, batch_size=64)


def _attention(smoke: bool) -> Report:
    from swaps import attention

    if smoke:
        return attention(
            seq_lens=[32, 64], batch_tokens=128, d_model=32, n_layers=1, n_heads=2, steps=3, warmup=1, rounds=1,
            precision="32-true", accelerator="cpu",
        )  # fmt: skip
    # 8k tokens per batch at both lengths: eager attention's L² scores (fp32 softmax under autocast) take ~40 GB
    # at 4096; a row that does not fit says so
    return attention(
        seq_lens=[2048, 4096], batch_tokens=8192, d_model=1024, n_layers=8, n_heads=16, steps=15, warmup=5, rounds=3
    )


def _optimizers(smoke: bool) -> Report:
    from swaps import optimizers

    from lightning_tune.demos import GPTConfig

    if smoke:
        config = GPTConfig(seq_len=16, d_model=64, n_layers=1, n_heads=2)
        return optimizers(
            config=config, batch_size=4, steps=3, warmup=1, rounds=1, precision="32-true", accelerator="cpu"
        )
    config = GPTConfig(seq_len=512, d_model=1024, n_layers=12, n_heads=16)
    return optimizers(config=config, batch_size=16, steps=60, warmup=10, rounds=2)


def _planner(smoke: bool) -> Report:
    from planner_accuracy import accuracy

    from lightning_tune.demos import GPTConfig

    if smoke:
        config = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
        return accuracy(
            config=config, batch_sizes=[1, 2, 4], precisions=["bf16-mixed", "32-true"], steps=1, device="cpu"
        )
    config = GPTConfig(seq_len=1024, d_model=1024, n_layers=12, n_heads=16)
    return accuracy(config=config, batch_sizes=[8, 16, 32], precisions=["bf16-mixed", "32-true"], steps=3)


def _dynamic_batch(smoke: bool) -> Report:
    from dynamic_batch import build_parser, compare, doubling

    if smoke:
        argv = "--simulate --precision 32-true --seq-len 8 --d-model 32 --n-layers 1 --batch-size 8 --accumulate 4 "
        argv += "--steps 4 --measure 2 --adjust-every 1 --finder-trials 1 --double-steps 4"
    else:
        # optimizer steps of 8 x 16 = 128 sequences of 1024 tokens; sequences double to 2048 in the second scenario
        argv = "--seq-len 1024 --d-model 1024 --n-layers 12 --batch-size 8 --accumulate 16 --steps 40 --measure 15 "
        argv += "--adjust-every 4 --double-steps 40"
    args = build_parser().parse_args(argv.split())
    first, first_report = compare(args)
    second, second_report = doubling(args)
    record = {**first, "benchmark": "dynamic_batch", "doubling": second}
    return record, first_report + "\n#" + second_report


def _pack(smoke: bool) -> Report:
    from pack import build_parser, pack

    argv = ""  # the defaults are the GPU sizes
    if smoke:
        argv = "--accelerator cpu --vocab-size 64 --seq-len 16 --d-model 32 --n-layers 1 --n-heads 2 "
        argv += "--effective-batch 8 --sweep-from 4 --sweep-steps 2 --start-micro 2 --adjust-every 1 --steps 3 "
        argv += "--tune-steps 4 --measure 1 --rounds 1"
    return pack(build_parser().parse_args(argv.split()))


def _gpu_tests(smoke: bool, out: Path) -> Report:
    from _results import device_name, header_lines, run_header

    # the smoke run checks the plumbing on one test file; the real run collects every test marked gpu
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    if smoke:
        command.append("tests/test_flops.py")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90 if smoke else 300)
        output, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else str(err.stdout or "")
        output, returncode = output + "\n[timed out]\n", None
    (out / "gpu-tests.log").write_text(output)
    lines_out = output.strip().splitlines()
    summary = lines_out[-1] if lines_out else ""
    record = {
        **run_header("gpu-tests", device_name()),
        "pytest_command": " ".join(command[1:]),
        "returncode": returncode,
        "seconds": time.perf_counter() - start,
        "summary": summary,
        "log": "gpu-tests.log",
    }
    report = "\n".join(
        [
            f"# GPU tests — {record['device']}",
            "",
            *header_lines(record),
            f"`python {record['pytest_command']}`: exit code {returncode}, `{summary}`. Full output: `gpu-tests.log`.",
            "",
        ]
    )
    return record, report


RUNNERS: dict[str, Callable[[bool], Report]] = {
    "monitor": _monitor,
    "attention": _attention,
    "optimizers": _optimizers,
    "planner": _planner,
    "dynamic-batch": _dynamic_batch,
    "pack": _pack,
}


def _select(only: str | None) -> list[str]:
    if not only:
        return list(PARTS)
    chosen: list[str] = []
    for name in only.split(","):
        name = name.strip()
        if name in GROUPS:
            chosen += GROUPS[name]
        elif name in PARTS:
            chosen.append(name)
        else:
            raise ValueError(f"`--only` must name parts or groups from {[*PARTS, *GROUPS]}, got {name!r}")
    return [part for part in PARTS if part in chosen]


def _write_status(out: Path, status: dict[str, Any]) -> None:
    from lightning_tune.bench.files import write_atomically

    write_atomically(out / "suite.json", (json.dumps(status, indent=2, default=str) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for <part>.json, <part>.md and suite.json")
    parser.add_argument("--only", default=None, help=f"comma-separated parts or groups: {', '.join([*PARTS, *GROUPS])}")
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes on the CPU (CUDA hidden)")
    args = parser.parse_args(argv)
    try:
        parts = _select(args.only)
    except ValueError as err:
        parser.error(str(err))
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    import warnings

    import torch
    from _results import device_name, run_header, write_results

    if args.smoke:  # tiny ops on a shared CPU: one thread avoids waiting on oversubscribed workers
        torch.set_num_threads(1)

    warnings.filterwarnings("ignore", module="lightning")
    args.out.mkdir(parents=True, exist_ok=True)
    status: dict[str, Any] = {
        **run_header("suite", device_name()),
        "smoke": args.smoke,
        "parts": dict.fromkeys(parts, {"status": "pending"}),
    }
    failed = False
    for part in parts:
        status["parts"][part] = {"status": "running", "started": time.strftime("%H:%M:%S")}
        _write_status(args.out, status)
        start = time.perf_counter()
        try:
            record, report = _gpu_tests(args.smoke, args.out) if part == "gpu-tests" else RUNNERS[part](args.smoke)
            record["smoke"] = args.smoke
            entry = {"status": "ok"}
        except Exception as err:  # one part's failure must not cost the others their figures
            failed = True
            text = traceback.format_exc()
            record = {**run_header(part, device_name()), "smoke": args.smoke, "error": repr(err), "traceback": text}
            report = f"# {part}: failed\n\n```\n{text}```\n"
            entry = {"status": "error", "error": repr(err)}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        seconds = time.perf_counter() - start
        record["part_seconds"] = seconds
        write_results(args.out / part, record, report)
        status["parts"][part] = {**entry, "seconds": round(seconds, 1)}
        _write_status(args.out, status)
        print(f"[suite] {part}: {entry['status']} in {seconds:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
