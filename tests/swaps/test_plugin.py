"""TunePlugin through ``Trainer(plugins=[...])``: precision delegated to Lightning's own plugins, swaps applied."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision

import lightning_tune as lt
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from lightning_tune.plugins import tune
from tests.helpers import Regressor, make_trainer

SMALL = GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32)


def _data() -> SyntheticTokenDataModule:
    return SyntheticTokenDataModule(8, seq_len=SMALL.seq_len, vocab_size=SMALL.vocab_size, seed=0)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    ("precision", "alias"),
    [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true"), ("bf16-mixed", "bf16")],
)
@pytest.mark.slow
def test_plugin_without_swaps_trains_exactly_like_trainer_precision(tmp_path: Path, precision: str, alias: str) -> None:
    torch.manual_seed(0)
    reference = DemoGPT(SMALL)
    ours = DemoGPT(SMALL)
    ours.load_state_dict(reference.state_dict())
    torch.manual_seed(1)  # same shuffling in both runs
    make_trainer(tmp_path, [], max_steps=5, precision=precision).fit(reference, datamodule=_data())
    torch.manual_seed(1)
    trainer = make_trainer(tmp_path, [], max_steps=5, plugins=[lt.TunePlugin(alias)])  # type: ignore[arg-type]
    trainer.fit(ours, datamodule=_data())
    assert trainer.precision == precision
    for key, value in _weights(reference).items():
        torch.testing.assert_close(_weights(ours)[key], value, rtol=0, atol=0)


def test_auto_precision_on_cpu_is_full_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    plugin = lt.TunePlugin()
    assert plugin.precision == "32-true" and type(plugin.inner) is Precision
    assert isinstance(lt.TunePlugin("bf16").inner, MixedPrecision)


def test_auto_precision_is_decided_in_the_training_process_not_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    # a GPU machine: every CUDA query is recorded; constructing the plugin (and the Trainer) must make none that
    # initialises CUDA, or ddp_fork / ddp_notebook cannot start their processes
    calls: list[str] = []

    def bf16_supported(*args: object, **kwargs: object) -> bool:
        calls.append("is_bf16_supported")
        return True

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    plugin = lt.TunePlugin()
    Trainer(accelerator="cpu", plugins=[plugin], logger=False)
    assert calls == [] and not torch.cuda.is_initialized()
    assert repr(plugin) == "TunePlugin(precision='auto', optimizer=None, attention=None)"
    # once in the training process, the strategy's device decides: the CPU gets full precision, without a GPU query
    module = Regressor()
    trainer = make_trainer(Path("."), [], max_steps=1, plugins=[plugin])
    module.trainer = trainer
    plugin.convert_module(module)
    assert plugin.precision == "32-true" and calls == []
    # a CUDA device asks the GPU, once
    gpu = lt.TunePlugin()
    assert gpu.precision == "bf16-mixed" and gpu.device == "cuda" and calls == ["is_bf16_supported"]


def test_aliases_are_accepted_and_shown_by_their_canonical_name() -> None:
    plugin = lt.TunePlugin("fp16", optimizer="adamw_torch_fused", attention="flash_attention_2")  # type: ignore[arg-type]
    assert repr(plugin) == "TunePlugin(precision='16-mixed', optimizer='adamw_fused', attention='flash')"
    assert repr(lt.TunePlugin("bf16")) == repr(lt.TunePlugin("bf16-mixed"))  # type: ignore[arg-type]


def test_repr_is_plain_and_only_the_conflict_error_carries_the_hint() -> None:
    plugin = lt.TunePlugin("bf16-mixed", optimizer="adamw_fused")
    plain = "TunePlugin(precision='bf16-mixed', optimizer='adamw_fused', attention=None)"
    assert repr(plugin) == str(plugin) == f"{plugin}" == plain
    with pytest.raises(ValueError) as error:
        Trainer(precision="bf16-mixed", plugins=[plugin], logger=False)
    assert str(error.value) == (
        f"Received both `precision=bf16-mixed` and `plugins={plain} (give the precision to TunePlugin(precision=...), "
        "not to Trainer)`. Choose one."
    )


def test_swaps_through_the_plugin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    plugin = lt.TunePlugin("bf16-mixed", optimizer="adamw8bit", attention="sdpa")
    model = DemoGPT(SMALL)
    originals = {name: m.forward for name, m in model.named_modules()}
    trainer = make_trainer(tmp_path, [lt.WarmupCosine(warmup_steps=2)], max_steps=6, plugins=[plugin])
    trainer.fit(model, datamodule=_data())
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, bnb.optim.AdamW8bit)
    # the schedule was installed on the swapped optimizer and followed
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert plugin.attention_swap is None  # restored at teardown
    assert {name: m.forward for name, m in model.named_modules()} == originals


def test_scheduler_returned_by_the_module_follows_the_swapped_optimizer(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    plugins = [lt.TunePlugin("32-true", optimizer="adamw8bit")]
    trainer = make_trainer(tmp_path, [], max_epochs=11, limit_train_batches=2, plugins=plugins)
    module = Regressor(optimizer="adamw", lr=0.1, scheduler=True)  # StepLR(step_size=5) per epoch, gamma 0.1
    trainer.fit(module)
    optimizer = trainer.optimizers[0]
    assert type(optimizer).__name__ == "AdamW8bit"
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**2)  # stepped at epochs 5 and 10


def test_checkpoint_round_trip_with_swaps(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")

    def trainer(steps: int) -> Trainer:
        return make_trainer(tmp_path, [], max_steps=steps, plugins=[lt.TunePlugin("bf16-mixed", optimizer="adamw8bit")])

    first = trainer(4)
    first.fit(DemoGPT(SMALL), datamodule=_data())
    path = tmp_path / "swapped.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
    resumed = trainer(6)
    resumed.fit(DemoGPT(SMALL), datamodule=_data(), ckpt_path=path)
    assert resumed.global_step == 6
    assert type(resumed.optimizers[0]).__name__ == "AdamW8bit"
    # the 8-bit state was loaded and then advanced: same keys and dtypes as saved
    state = resumed.optimizers[0].state_dict()["state"]
    assert set(state) == set(saved)
    # loaded, not started afresh: every parameter's step count continues from the checkpoint's 4
    assert {int(entry["step"]) for entry in saved.values()} == {4}
    assert {int(entry["step"]) for entry in state.values()} == {6}
    for index, entry in saved.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert state[index][key].dtype == value.dtype


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"precision": "fp8"}, ValueError, "`precision` must be one of 'auto', '32-true'", id="precision"),
        pytest.param({"optimizer": "adam16"}, ValueError, "`optimizer` must be one of", id="optimizer"),
        pytest.param(
            {"optimizer": "adamw"},
            ValueError,
            "`optimizer` must be one of 'adamw_fused', 'adam8bit', 'adamw8bit', 'lion8bit', 'sgd8bit',",
            id="not-a-swap",
        ),
        pytest.param(
            {"precision": "transformer-engine"},
            ValueError,
            "got 'transformer-engine'; 'transformer-engine' is a precision but not one this accepts",
            id="transformer-engine",
        ),
        pytest.param(
            {"attention": "fast"},
            ValueError,
            "`attention` must be one of 'auto', 'flash', 'sdpa', 'eager'",
            id="attention",
        ),
        pytest.param({"min_8bit_size": 0}, ValueError, "`min_8bit_size` must be an integer >= 1, got 0", id="min-size"),
        pytest.param({"device": "tpu"}, ValueError, "`device` must be one of 'cuda', 'cpu', got 'tpu'", id="device"),
        pytest.param(
            {"precision": "16-mixed", "device": "cpu"}, ValueError, "'16-mixed' needs a CUDA GPU", id="fp16-cpu"
        ),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        lt.TunePlugin(**kwargs)


def test_missing_bitsandbytes_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_tune import _imports

    real = _imports.importlib.import_module

    def fake(name: str, *args: object) -> object:
        if name == "bitsandbytes":
            raise ModuleNotFoundError("No module named 'bitsandbytes'", name="bitsandbytes")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_imports.importlib, "import_module", fake)
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'lightning-tune[bnb]'")):
        lt.TunePlugin("32-true", optimizer="adamw8bit")


def test_auto_read_before_the_strategy_is_known_gives_way_to_the_strategys_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a GPU machine, training on its CPU ...
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    plugin = lt.TunePlugin()
    assert plugin.precision == "bf16-mixed"  # ... read early, as a callback's `setup` does: only a guess
    trainer = make_trainer(tmp_path, [], max_steps=1, plugins=[plugin])
    trainer.fit(DemoGPT(SMALL), datamodule=_data())
    assert trainer.precision == "32-true" and type(plugin.inner) is Precision and plugin.device == "cpu"


def test_mixed_precision_follows_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a GPU machine ...
    plugin = lt.TunePlugin("bf16-mixed")
    assert plugin.device == "cuda"
    plugin.connect(torch.nn.Linear(2, 2), [], [])  # ... training on the CPU (the strategy placed the model there)
    assert plugin.inner.device == "cpu"
    pinned = lt.TunePlugin("bf16-mixed", device="cuda")
    pinned.connect(torch.nn.Linear(2, 2), [], [])
    assert pinned.inner.device == "cuda"  # an explicit device is kept


def test_loss_scale_moves_between_trainer_precision_and_the_plugin() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plugin = lt.TunePlugin("bf16-mixed", device="cpu")
    plugin.inner = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    checkpoint: dict = {}
    plugin.on_save_checkpoint(checkpoint)
    assert checkpoint["MixedPrecision"]["scale"] == 1024.0  # readable by Trainer(precision="16-mixed")
    # a checkpoint written by Trainer(precision="16-mixed") holds only the "MixedPrecision" entry
    fresh = lt.TunePlugin("bf16-mixed", device="cpu")
    fresh.inner = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0))
    fresh.on_load_checkpoint({"MixedPrecision": {**checkpoint["MixedPrecision"], "scale": 512.0}})
    assert fresh.inner.scaler.get_scale() == 512.0


@pytest.mark.parametrize(
    "hook",
    [
        "post_backward",
        "unscale_gradients",
        "main_params",
        "train_step_context",
        "val_step_context",
        "test_step_context",
        "predict_step_context",
    ],
)
def test_the_hooks_the_plugin_does_not_delegate_are_precisions_own_in_every_plugin_it_wraps(hook: str) -> None:
    """TunePlugin inherits these hooks rather than delegating them: right only while no wrapped plugin overrides one."""
    wrapped = {getattr(tune, name) for name in re.findall(r"return (\w+)\(", inspect.getsource(tune._inner_plugin))}
    assert {MixedPrecision, Precision} < wrapped  # the source was read: every class the plugin can wrap
    for cls in wrapped | {FSDPPrecision}:
        assert getattr(cls, hook) is getattr(Precision, hook), f"{cls.__name__} overrides {hook}: delegate it"
