"""Callback that swaps the optimizer a LightningModule configured for an 8-bit (or fused) one, without editing it.

At fit start, before a checkpoint's optimizer state is restored, :func:`~lightning_tune.swaps.optimizer.swap_optimizers`
rebuilds every optimizer and re-points the schedulers; nothing is undone at teardown (docs/optimizer_swap.md says why).
The first step's report comes from a step hook on the swapped optimizers, so the callback has no per-batch hooks.

Logged keys (straight to the Trainer's loggers, once, after the first optimizer step):

==============================  ========================================================================
Key                             Meaning
==============================  ========================================================================
``tune/optimizer_state_bytes``  Bytes of the state tensors of all swapped optimizers after the first step
==============================  ========================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_tune import _imports
from lightning_tune.callbacks._logging import log
from lightning_tune.callbacks.surgery import without_step_hooks
from lightning_tune.keys import OPTIMIZER_STATE_BYTES as STATE_BYTES_KEY  # logged once, after the first step
from lightning_tune.swaps.optimizer import (
    TARGETS,
    Keep32bit,
    OptimizerSwapResult,
    check_state_options,
    optimizer_state_bytes,
    replaced_state_bytes,
    state_summary,
    swap_optimizers,
)
from lightning_tune.vocab import OptimizerName, canonical_optimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer
    from torch.utils.hooks import RemovableHandle

#: State keys that only bitsandbytes optimizers write (``__bnb_optimizer_quant_state__`` wraps them in checkpoints).
_BNB_STATE_KEYS = frozenset({"state1", "__bnb_optimizer_quant_state__"})


@without_step_hooks
class OptimizerSwap(Callback):
    """Replace every optimizer with a bitsandbytes 8-bit optimizer (or torch's fused AdamW) at fit start.

    Args:
        optimizer: What to swap in, one of :data:`~lightning_tune.swaps.optimizer.TARGETS` or an alias
            (``"adamw_8bit"``, ``"adamw_torch_fused"``). ``"adamw_fused"`` needs no bitsandbytes.
        keep_32bit: Which parameters keep 32-bit state: ``"embeddings"``, ``"none"``, or ``fn(name, param) -> bool``
            over the names of ``pl_module.named_parameters()``.
        min_8bit_size: Tensors with fewer elements keep 32-bit state (bitsandbytes' rule), >= 1.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``optimizer`` or a named ``keep_32bit`` rule is unknown, or ``min_8bit_size < 1``.
        ModuleNotFoundError: If a bitsandbytes optimizer is asked for and bitsandbytes is not installed; the message
            names ``pip install 'lightning-tune[bnb]'``.

    Attributes:
        results: One :class:`~lightning_tune.swaps.optimizer.OptimizerSwapResult` per optimizer of the current fit.
        state_bytes_before: Estimated state bytes of the replaced optimizers (``None`` if a class is unknown).
        state_bytes_after: Measured state bytes after the first optimizer step (``None`` until then).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[OptimizerSwap("adamw_fused")], logger=False)
    """

    def __init__(
        self, optimizer: OptimizerName = "adamw8bit", *, keep_32bit: Keep32bit = "embeddings", min_8bit_size: int = 4096
    ) -> None:
        self.optimizer = canonical_optimizer(optimizer, allowed=TARGETS)
        check_state_options(keep_32bit, min_8bit_size)
        if self.optimizer != "adamw_fused" and not _imports.is_available("bitsandbytes"):
            _imports.require("bitsandbytes", feature="OptimizerSwap")
        self.keep_32bit: Keep32bit = keep_32bit
        self.min_8bit_size = min_8bit_size
        self.results: list[OptimizerSwapResult] = []
        self.state_bytes_before: int | None = None
        self.state_bytes_after: int | None = None
        self._step_hooks: list[RemovableHandle] = []

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        for index, state_dict in enumerate(checkpoint.get("optimizer_states", [])):
            states = [s for s in state_dict.get("state", {}).values() if isinstance(s, Mapping) and s]
            if not states:
                continue
            saved_8bit = any(_BNB_STATE_KEYS & set(s) for s in states)
            if saved_8bit != (self.optimizer != "adamw_fused"):
                saved = "a bitsandbytes optimizer" if saved_8bit else "a torch optimizer"
                raise MisconfigurationException(
                    f"the checkpoint holds the state of {saved} for optimizer {index}, which cannot be loaded into "
                    f"OptimizerSwap({self.optimizer!r})'s optimizer. Resume with the OptimizerSwap settings the "
                    "checkpoint was saved with (or without OptimizerSwap if it was saved without it)."
                )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            raise MisconfigurationException(
                "OptimizerSwap cannot replace the optimizer DeepSpeed's engine already wraps; use DeepSpeed's own "
                "optimizer settings instead"
            )
        optimizers = list(trainer.strategy.optimizers)
        if not optimizers:
            raise MisconfigurationException("OptimizerSwap found no optimizer: `configure_optimizers` returned none.")
        self.state_bytes_after = None
        new, configs, self.results = swap_optimizers(
            optimizers,
            trainer.strategy.lr_scheduler_configs,
            pl_module,
            optimizer=self.optimizer,
            keep_32bit=self.keep_32bit,
            min_8bit_size=self.min_8bit_size,
        )
        trainer.strategy.optimizers = new
        trainer.strategy.lr_scheduler_configs = configs
        self.state_bytes_before = replaced_state_bytes(self.results)
        rank_zero_info("OptimizerSwap:\n" + "\n".join(result.describe() for result in self.results))

        def after_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            self.state_bytes_after = report_state(trainer, type(self).__name__, self.results, self.state_bytes_before)
            if self.state_bytes_after is not None:
                self._remove_step_hooks()

        self._remove_step_hooks()
        self._step_hooks = [optimizer.register_step_post_hook(after_step) for optimizer in new]

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_step_hooks()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_step_hooks()

    def _remove_step_hooks(self) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []

    def summary(self) -> str:
        """One line comparing the measured state size with the estimate for the replaced optimizers.

        Returns:
            The line, e.g. ``"OptimizerSwap: optimizer state 0.81 MiB after the first step (AdamW: 3.09 MiB, 26.2%)"``.
        """
        return state_summary(type(self).__name__, self.results, self.state_bytes_before, self.state_bytes_after)


def report_state(trainer: pl.Trainer, owner: str, results: list[OptimizerSwapResult], before: int | None) -> int | None:
    """Log and print the swapped optimizers' state bytes and return them, once they hold state (else ``None``)."""
    if not any(any(optimizer.state.values()) for optimizer in trainer.optimizers):
        return None
    after = sum(optimizer_state_bytes(optimizer) for optimizer in trainer.optimizers)
    log(trainer, {STATE_BYTES_KEY: after})
    rank_zero_info(state_summary(owner, results, before, after))
    return after
