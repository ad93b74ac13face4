"""One progress bar per setting of a sweep, on standard error: warm-up, then the measured steps."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_tune.perf.batch import count_samples

if TYPE_CHECKING:
    import lightning.pytorch as pl


class SweepProgress(Callback):
    """A tqdm bar over a setting's ``warmup`` and measured ``steps``, replacing the Trainer's, which restarts each run.

    It also keeps :attr:`first_samples`, to catch a dataloader that ignores ``batch_size``.
    """

    def __init__(self, label: str, *, warmup: int, steps: int, enabled: bool = True) -> None:
        self.warmup = warmup
        #: Samples of the first batch whose samples can be counted (``None`` before it).
        self.first_samples: int | None = None
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=warmup + steps, desc=label, unit="step", file=sys.stderr, leave=True, dynamic_ncols=True
            )
            self._bar.set_postfix_str("warm-up" if warmup else "measuring")

    def _advance(self, batch: Any) -> None:
        if self.first_samples is None:
            self.first_samples = count_samples(batch)
        if self._bar is None:
            return
        self._bar.update(1)
        if self._bar.n == self.warmup:
            self._bar.set_postfix_str("measuring")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._advance(batch)

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
        self._advance(batch)

    def close(self, outcome: str) -> None:
        """Finish the bar with the setting's outcome, e.g. ``"52.1 samples/s"`` or ``"OOM"``."""
        if self._bar is None:
            return
        self._bar.set_postfix_str(outcome)
        self._bar.close()
        self._bar = None
