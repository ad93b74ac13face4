"""One progress bar per setting of a sweep, on standard error: warm-up, then the measured steps."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["SweepProgress"]


class SweepProgress(Callback):
    """A tqdm bar, ``label``, over a setting's ``warmup`` and measured ``steps`` (or predict batches).

    It replaces the Trainer's own bar in a sweep, which restarts every epoch and every predict run; with
    ``enabled=False`` every method is a no-op.
    """

    def __init__(self, label: str, *, warmup: int, steps: int, enabled: bool = True) -> None:
        self.label = label
        self.warmup = warmup
        self.steps = steps
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=warmup + steps, desc=label, unit="step", file=sys.stderr, leave=True, dynamic_ncols=True
            )
            self._bar.set_postfix_str("warm-up" if warmup else "measuring")

    def _advance(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if self._bar.n == self.warmup:
            self._bar.set_postfix_str("measuring")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._advance()

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance()

    def close(self, outcome: str) -> None:
        """Finish the bar with the setting's outcome, e.g. ``"52.1 samples/s"`` or ``"OOM"``.

        Args:
            outcome: Text shown after the bar.
        """
        if self._bar is None:
            return
        self._bar.set_postfix_str(outcome)
        self._bar.close()
        self._bar = None
