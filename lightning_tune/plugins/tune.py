"""``TunePlugin``: the pack's swaps as the one ``Precision`` plugin a Trainer takes (docs/plugin.md).

It wraps the plugin Lightning would build for the precision and the strategy, chosen at ``convert_module`` (the first
hook that sees them, so building it never initialises CUDA), and subclasses ``FSDPPrecision`` because
``FSDPStrategy`` accepts nothing else (Lightning #20855).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Final, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tune import _imports
from lightning_tune._validation import check_bool, check_choice
from lightning_tune.vocab import (
    PRECISIONS,
    Attention,
    LossBackend,
    OptimizerName,
    Precision as PrecisionName,
    auto_precision,
    canonical_attention,
    canonical_loss,
    canonical_optimizer,
    canonical_precision,
    check_precision_device,
    precision_dtype,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.utilities.types import LRSchedulerConfig
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    from lightning_tune.swaps.attention import AttentionSwapResult
    from lightning_tune.swaps.loss import LossSwapResult
    from lightning_tune.swaps.optimizer import Keep32bit

#: Precisions the plugin trains in: all but transformer-engine's, which has its own Lightning plugin.
_PRECISIONS: Final = tuple(p for p in PRECISIONS if "transformer" not in p)
#: Precisions each sharded strategy takes (Lightning 2.6.6's own lists: ``ModelParallelStrategy``'s check in the
#: accelerator connector, ``FSDPPrecision``'s and ``DeepSpeedPrecision``'s accepted inputs).
_STRATEGY_PRECISIONS: Final[dict[str, tuple[str, ...]]] = {
    "ModelParallelStrategy": ("32-true", "bf16-mixed", "bf16-true", "16-true"),
    "FSDPStrategy": ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"),
    "DeepSpeedStrategy": ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"),
}
_CONFLICT_HINT: Final[str] = " (give the precision to TunePlugin(precision=...), not to Trainer)"


def _inner_plugin(precision: str, device: str, strategy: str | None = None) -> Precision:
    if strategy is not None and precision not in _STRATEGY_PRECISIONS[strategy]:
        allowed = ", ".join(repr(p) for p in _STRATEGY_PRECISIONS[strategy])
        raise MisconfigurationException(
            f"TunePlugin(precision={precision!r}) cannot run under {strategy}, which supports {allowed}"
        )
    if strategy == "FSDPStrategy":
        return FSDPPrecision(precision)  # type: ignore[arg-type]
    if strategy == "DeepSpeedStrategy":
        return DeepSpeedPrecision(precision)  # type: ignore[arg-type]
    if precision in ("16-mixed", "bf16-mixed"):
        check_precision_device(precision, device)
        return MixedPrecision(precision, device)  # type: ignore[arg-type]
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    if precision == "64-true":
        return DoublePrecision()
    return Precision()


def _trainer_of(module: Module) -> pl.Trainer | None:
    """The Trainer a LightningModule is attached to; ``None`` for any other module, or one not attached."""
    try:
        return module.trainer if isinstance(module, LightningModule) else None
    except RuntimeError:  # not attached to a Trainer
        return None


class TunePlugin(FSDPPrecision):
    """One ``Precision`` plugin that applies the pack's optimizer, attention and loss swaps, under any strategy.

    See ``docs/multi_gpu.md`` for what works under DDP, FSDP, FSDP2 (``ModelParallelStrategy``) and DeepSpeed.

    Args:
        precision: The precision to train in (here, not in ``Trainer(precision=...)``): ``"auto"`` (decided in the
            training process once the device is known), ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``, ``"64-true"``, or an alias of :mod:`lightning_tune.vocab` (``"bf16"``).
        optimizer: Replace the module's optimizers with this one, as :class:`~lightning_tune.OptimizerSwap` does (the
            two together are refused); ``None`` keeps them.
        attention: Route attention through this backend, as :class:`~lightning_tune.AttentionSwap` does; ``None``
            leaves attention alone.
        loss: Compute causal language models' training loss without their logits, as
            :class:`~lightning_tune.LossSwap` does; ``None`` leaves it alone.
        loss_eval: With ``loss``, swap evaluation too, as ``LossSwap(eval=True)``.
        keep_32bit: With an 8-bit optimizer, which parameters keep 32-bit state (``"embeddings"``, ``"none"`` or
            ``fn(name, param) -> bool``).
        min_8bit_size: With an 8-bit optimizer, tensors with fewer elements keep 32-bit state.
        device: ``"cuda"`` or ``"cpu"``: where mixed precision autocasts; ``None`` follows the strategy's device.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is not allowed.
        ModuleNotFoundError: If an 8-bit optimizer is asked for and bitsandbytes is missing (names the extra).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(plugins=[TunePlugin(precision="32-true", attention="sdpa")], logger=False)
    """

    def __init__(
        self,
        precision: PrecisionName = "auto",
        *,
        optimizer: OptimizerName | None = None,
        attention: Attention | None = None,
        loss: LossBackend | None = None,
        loss_eval: bool = False,
        keep_32bit: Keep32bit = "embeddings",
        min_8bit_size: int = 4096,
        device: Literal["cuda", "cpu"] | None = None,
    ) -> None:
        # FSDPPrecision.__init__ is not called: the wrapped plugin holds the precision state under every strategy
        from lightning_tune.swaps.optimizer import TARGETS, check_state_options

        if device is not None:
            check_choice("device", device, ("cuda", "cpu"))
        self.requested_precision = canonical_precision(precision, allowed=_PRECISIONS)
        if optimizer is not None:
            optimizer = canonical_optimizer(optimizer, allowed=TARGETS)
            if optimizer != "adamw_fused":
                _imports.require("bitsandbytes", feature=f"TunePlugin(optimizer={optimizer!r})")
        if attention is not None:
            attention = canonical_attention(attention)
        if loss is not None:
            loss = canonical_loss(loss)
        check_bool("loss_eval", loss_eval)
        if loss_eval and loss is None:
            raise ValueError("`loss_eval=True` swaps the evaluation loss and needs `loss` (e.g. loss='auto'), got None")
        check_state_options(keep_32bit, min_8bit_size)
        self._explicit_device = device is not None
        self._device: str | None = device
        self._precision: str | None = None if self.requested_precision == "auto" else self.requested_precision
        if self._precision is not None and device is not None:
            _inner_plugin(self._precision, device)  # refuses "16-mixed" on an explicit CPU now, not at fit
        self._inner: Precision | None = None
        self._inner_strategy: str | None = None
        self.optimizer = optimizer
        self.attention = attention
        self.loss, self.loss_eval = loss, loss_eval
        self.keep_32bit = keep_32bit
        self.min_8bit_size = min_8bit_size
        self.attention_swap: AttentionSwapResult | None = None
        self.loss_swap: LossSwapResult | None = None
        self.optimizer_swaps: list[Any] = []
        #: Estimated state bytes of the optimizers the swap replaced (``None`` if a class is unknown).
        self.state_bytes_before: int | None = None
        #: Measured state bytes of the swapped optimizers after the first step (``None`` until then).
        self.state_bytes_after: int | None = None

    def __repr__(self) -> str:
        return (
            f"TunePlugin(precision={self.requested_precision!r}, optimizer={self.optimizer!r}, "
            f"attention={self.attention!r}{'' if self.loss is None else f', loss={self.loss!r}'}"
            f"{', loss_eval=True' if self.loss_eval else ''})"
        )

    def __format__(self, spec: str) -> str:
        return format(repr(self) + (_CONFLICT_HINT if _formatting_precision_conflict() else ""), spec)

    # ------------------------------------------------------------------ resolved lazily, in the training process

    @property
    def precision(self) -> str:  # type: ignore[override]
        """The Lightning precision in use; ``"auto"`` is decided at the first read (in the training process)."""
        if self._precision is None:
            self._precision = auto_precision(self.device)
        return self._precision

    @property
    def device(self) -> str:
        """Where mixed precision autocasts: the explicit ``device``, else the strategy's once known, else a GPU if any.

        ``torch.cuda.device_count()``, unlike ``is_available()``, leaves a later fork of this process usable.
        """
        if self._device is None:
            self._device = "cuda" if torch.cuda.device_count() > 0 else "cpu"
        return self._device

    @property
    def inner(self) -> Precision:
        """The Lightning plugin every precision hook is delegated to."""
        if self._inner is None:
            self._inner = _inner_plugin(self.precision, self.device)
        return self._inner

    @inner.setter
    def inner(self, plugin: Precision) -> None:
        self._inner = plugin

    @property
    def scaler(self) -> Any:
        """The wrapped plugin's gradient scaler (``None`` unless ``16-mixed``)."""
        return getattr(self.inner, "scaler", None)

    @scaler.setter
    def scaler(self, value: Any) -> None:
        self.inner.scaler = value  # type: ignore[attr-defined]

    @property
    def mixed_precision_config(self) -> TorchMixedPrecision:
        """FSDP's mixed-precision setting: the wrapped ``FSDPPrecision``'s, else one in :attr:`compute_dtype`."""
        if isinstance(self.inner, FSDPPrecision):
            return self.inner.mixed_precision_config
        from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

        dtype = self.compute_dtype
        return TorchMixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix multiplications run in under this precision."""
        return precision_dtype(self.precision)

    def _setup_for(self, strategy: Strategy | None) -> None:
        """Decide the device, ``"auto"`` and the wrapped plugin from the strategy the model is set up under."""
        device = strategy.root_device.type if strategy is not None and not self._explicit_device else None
        if device in ("cuda", "cpu") and device != self._device:
            self._device, self._inner = device, None  # a guess made before the strategy was known gives way
            if self.requested_precision == "auto":
                self._precision = None
        sharded = (ModelParallelStrategy, FSDPStrategy, DeepSpeedStrategy)
        name = next((cls.__name__ for cls in sharded if isinstance(strategy, cls)), None)
        if self._inner is None or name != self._inner_strategy:
            self._inner = _inner_plugin(self.precision, self.device, name)
            self._inner_strategy = name

    @override
    def convert_module(self, module: Module) -> Module:
        strategy = None if (trainer := _trainer_of(module)) is None else trainer.strategy
        self._setup_for(strategy)
        module = self.inner.convert_module(module)
        if self.attention is not None and self.attention_swap is None:
            from lightning_tune.swaps.attention import swap_attention

            if isinstance(strategy, ModelParallelStrategy) and _is_sharded(module):
                raise MisconfigurationException(
                    f"TunePlugin(attention={self.attention!r}) cannot swap attention under ModelParallelStrategy: "
                    "`configure_model` has already applied `fully_shard` when the plugin sees the model. Use "
                    f"callbacks=[AttentionSwap({self.attention!r})] instead, which swaps in `setup`, before "
                    "`configure_model`, and keep TunePlugin for the precision and the optimizer."
                )
            self.attention_swap = swap_attention(
                module,
                self.attention,
                device=torch.device(self.device),
                dtype=self.compute_dtype,
                notify=rank_zero_info,
            )
            rank_zero_info(self.attention_swap.describe())
        if self.loss is not None and self.loss_swap is None:
            from lightning_tune.swaps.loss import swap_loss

            self.loss_swap = swap_loss(
                module, self.loss, device=torch.device(self.device), eval=self.loss_eval, notify=rank_zero_info
            )
            rank_zero_info(self.loss_swap.describe())
        return module

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[LRSchedulerConfig]
    ) -> tuple[Module, list[Optimizer], list[LRSchedulerConfig]]:
        model, optimizers, lr_schedulers = self.inner.connect(model, optimizers, lr_schedulers)
        self._follow_model_device(model)
        if self.optimizer is not None and optimizers:
            if self._inner_strategy == "DeepSpeedStrategy":
                raise MisconfigurationException(
                    f"TunePlugin(optimizer={self.optimizer!r}) cannot swap the optimizer under DeepSpeed: its engine "
                    "replaces the optimizer's parameters with its own flat, partitioned fp32 copies, so per-parameter "
                    "8-bit state and the 32-bit embedding overrides would not apply. Set the optimizer in DeepSpeed's "
                    "config (or return it from configure_optimizers) and use TunePlugin for precision and attention."
                )
            from lightning_tune.callbacks.optimizer_swap import OptimizerSwap
            from lightning_tune.swaps.optimizer import replaced_state_bytes, swap_optimizers

            callbacks = [] if (trainer := _trainer_of(model)) is None else trainer.callbacks  # type: ignore[attr-defined]
            if any(isinstance(cb, OptimizerSwap) for cb in callbacks):
                raise MisconfigurationException(
                    f"OptimizerSwap and TunePlugin(optimizer={self.optimizer!r}) both swap the optimizer; configure "
                    "the swap once: remove the OptimizerSwap callback or TunePlugin's `optimizer`"
                )
            optimizers, lr_schedulers, self.optimizer_swaps = swap_optimizers(
                list(optimizers),
                list(lr_schedulers),
                model,
                optimizer=self.optimizer,
                keep_32bit=self.keep_32bit,
                min_8bit_size=self.min_8bit_size,
            )
            self.state_bytes_before, self.state_bytes_after = replaced_state_bytes(self.optimizer_swaps), None
            rank_zero_info("TunePlugin:\n" + "\n".join(result.describe() for result in self.optimizer_swaps))
        return model, optimizers, lr_schedulers

    def _follow_model_device(self, model: Module) -> None:
        """Autocast where the strategy put the model (``connect`` runs after the move), as Trainer's precision does."""
        if self._explicit_device or not isinstance(self.inner, MixedPrecision):
            return
        parameter = next(model.parameters(), None)
        if parameter is not None and parameter.device.type in ("cuda", "cpu") and parameter.device.type != self.device:
            self._device = parameter.device.type
            self.inner.device = self._device

    @override
    def teardown(self) -> None:
        self.inner.teardown()
        for swap in (self.attention_swap, self.loss_swap):
            if swap is not None:
                swap.restore()
        self.attention_swap = None
        self.loss_swap = None

    # Delegated to the wrapped plugin. post_backward, unscale_gradients, main_params and the *_step_context hooks are
    # inherited instead: no plugin wrapped here overrides them (Lightning 2.6.6; tests/swaps/test_plugin.py checks it),
    # and the step contexts enter forward_context, which is delegated.

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        # before the strategy is known, "auto" can only become a mixed or full precision: nothing to change at init
        return nullcontext() if self._precision is None else self.inner.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return nullcontext() if self._precision is None else self.inner.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.inner.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return self.inner.pre_backward(tensor, module)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        self.inner.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        output = self.inner.optimizer_step(optimizer, model, closure, **kwargs)
        if self.optimizer_swaps and self.state_bytes_after is None and isinstance(model, LightningModule):
            from lightning_tune.callbacks.optimizer_swap import report_state

            before = self.state_bytes_before  # the first step: reported as OptimizerSwap reports it
            self.state_bytes_after = report_state(model.trainer, "TunePlugin", self.optimizer_swaps, before)
        return output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        self.inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    # Lightning files precision state under the plugin's class name. Saving it under the inner plugin's name too,
    # and reading it from there when a checkpoint has no "TunePlugin" entry, lets runs move between
    # Trainer(precision="16-mixed") and TunePlugin("16-mixed") without losing the loss scale.

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.inner.on_save_checkpoint(checkpoint)
        if state := self.inner.state_dict():
            checkpoint[type(self.inner).__qualname__] = state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.inner.on_load_checkpoint(checkpoint)
        inner_key = type(self.inner).__qualname__
        if type(self).__qualname__ not in checkpoint and inner_key in checkpoint:
            self.inner.load_state_dict(checkpoint[inner_key])


def _is_sharded(module: Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(child, FSDPModule) for child in module.modules())


def _formatting_precision_conflict() -> bool:
    """Whether the plugin is being written into Lightning's "Received both `precision=...` and `plugins=...`" error.

    That error is the one place where the hint belongs, and Lightning builds it with an f-string in
    ``_AcceleratorConnector._check_config_and_set_final_flags`` (checked on Lightning 2.6.6;
    ``tests/test_plugin.py`` fails if it moves), which calls ``__format__`` from that frame.
    """
    caller = sys._getframe(2)
    return caller.f_code.co_name == "_check_config_and_set_final_flags" and "precision_flag" in caller.f_locals
