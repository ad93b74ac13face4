"""TunePlugin under the sharded strategies, on CPU: it wraps the plugin Lightning requires; what cannot work refuses."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_tune as lt
from tests.helpers import Regressor


def _deepspeed_strategy() -> DeepSpeedStrategy:
    # the class without its constructor, which needs the deepspeed package: only its type matters here
    return DeepSpeedStrategy.__new__(DeepSpeedStrategy)


def test_fsdp_strategy_accepts_the_plugin_and_it_wraps_fsdp_precision() -> None:
    plugin = lt.TunePlugin("bf16-mixed", device="cpu")
    strategy = FSDPStrategy()
    strategy.precision_plugin = plugin  # Lightning: "The FSDP strategy can only work with the `FSDPPrecision` plugin"
    assert strategy.precision_plugin is plugin
    plugin._setup_for(strategy)
    assert type(plugin.inner) is FSDPPrecision
    # what FSDPStrategy reads when it wraps the model: the same as Trainer(strategy="fsdp", precision="bf16-mixed")
    reference = FSDPPrecision("bf16-mixed").mixed_precision_config
    assert plugin.mixed_precision_config == reference
    assert strategy.mixed_precision_config == reference


def test_deepspeed_gets_deepspeed_precision_and_the_optimizer_swap_is_refused_with_the_reason() -> None:
    plugin = lt.TunePlugin("bf16-mixed", optimizer="adamw_fused", device="cuda")
    plugin._setup_for(_deepspeed_strategy())
    assert type(plugin.inner) is DeepSpeedPrecision
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(MisconfigurationException, match="Set the optimizer in DeepSpeed's config"):
        plugin.connect(model, [optimizer], [])


@pytest.mark.parametrize(
    ("strategy", "precision", "allowed"),
    [
        pytest.param(
            ModelParallelStrategy(), "64-true", "'32-true', 'bf16-mixed', 'bf16-true', '16-true'", id="fsdp2-64"
        ),
        pytest.param(FSDPStrategy(), "64-true", "'32-true', '16-mixed', 'bf16-mixed'", id="fsdp-64"),
        pytest.param(_deepspeed_strategy(), "64-true", "'32-true', '16-mixed', 'bf16-mixed'", id="deepspeed-64"),
    ],
)
def test_precisions_a_strategy_cannot_run_are_refused_naming_those_it_can(
    strategy: object, precision: str, allowed: str
) -> None:
    plugin = lt.TunePlugin(precision, device="cpu")
    with pytest.raises(MisconfigurationException, match=re.escape(allowed)):
        plugin._setup_for(strategy)  # type: ignore[arg-type]


def test_ddp_keeps_lightnings_own_mixed_precision_plugin() -> None:
    plugin = lt.TunePlugin("bf16-mixed", device="cpu")
    plugin._setup_for(DDPStrategy())
    assert type(plugin.inner) is MixedPrecision and plugin.inner.device == "cpu"


def test_the_strategys_device_decides_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a GPU machine, training on its CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: pytest.fail("asked the GPU"))
    plugin = lt.TunePlugin()
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")])
    plugin._setup_for(strategy)
    assert plugin.precision == "32-true" and plugin.device == "cpu"
