"""The callbacks that change the LightningModule for one Trainer run, through one base, :class:`SurgeryCallback`.

Each wires a surgery of :mod:`lightning_tune.swaps` to Lightning's hooks: made in ``setup``, before the strategy
moves the model and wraps it in DDP/FSDP, and undone in ``teardown``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_tune._surgery import SurgeryResult
from lightning_tune._validation import check_bool, check_int, check_strings
from lightning_tune.swaps.attention import AttentionSwapResult, swap_attention
from lightning_tune.swaps.checkpointing import BlockTypes, CheckpointResult, checkpoint_blocks, type_matcher
from lightning_tune.swaps.compile import CompileMode, CompileResult, check_compile_options, compile_modules
from lightning_tune.swaps.cross_entropy import check_loss_options
from lightning_tune.swaps.loss import LossSwapResult, swap_loss
from lightning_tune.vocab import Attention, LossBackend, canonical_attention, canonical_loss, precision_dtype

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: The surgeries made on each module, in the order they were made.
_MADE: weakref.WeakKeyDictionary[nn.Module, list[SurgeryResult]] = weakref.WeakKeyDictionary()

#: Lightning's callback hooks that run every batch (training, validation, test, predict).
STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    *(f"on_{stage}_batch_{when}" for stage in ("validation", "test", "predict") for when in ("start", "end")),
)
_C = TypeVar("_C", bound=type[Callback])


def without_step_hooks(cls: _C) -> _C:
    """Class decorator: the per-batch hooks ``cls`` does not define itself are ``None``, so Lightning skips them.

    Lightning dispatches every hook to every callback, the base class's no-ops included, each inside a profiler
    context. Its dispatcher (``trainer/call.py``'s ``_call_callback_hooks``) calls a hook only when
    ``callable(getattr(callback, name))``. Checked on Lightning 2.6.6; ``tests/swaps/test_surgery.py`` fails if the
    dispatcher stops skipping them. A subclass that defines one of these hooks gets it called (with no ``super()``).
    """
    for name in STEP_HOOKS:
        if name not in vars(cls):
            setattr(cls, name, None)
    return cls


@without_step_hooks
class SurgeryCallback(Callback):
    """Apply a module surgery in ``setup`` and undo it in ``teardown``; a subclass implements :meth:`apply`.

    A ``setup`` without its ``teardown`` (an interrupted run) first undoes the earlier change, so changes never stack.
    The surgeries made on a module are undone last made first, whichever callback's ``teardown`` comes first.

    Args:
        verbose: Print what was changed, on rank zero.

    Raises:
        TypeError: If ``verbose`` is not a bool.

    Attributes:
        result: What the surgery of the current run changed; ``None`` outside a run.

    Example:
        >>> from lightning_tune.swaps.compile import compile_modules
        >>> class EagerCompile(SurgeryCallback):
        ...     def apply(self, trainer, pl_module):
        ...         return compile_modules(pl_module, backend="eager")
        >>> EagerCompile(verbose=False).result is None
        True
    """

    def __init__(self, *, verbose: bool = True) -> None:
        check_bool("verbose", verbose)
        self.verbose = verbose
        self.result: SurgeryResult | None = None

    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> SurgeryResult:
        """Change ``pl_module`` in place and return what was changed."""
        raise NotImplementedError

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(pl_module)
        self.result = self.apply(trainer, pl_module)
        _MADE.setdefault(pl_module, []).append(self.result)
        if self.verbose:
            rank_zero_info(self.result.describe())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(pl_module)

    def _restore(self, module: nn.Module) -> None:
        """Undo the surgery after those made on ``module`` since, which may wrap it (TorchCompile on LossSwap's)."""
        result, made = self.result, _MADE.get(module, [])
        if result is None:
            return
        self.result, index = None, next((i for i, r in enumerate(made) if r is result), len(made))
        for later in reversed(made[index:]):
            later.restore()
        del made[index:]
        result.restore()


class ActivationCheckpointing(SurgeryCallback):
    """Checkpoint the model's transformer blocks for each Trainer run (:func:`~lightning_tune.swaps.checkpoint_blocks`).

    Args:
        block_types: Classes or class names of the blocks (``"Block"``, ``"torch.nn.TransformerEncoderLayer"``);
            ``None`` finds them.
        preserve_rng_state: Replay the RNG state in the recomputation, so dropout masks match.
        verbose: Print which blocks were wrapped.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``block_types`` is an empty sequence. Finding no blocks raises at ``setup``.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[ActivationCheckpointing()], logger=False)
    """

    def __init__(
        self, block_types: BlockTypes | None = None, *, preserve_rng_state: bool = True, verbose: bool = True
    ) -> None:
        super().__init__(verbose=verbose)
        if block_types is not None:
            type_matcher(block_types)
        check_bool("preserve_rng_state", preserve_rng_state)
        self.block_types = block_types
        self.preserve_rng_state = preserve_rng_state

    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> CheckpointResult:
        """Checkpoint the blocks of ``pl_module``."""
        return checkpoint_blocks(pl_module, self.block_types, preserve_rng_state=self.preserve_rng_state)


class TorchCompile(SurgeryCallback):
    """Compile the network for each Trainer run with :func:`~lightning_tune.swaps.compile.compile_modules`.

    Args:
        modules: Submodule names to compile (``""``: the LightningModule, i.e. its ``forward``); ``None``: every
            direct child that holds parameters.
        mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"`` or ``None``.
        fullgraph: Make a graph break an error.
        dynamic: ``None`` (detect dynamic shapes), ``True`` or ``False``.
        backend: A backend from ``torch.compiler.list_backends(exclude_tags=())`` or a callable.
        options: Backend options (not together with ``mode``).
        verbose: Print what was compiled.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``mode`` or ``backend`` is unknown, or both ``mode`` and ``options`` are given.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[TorchCompile(mode="max-autotune")], logger=False)
    """

    def __init__(
        self,
        modules: Sequence[str] | None = None,
        *,
        mode: CompileMode | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str | Callable[..., Any] = "inductor",
        options: Mapping[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        check_compile_options(mode=mode, fullgraph=fullgraph, dynamic=dynamic, backend=backend, options=options)
        check_strings("modules", modules, what="submodule names", allow_none=True, allow_empty=False)
        self.modules = None if modules is None else list(modules)
        self.mode, self.fullgraph, self.dynamic = mode, fullgraph, dynamic
        self.backend, self.options = backend, options

    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> CompileResult:
        """Compile the chosen submodules of ``pl_module``."""
        return compile_modules(
            pl_module,
            self.modules,
            mode=self.mode,
            fullgraph=self.fullgraph,
            dynamic=self.dynamic,
            backend=self.backend,
            options=self.options,
        )


class AttentionSwap(SurgeryCallback):
    """Route the module's attention through a faster kernel for each Trainer run (docs/attention_swap.md).

    Args:
        backend: ``"auto"`` (flash-attn where it can run, else SDPA), ``"flash"``, ``"sdpa"`` or ``"eager"``; Hugging
            Face's names (``"flash_attention_2"``) are aliases.
        verbose: Print the table of swapped modules at setup.

    Raises:
        ValueError: If ``backend`` names no attention backend.
        TypeError: If ``backend`` is not a string or ``verbose`` not a bool.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[AttentionSwap("sdpa")], logger=False)
    """

    def __init__(self, backend: Attention = "auto", *, verbose: bool = True) -> None:
        super().__init__(verbose=verbose)
        self.backend = canonical_attention(backend, arg="backend")

    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> AttentionSwapResult:
        """Swap the attention of ``pl_module`` for the Trainer's device and precision."""
        return swap_attention(
            pl_module,
            self.backend,
            device=trainer.strategy.root_device,
            dtype=precision_dtype(str(trainer.precision)),
            notify=rank_zero_info,
        )


class LossSwap(SurgeryCallback):
    """Compute a causal LM's training loss without logits in each Trainer run (:func:`~lightning_tune.swaps.swap_loss`).

    Args:
        backend: ``"auto"`` (Liger-Kernel on CUDA when installed, else ``"chunked"``), ``"chunked"`` (PyTorch, any
            device) or ``"liger"`` (CUDA, ``pip install 'lightning-tune[liger]'``).
        chunk_size: Tokens per chunk of the ``"chunked"`` backend; ``None`` chooses.
        label_smoothing: As :func:`~lightning_tune.swaps.cross_entropy.linear_cross_entropy`'s.
        ce_weight: As :func:`~lightning_tune.swaps.cross_entropy.linear_cross_entropy`'s.
        lse_square_scale: As :func:`~lightning_tune.swaps.cross_entropy.linear_cross_entropy`'s.
        eval: Swap evaluation too: a call with ``labels`` in eval mode returns the loss, ``token_accuracy`` and
            ``predictions`` and no ``logits`` (off by default: a ``validation_step`` reading them would fail).
        verbose: Print the swapped models at setup.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument's value is not allowed. What :func:`~lightning_tune.swaps.loss.swap_loss` refuses
            (a module built in ``configure_model`` has no causal LM yet: use ``TunePlugin(loss=...)``) raises at
            ``setup``.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[LossSwap("chunked", eval=True)], logger=False)
    """

    def __init__(
        self,
        backend: LossBackend = "auto",
        *,
        chunk_size: int | None = None,
        label_smoothing: float = 0.0,
        ce_weight: Tensor | None = None,
        lse_square_scale: float = 0.0,
        eval: bool = False,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        self.backend = canonical_loss(backend, arg="backend")
        check_int("chunk_size", chunk_size, minimum=1, allow_none=True)
        check_loss_options(label_smoothing, ce_weight, lse_square_scale)
        check_bool("eval", eval)
        self.chunk_size, self.eval = chunk_size, eval
        self.loss_options: dict[str, Any] = {
            "label_smoothing": label_smoothing,
            "ce_weight": ce_weight,
            "lse_square_scale": lse_square_scale,
        }

    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LossSwapResult:
        """Swap the loss of the causal LMs in ``pl_module`` for the Trainer's device."""
        return swap_loss(
            pl_module,
            self.backend,
            device=trainer.strategy.root_device,
            chunk_size=self.chunk_size,
            eval=self.eval,
            notify=rank_zero_info,
            **self.loss_options,
        )
