"""Train the demo GPT with LightningCLI, the pack's callbacks and plugin configured from YAML.

    python examples/lightning_cli/train.py fit --config examples/lightning_cli/config.yaml

Every lightning_tune callback has a typed constructor, so LightningCLI (jsonargparse) builds it from
``class_path``/``init_args`` and checks the values; a bad one fails with the constructor's own message.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lightning_tune.demos import DemoGPT, SyntheticTokenDataModule


def main(args: list[str] | None = None, *, run: bool = True) -> LightningCLI:
    return LightningCLI(DemoGPT, SyntheticTokenDataModule, args=args, run=run, save_config_callback=None)


if __name__ == "__main__":
    main()
