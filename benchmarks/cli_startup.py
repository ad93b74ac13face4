"""Start-up time of the command line and of ``import lightning_tune``, each in a fresh interpreter.

Commands that do not train (``--version``, ``calc``, ``--help``, usage errors) should answer in well under a
second: they import neither torch nor Lightning. Each command runs ``--repeats`` times; the median wall time is
printed, with the bare interpreter's start-up for comparison.

    python benchmarks/cli_startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python (bare interpreter)": ["-c", "pass"],
    "import lightning_tune": ["-c", "import lightning_tune"],
    "lightning-tune --version": ["-m", "lightning_tune", "--version"],
    "lightning-tune calc batch-size --help": ["-m", "lightning_tune", "calc", "batch-size", "--help"],
    "lightning-tune calc batch-size (llama-2-7b, 80GB)": [
        "-m",
        "lightning_tune",
        "calc",
        "batch-size",
        "--model",
        "llama-2-7b",
        "--gpu-memory",
        "80GB",
        "--sequence-length",
        "2048",
    ],  # fmt: skip
    "import lightning_tune; lightning_tune.WarmupCosine": ["-c", "import lightning_tune; lightning_tune.WarmupCosine"],
}


def median_seconds(args: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default: 5)")
    options = parser.parse_args()
    width = max(map(len, COMMANDS))
    print(f"{'command':<{width}}  median of {options.repeats} (s)")
    for name, args in COMMANDS.items():
        print(f"{name:<{width}}  {median_seconds(args, options.repeats):.2f}", flush=True)


if __name__ == "__main__":
    main()
