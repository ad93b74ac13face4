"""What a sweep runs: the demo GPT or a user's LightningModule, built afresh per batch size (rules in docs/bench.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_tune.bench.settings import DEMO, BenchSettings

# The attribute (or hyperparameter) a module or datamodule must have for its batch size to be set.
_BATCH_SIZE = "batch_size"
_DATA_HOOKS = {"train": "train_dataloader", "predict": "predict_dataloader"}


def load_class(spec: str, base: type, *, name: str) -> type:
    """Import the class ``spec`` names (``"package.module:Class"``, ``"module:Outer.Inner"``), a ``base`` subclass.

    Raises:
        ValueError: If the module cannot be imported or has no such attribute.
        TypeError: If the attribute is not a subclass of ``base``.

    Example:
        >>> load_class("collections:OrderedDict", dict, name="model").__name__
        'OrderedDict'
    """
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure while importing the user's module is reported the same way
        raise ValueError(
            f"`{name}` {spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err})"
        ) from err
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"`{name}` {spec!r}: module {module_name!r} has no attribute {attribute!r}") from None
    if not (isinstance(target, type) and issubclass(target, base)):
        raise TypeError(f"`{name}` {spec!r} must name a {base.__name__} subclass, got {target!r}")
    return target


def set_batch_size(model: pl.LightningModule, datamodule: pl.LightningDataModule | None, batch_size: int) -> list[str]:
    """Set ``batch_size`` wherever the module and the datamodule keep it, as Lightning's tuner does; where it was set.

    Raises:
        ValueError: If neither keeps a ``batch_size`` attribute or hyperparameter.

    Example:
        >>> from lightning_tune.demos import SyntheticTokenDataModule
        >>> datamodule = SyntheticTokenDataModule(4)
        >>> set_batch_size(pl.LightningModule(), datamodule, 16), datamodule.batch_size
        (['datamodule.batch_size'], 16)
    """
    places = []
    for label, holder in (("model", model), ("datamodule", datamodule)):
        if holder is None:
            continue
        if hasattr(holder, _BATCH_SIZE):
            setattr(holder, _BATCH_SIZE, batch_size)
            places.append(f"{label}.{_BATCH_SIZE}")
        if _BATCH_SIZE in holder.hparams:
            holder.hparams[_BATCH_SIZE] = batch_size
            places.append(f"{label}.hparams.{_BATCH_SIZE}")
    if not places:
        owners = (
            f"{type(model).__name__} has no"
            if datamodule is None
            else f"neither {type(model).__name__} nor {type(datamodule).__name__} has a"
        )
        raise ValueError(
            f"cannot set the batch size: {owners} `{_BATCH_SIZE}` attribute or hyperparameter. "
            f"Keep it as `self.{_BATCH_SIZE}` (or in `save_hyperparameters()`) and build the dataloader from it"
        )
    return places


@dataclass(frozen=True)
class BenchTarget:
    """Builds the model (``DemoGPT`` for the demo) and the datamodule (``None``: the module's own) of a setting."""

    settings: BenchSettings
    model_class: type[pl.LightningModule]
    datamodule_class: type[pl.LightningDataModule] | None

    @property
    def is_demo(self) -> bool:
        """Whether this is the demo GPT."""
        return self.settings.model == DEMO

    def describe(self) -> str:
        """One line naming the model, e.g. ``"demo GPT (seq_len 512)"`` or ``"mypkg.models:Net"``."""
        if self.is_demo:
            extra = "".join(f", {key} {value}" for key, value in self.settings.model_args.items())
            return f"demo GPT (seq_len {self.settings.demo_sequence_length}{extra})"
        data = f" with {self.settings.datamodule}" if self.settings.datamodule else ""
        return f"{self.settings.model}{data}"

    def build(self, batch_size: int) -> tuple[pl.LightningModule, pl.LightningDataModule | None]:
        """A fresh ``(model, datamodule)`` yielding ``batch_size`` samples per batch; ``ValueError`` if it cannot be."""
        settings = self.settings
        if not self.is_demo:
            model = _construct(self.model_class, settings, "model")
            datamodule = _construct(self.datamodule_class, settings, "datamodule") if self.datamodule_class else None
            set_batch_size(model, datamodule, batch_size)
            return model, datamodule
        from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule

        seq_len = settings.demo_sequence_length
        assert seq_len is not None
        try:
            config = GPTConfig(seq_len=seq_len, **settings.model_args)
        except TypeError as err:
            known = ", ".join(f.name for f in fields(GPTConfig) if f.name != "seq_len")
            raise ValueError(
                f"`model_args` of the demo must be fields of GPTConfig ({known}), got {dict(settings.model_args)!r}"
            ) from err
        steps = settings.warmup + settings.steps
        datamodule = SyntheticTokenDataModule(
            batch_size,
            seq_len=seq_len,
            vocab_size=config.vocab_size,
            # one epoch holds the whole run where that stays small; longer runs reshuffle
            train_sequences=max(batch_size, min(batch_size * steps, 4096)),
            val_sequences=1,
            predict_sequences=batch_size * max(settings.warmup, settings.steps),
            seed=settings.seed,
        )
        return DemoGPT(config), datamodule


def _construct(cls: type, settings: BenchSettings, name: str) -> Any:
    """``cls(**settings.<name>_args)``; a failure names ``settings.<name>``, the class spec."""
    spec = getattr(settings, name)
    kwargs = getattr(settings, f"{name}_args")
    try:
        return cls(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's constructor may raise anything
        raise ValueError(
            f"`{name}` {spec!r}: {cls.__name__}(**{dict(kwargs)!r}) failed ({type(err).__name__}: {err}); "
            f"give its keyword arguments in `{name}_args`"
        ) from err


def load_target(settings: BenchSettings) -> BenchTarget:
    """Import and check what ``settings`` names by building it once; ``BenchRunner`` documents the errors."""
    if settings.model == DEMO:
        from lightning_tune.demos import DemoGPT

        target = BenchTarget(settings, DemoGPT, None)
    else:
        model_class = load_class(settings.model, pl.LightningModule, name="model")
        datamodule_class = None
        if settings.datamodule is not None:
            datamodule_class = load_class(settings.datamodule, pl.LightningDataModule, name="datamodule")
        target = BenchTarget(settings, model_class, datamodule_class)
    model, datamodule = target.build(settings.batch_sizes[0])
    hook = _DATA_HOOKS[settings.mode]
    if is_overridden(hook, model) or (datamodule is not None and is_overridden(hook, datamodule)):
        return target
    needs = f"`model` {settings.model!r}: mode {settings.mode!r} needs `{hook}()`"
    name = target.model_class.__name__
    if datamodule is None:
        raise ValueError(f"{needs}, which {name} does not define; define it or give a `datamodule`")
    raise ValueError(f"{needs}, which neither {name} nor {type(datamodule).__name__} defines")
