"""A self-contained demo: a small GPT trained on synthetic tokens, with the pack's callbacks turned on.

Run it with ``lightning-tune demo``, or from Python with :func:`run_demo`. The model and data are reused by the tests,
the examples and the benchmarks.
"""

from lightning_tune.demos.data import SyntheticTokenDataModule
from lightning_tune.demos.gpt import GPT, DemoGPT, GPTConfig
from lightning_tune.demos.run import run_demo

__all__ = ["DemoGPT", "GPT", "GPTConfig", "SyntheticTokenDataModule", "run_demo"]
