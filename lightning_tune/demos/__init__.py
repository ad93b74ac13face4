"""A self-contained demo (``lightning-tune demo``, :func:`run_demo`): a small GPT trained on synthetic tokens."""

from lightning_tune.demos.data import SyntheticTokenDataModule
from lightning_tune.demos.gpt import GPT, DemoGPT, GPTConfig
from lightning_tune.demos.run import run_demo

__all__ = ["DemoGPT", "GPT", "GPTConfig", "SyntheticTokenDataModule", "run_demo"]
