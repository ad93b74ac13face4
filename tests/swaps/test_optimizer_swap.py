"""OptimizerSwap and its engine: 8-bit state where it belongs, groups and schedulers carried over, checkpoints."""

from __future__ import annotations

import copy
import importlib
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_tune as lt
from lightning_tune import _imports
from lightning_tune.callbacks.optimizer_swap import STATE_BYTES_KEY, OptimizerSwap
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from lightning_tune.lr import warmup_cosine_lr
from lightning_tune.swaps.optimizer import (
    TARGETS,
    estimate_state_bytes,
    optimizer_state_bytes,
    repoint_schedulers,
    swap_optimizer,
    swap_optimizers,
)
from lightning_tune.vocab import OPTIMIZERS
from tests.helpers import LRRecorder, Regressor, csv_rows, make_trainer

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # raised by torch.jit APIs bitsandbytes uses at import
    bnb = importlib.import_module("bitsandbytes") if _imports.is_available("bitsandbytes") else None
needs_bnb = pytest.mark.skipif(bnb is None, reason="needs bitsandbytes: pip install 'lightning-tune[bnb]'")

# Every weight matrix of this model has >= 4096 elements; biases and LayerNorms (3,584 elements) stay 32-bit.
BIG = GPTConfig(vocab_size=64, seq_len=64, d_model=128, n_layers=2, n_heads=4)
SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4)


def _one_step(model: DemoGPT, optimizer: torch.optim.Optimizer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (4, model.config.seq_len + 1), generator=g)
    optimizer.zero_grad()
    model._loss((tokens[:, :-1], tokens[:, 1:])).backward()
    optimizer.step()


def _embedding_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)]


def _others(model: nn.Module, exclude: list[nn.Parameter]) -> list[nn.Parameter]:
    ids = {id(p) for p in exclude}
    return [p for p in model.parameters() if id(p) not in ids]


# ---------------------------------------------------------------------------------------------- the engine


class _Holder(nn.Module):
    """Some class of the user's that happens to own an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(100, 64)
        self.bag = nn.EmbeddingBag(80, 64)


class _TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.holder = _Holder()
        self.body = nn.Linear(64, 128)
        self.out = nn.Linear(128, 100, bias=False)
        self.head = nn.Linear(64, 100, bias=False)
        self.head.weight = self.holder.table.weight  # tied: one Parameter, owned by the Embedding and by a Linear

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.holder.table(ids) + self.holder.bag(ids).unsqueeze(1)
        return self.head(x) + self.out(self.body(x))


@needs_bnb
def test_swapped_state_is_uint8_for_large_params_and_float32_for_embeddings_tied_ones_included() -> None:
    net = _TiedNet()
    result = swap_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), optimizer="adamw8bit", module=net)
    assert type(result.new) is bnb.optim.AdamW8bit
    ids = torch.randint(0, 80, (4, 6))
    net(ids).square().mean().backward()
    result.new.step()
    embedding_ids = {id(net.holder.table.weight), id(net.holder.bag.weight)}
    assert sorted(result.kept_32bit) == ["head.weight", "holder.bag.weight", "holder.table.weight"]
    for name, param in net.named_parameters():
        state = result.new.state[param]
        if id(param) in embedding_ids:
            assert param.numel() >= 4096
            assert state["state1"].dtype == state["state2"].dtype == torch.float32, name
            assert "absmax1" not in state
        elif param.numel() >= 4096:
            assert state["state1"].dtype == state["state2"].dtype == torch.uint8, name
            assert state["absmax1"].dtype == state["absmax2"].dtype == torch.float32
            assert state["absmax1"].numel() == -(-param.numel() // 256)
        else:
            assert state["state1"].dtype == torch.float32, name


@needs_bnb
def test_non_embedding_state_of_the_demo_gpt_is_at_most_30_percent_of_torch_adamw() -> None:
    torch.manual_seed(0)
    reference = DemoGPT(BIG)
    adamw = reference.configure_optimizers()
    assert estimate_state_bytes(adamw) is not None
    _one_step(reference, adamw)
    torch.manual_seed(0)
    model = DemoGPT(BIG)
    result = swap_optimizer(model.configure_optimizers(), optimizer="adamw8bit", module=model)
    _one_step(model, result.new)

    torch_bytes = optimizer_state_bytes(adamw, _others(reference, _embedding_params(reference)))
    bnb_bytes = optimizer_state_bytes(result.new, _others(model, _embedding_params(model)))
    # exactly: 2 uint8 states + 2 float32 absmax per 256 elements for large tensors, the two shared 256-entry
    # quantization maps once, and 2 float32 states for small tensors; torch: 2 float32 states + a float32 step each
    large = [p for p in _others(model, _embedding_params(model)) if p.numel() >= 4096]
    small = [p for p in _others(model, _embedding_params(model)) if p.numel() < 4096]
    expected = (
        sum(2 * p.numel() + 8 * -(-p.numel() // 256) for p in large) + 2 * 256 * 4 + sum(8 * p.numel() for p in small)
    )
    assert bnb_bytes == expected == 846_080
    others = _others(reference, _embedding_params(reference))
    assert torch_bytes == sum(8 * p.numel() + 4 for p in others) == 3_240_044
    assert bnb_bytes / torch_bytes == pytest.approx(0.2611, abs=1e-4)
    assert bnb_bytes <= 0.30 * torch_bytes
    # the callback's "before" estimate is torch's exact footprint
    assert estimate_state_bytes(adamw) == optimizer_state_bytes(adamw) == 3_371_124


def _two_group_model() -> tuple[nn.Module, list[dict[str, Any]]]:
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    groups = [
        {"params": list(net[0].parameters()), "lr": 0.1, "weight_decay": 0.05, "name": "first"},
        {"params": list(net[2].parameters()), "lr": 0.01, "weight_decay": 0.0, "betas": (0.8, 0.9), "eps": 1e-6},
    ]
    return net, groups


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("adamw8bit", marks=needs_bnb),
        pytest.param("adam8bit", marks=needs_bnb),
        pytest.param("paged_adamw8bit", marks=needs_bnb),
        "adamw_fused",
    ],
)
def test_every_group_and_hyperparameter_is_carried_over_and_the_update_matches_torch(name: str) -> None:
    torch.manual_seed(0)
    net, groups = _two_group_model()
    reference = copy.deepcopy(net)
    old = torch.optim.AdamW(groups, betas=(0.85, 0.98))
    ref_opt = torch.optim.AdamW(
        [{**g, "params": list(m.parameters())} for g, m in zip(groups, [reference[0], reference[2]], strict=True)],
        betas=(0.85, 0.98),
    )
    # min_8bit_size above every tensor: 32-bit state, so the update must equal torch's step for step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # paged optimizers on CPU fall back, with a warning
        result = swap_optimizer(old, optimizer=name, module=net, min_8bit_size=10**6)
    assert result.changes == ()
    for old_group, new_group in zip(old.param_groups, result.new.param_groups, strict=True):
        assert all(a is b for a, b in zip(old_group["params"], new_group["params"], strict=True))
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert new_group[key] == old_group[key], key
    assert result.new.param_groups[0]["name"] == "first"
    assert [g["lr"] for g in result.new.param_groups] == [0.1, 0.01]
    assert result.new.param_groups[1]["betas"] == (0.8, 0.9)
    x = torch.randn(16, 8)
    for _ in range(5):
        for model, opt in ((net, result.new), (reference, ref_opt)):
            opt.zero_grad()
            model(x).square().mean().backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                opt.step()
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_bnb
def test_sgd_momentum_maps_to_bitsandbytes_betas_and_matches_torch_sgd() -> None:
    torch.manual_seed(0)
    net, _ = _two_group_model()
    reference = copy.deepcopy(net)
    old = torch.optim.SGD(
        [{"params": net[0].parameters(), "momentum": 0.5}, {"params": net[2].parameters()}],
        lr=0.1,
        momentum=0.9,
        weight_decay=0.01,
    )
    ref_opt = torch.optim.SGD(
        [{"params": reference[0].parameters(), "momentum": 0.5}, {"params": reference[2].parameters()}],
        lr=0.1,
        momentum=0.9,
        weight_decay=0.01,
    )
    result = swap_optimizer(old, optimizer="sgd8bit", module=net, min_8bit_size=10**6)
    assert type(result.new) is bnb.optim.SGD8bit
    assert [g["betas"][0] for g in result.new.param_groups] == [0.5, 0.9]
    assert "momentum: 0.9" not in result.describe() and "0.5" in result.describe()
    x = torch.randn(16, 8)
    for _ in range(5):
        for model, opt in ((net, result.new), (reference, ref_opt)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_bnb
def test_a_swap_across_families_warns_and_lists_what_changed() -> None:
    net, _ = _two_group_model()
    old = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    with pytest.warns(UserWarning, match=r"swapping SGD into 'adamw8bit' \(AdamW8bit\) changes the algorithm") as rec:
        result = swap_optimizer(old, optimizer="adamw8bit", module=net)
    message = str(rec[0].message)
    assert "dropped (no counterpart in AdamW8bit): momentum=0.9, nesterov=True" in message
    assert "AdamW8bit defaults: betas=(0.9, 0.999), eps=1e-08" in message
    assert "weight decay" not in message  # SGD's weight_decay is 0 here
    assert result.changes[0] == "SGD -> AdamW8bit: a different algorithm; settings mapped by name"
    assert result.new.param_groups[0]["lr"] == 0.1 and result.new.param_groups[0]["weight_decay"] == 0.0
    assert "changes:" in result.describe()
    with pytest.warns(UserWarning, match=r"dropped \(no counterpart in Lion8bit\): eps=1e-08"):
        lion = swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="lion8bit", module=net)
    assert type(lion.new) is bnb.optim.Lion8bit


REFUSED = [
    pytest.param(
        lambda p: torch.optim.AdamW(p, amsgrad=True),
        "adamw8bit",
        "group 0 has amsgrad=True (AdamW8bit does not implement AMSGrad)",
        id="amsgrad",
    ),
    pytest.param(
        lambda p: torch.optim.Adam(p, weight_decay=1e-4),
        "adamw8bit",
        "group 0 has weight_decay=0.0001 applied as an L2 term added to the gradient (Adam without "
        "decoupled_weight_decay); AdamW8bit decays weights decoupled, like AdamW",
        id="adam-l2-decay",
    ),
    pytest.param(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        "sgd8bit",
        "group 0 has nesterov=True (SGD8bit does not implement Nesterov momentum)",
        id="nesterov",
    ),
    pytest.param(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
        "sgd8bit",
        "group 0 has dampening=0.1 (SGD8bit does not implement momentum dampening)",
        id="dampening",
    ),
    pytest.param(
        lambda p: torch.optim.SGD(p, lr=0.1),
        "sgd8bit",
        "group 0 has momentum=0; SGD8bit needs momentum > 0",
        id="sgd-no-momentum",
    ),
    pytest.param(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, maximize=True),
        "adamw8bit",
        "group 0 has maximize=True (AdamW8bit does not implement maximisation)",
        id="maximize-across-families",
    ),
    pytest.param(
        lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.01)),
        "adamw8bit",
        "group 0 has a tensor lr (AdamW8bit reads hyperparameters as Python numbers)",
        id="tensor-lr",
    ),
]


@needs_bnb
@pytest.mark.parametrize(("make", "name", "message"), REFUSED)
def test_settings_the_target_cannot_honour_are_errors(
    make: Callable[[Any], torch.optim.Optimizer], name: str, message: str
) -> None:
    net = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=re.escape(message)):
        swap_optimizer(make(net.parameters()), optimizer=name, module=net)


def test_fused_adamw_honours_amsgrad_and_needs_no_module() -> None:
    w = nn.Parameter(torch.zeros(10))
    result = swap_optimizer(torch.optim.Adam([w], amsgrad=True, maximize=True), optimizer="adamw_fused")
    assert type(result.new) is torch.optim.AdamW
    group = result.new.param_groups[0]
    assert group["fused"] is True and group["amsgrad"] is True and group["maximize"] is True
    assert result.kept_32bit == () and "32-bit (fused AdamW)" in result.describe()


def test_fused_adamw_falls_back_to_foreach_with_a_warning_where_fused_cannot_step() -> None:
    w = nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    with pytest.warns(UserWarning, match="torch's fused AdamW cannot step these parameters"):
        result = swap_optimizer(torch.optim.AdamW([w]), optimizer="adamw_fused")
    assert result.new.param_groups[0]["fused"] is None and result.new.param_groups[0]["foreach"] is True
    w.grad = torch.ones_like(w)
    result.new.step()


@needs_bnb
def test_already_8bit_or_stepped_optimizers_are_refused() -> None:
    net = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"`old` is already a bitsandbytes optimizer \(AdamW8bit\)"):
        swap_optimizer(bnb.optim.AdamW8bit(net.parameters()), optimizer="adamw8bit", module=net)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 4)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"already holds state for 2 parameter\(s\); swap it before its first step"):
        swap_optimizer(opt, optimizer="adamw8bit", module=net)
    with pytest.raises(ValueError, match=r"`module` must be given with keep_32bit='embeddings'"):
        swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw8bit")
    swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw8bit", keep_32bit="none")


@needs_bnb
def test_overrides_stay_private_to_the_new_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    manager_cls = bnb.optim.GlobalOptimManager
    monkeypatch.setattr(manager_cls, "_instance", None)  # a fresh singleton for this test, restored afterwards
    shared = manager_cls.get_instance()
    net = _TiedNet()
    shared.register_module_override(net.body, "weight", {"optim_bits": 32})  # the user's own global override applies
    result = swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw8bit", module=net)
    assert result.new.mng is not shared
    assert shared.pid2config == {} and shared.index2config == {}
    # the same parameter positions in another optimizer get no 32-bit override
    other = _TiedNet()
    plain = swap_optimizer(torch.optim.AdamW(other.parameters()), optimizer="adamw8bit", keep_32bit="none")
    for model, opt in ((net, result.new), (other, plain.new)):
        model(torch.randint(0, 80, (2, 3))).sum().backward()
        opt.step()
    assert result.new.state[net.body.weight]["state1"].dtype == torch.float32
    assert result.new.state[net.holder.table.weight]["state1"].dtype == torch.float32
    assert all(s["state1"].dtype == torch.uint8 for p, s in plain.new.state.items() if p.numel() >= 4096)


@needs_bnb
def test_a_freed_parameters_global_override_never_reaches_the_parameter_that_reuses_its_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bitsandbytes keys `override_config` by id() and keeps the entry after the parameter dies; CPython reuses ids."""
    manager_cls = bnb.optim.GlobalOptimManager
    monkeypatch.setattr(manager_cls, "_instance", None)  # a fresh singleton for this test, restored afterwards
    freed = nn.Linear(64, 64, bias=False)
    manager_cls.get_instance().override_config(freed.weight, "optim_bits", 32)  # 32-bit state for that weight
    stale_id = id(freed.weight)
    del freed
    net = next((n for n in (nn.Linear(64, 64, bias=False) for _ in range(10_000)) if id(n.weight) == stale_id), None)
    if net is None:
        pytest.skip("this Python did not reuse the freed parameter's id in 10,000 tries")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw8bit", module=net)
    net(torch.ones(2, 64)).sum().backward()
    result.new.step()
    assert result.new.state[net.weight]["state1"].dtype == torch.uint8  # 8-bit, as for any other new weight
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "under the id() of 1 parameter(s) being swapped (weight {'optim_bits': 32})" in said[0]


@needs_bnb
def test_keep_32bit_callable_sees_every_name_of_a_parameter() -> None:
    net = _TiedNet()
    seen: list[str] = []

    def rule(name: str, param: nn.Parameter) -> bool:
        seen.append(name)
        return name == "head.weight"

    result = swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw8bit", module=net, keep_32bit=rule)
    assert "head.weight" in seen and "holder.table.weight" in seen
    assert result.kept_32bit == ("holder.table.weight", "head.weight")
    assert result.kept_params[0] is net.head.weight


def test_repoint_copies_scheduler_keys_and_wraps_step() -> None:
    net, groups = _two_group_model()
    old = torch.optim.AdamW(groups)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(old, max_lr=[0.5, 0.05], total_steps=10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SequentialLR's own construction-time warnings
        sequential = torch.optim.lr_scheduler.SequentialLR(
            old,
            [torch.optim.lr_scheduler.ConstantLR(old), torch.optim.lr_scheduler.ExponentialLR(old, 0.9)],
            milestones=[2],
        )
    new = torch.optim.AdamW([{"params": g["params"], "lr": g["lr"]} for g in old.param_groups])
    count = repoint_schedulers([one_cycle, plateau, sequential], old, new)
    assert count == 5
    assert one_cycle.optimizer is new and plateau.optimizer is new and sequential.optimizer is new
    assert all(s.optimizer is new for s in sequential._schedulers)
    for key in ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"):
        assert [g[key] for g in new.param_groups] == [g[key] for g in old.param_groups], key
    net(torch.ones(2, 8)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden" warning
        new.step()
        one_cycle.step()
    assert new.param_groups[0]["lr"] != old.param_groups[0]["lr"]


@needs_bnb
def test_swap_optimizers_returns_new_optimizers_configs_and_results() -> None:
    net, groups = _two_group_model()
    old = torch.optim.AdamW(groups)
    sched = torch.optim.lr_scheduler.StepLR(old, step_size=1)
    new, configs, results = swap_optimizers([old], [sched], net, optimizer="adamw8bit", min_8bit_size=16)
    assert new == [results[0].new] and configs == [sched] and sched.optimizer is new[0]
    assert not results[0].restored
    results[0].restore()  # a swap undone before the first step: the scheduler drives the old optimizer again
    assert sched.optimizer is old and results[0].restored


# ---------------------------------------------------------------------------------------------- the callback


class _OptimizerProbe(Callback):
    def __init__(self) -> None:
        self.types: set[str] = set()
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.state = copy.deepcopy(trainer.optimizers[0].state_dict())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.types.add(type(optimizer).__name__)


@needs_bnb
@pytest.mark.parametrize("swap_first", [False, True])
def test_warmup_cosine_drives_the_new_optimizer(tmp_path: Path, swap_first: bool) -> None:
    rec, probe = LRRecorder(), _OptimizerProbe()
    schedule = lt.WarmupCosine(warmup_steps=3, total_steps=12)
    swap = OptimizerSwap(min_8bit_size=16)
    callbacks = [swap, schedule] if swap_first else [schedule, swap]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, [*callbacks, rec, probe], max_steps=12)
        trainer.fit(Regressor(optimizer="adamw", group_lrs=[0.1, 0.01]))
    assert not [w for w in caught if "overridden" in str(w.message) or "lr_scheduler.step()" in str(w.message)]
    assert probe.types == {"AdamW8bit"}
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is trainer.optimizers[0]
    expected = [
        [warmup_cosine_lr(s, base_lr=b, warmup_steps=3, total_steps=12) for b in (0.1, 0.01)] for s in range(12)
    ]
    assert len(rec.lrs) == 12
    for got, want in zip(rec.lrs, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12)


class _Configured(Regressor):
    """A module returning ``make(params)`` and, with ``hf_cosine``, Hugging Face's warm-up + cosine stepped per step."""

    def __init__(self, make: Callable[[Any], torch.optim.Optimizer], *, hf_cosine: bool) -> None:
        super().__init__()
        self.make, self.hf_cosine = make, hf_cosine

    def configure_optimizers(self) -> Any:
        from transformers import get_cosine_schedule_with_warmup

        opt = self.make(self.parameters())
        if not self.hf_cosine:
            return opt
        schedule = get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=12)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _lr_columns(logger: CSVLogger) -> dict[str, list[float]]:
    rows = csv_rows(logger.log_dir)
    return {k: [float(r[k]) for r in rows if r[k]] for k in rows[0] if k.startswith("lr-")}


@needs_bnb
@pytest.mark.parametrize(
    ("callbacks", "hf_cosine", "plugin"),
    [
        pytest.param(
            lambda: [OptimizerSwap(min_8bit_size=16), lt.WarmupCosine(3, total_steps=12)], False, False, id="swap-first"
        ),
        pytest.param(
            lambda: [lt.WarmupCosine(3, total_steps=12), OptimizerSwap(min_8bit_size=16)],
            False,
            False,
            id="schedule-first",
        ),
        pytest.param(lambda: [OptimizerSwap(min_8bit_size=16)], True, False, id="the-modules-own-schedule"),
        pytest.param(lambda: [lt.WarmupCosine(3, total_steps=12)], False, True, id="plugin"),
        pytest.param(lambda: [], True, True, id="plugin-and-the-modules-own-schedule"),
    ],
)
def test_the_swap_reads_the_configured_lr_in_any_order_and_trains_as_the_target_optimizer_would(
    tmp_path: Path, callbacks: Callable[[], list[Callback]], hf_cosine: bool, plugin: bool
) -> None:
    """Reference: the module itself returns AdamW8bit at lr 0.1 with Hugging Face's warm-up + cosine scheduler."""

    def run(model: LightningModule, callbacks: list[Callback], **kwargs: Any) -> tuple[LRRecorder, CSVLogger]:
        rec, logger = LRRecorder(), CSVLogger(str(tmp_path), name=f"run{len(list(tmp_path.iterdir()))}")
        trainer = make_trainer(
            tmp_path,
            [*callbacks, LearningRateMonitor(logging_interval="step"), rec],
            max_steps=12,
            logger=logger,
            log_every_n_steps=1,
            **kwargs,
        )
        trainer.fit(model)
        logger.save()
        return rec, logger

    seed_everything(0)
    target = _Configured(lambda p: bnb.optim.AdamW8bit(p, lr=0.1, weight_decay=0.0, min_8bit_size=16), hf_cosine=True)
    seed_everything(0)
    swapped = _Configured(_sgd, hf_cosine=hf_cosine)  # the same initial weights
    want, want_log = run(target, [])
    plugins = {"plugins": [lt.TunePlugin(optimizer="adamw8bit", min_8bit_size=16)]} if plugin else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_log = run(swapped, callbacks(), **plugins)
    said = "\n".join(str(w.message) for w in caught)
    # the LR the module configured, not the warm-up's 0 at the swap, is what the swap reports and warns about
    assert "carried over by name: lr=0.1, weight_decay=0" in said
    assert "lr=0.1 was chosen for SGD; AdamW8bit usually trains with a much smaller one" in said
    assert [lr for (lr,) in got.lrs] == pytest.approx([lr for (lr,) in want.lrs], rel=1e-12)
    for a, b in zip(swapped.parameters(), target.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # LearningRateMonitor logs under the module's optimizer's name, as it would without the swap, the same values
    assert _lr_columns(want_log) == {"lr-AdamW8bit": pytest.approx([lr for (lr,) in want.lrs])}
    assert _lr_columns(got_log) == {"lr-SGD": pytest.approx([lr for (lr,) in want.lrs])}


@needs_bnb
def test_a_modules_own_step_lr_steps_the_new_optimizer(tmp_path: Path) -> None:
    rec, probe = LRRecorder(), _OptimizerProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, [OptimizerSwap(min_8bit_size=16), rec, probe], max_epochs=6)
        trainer.fit(Regressor(optimizer="adamw", scheduler=True, n=8))  # 2 steps per epoch, StepLR(step_size=5)
    assert not [w for w in caught if "overridden" in str(w.message)]
    assert probe.types == {"AdamW8bit"}
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.optimizer is trainer.optimizers[0]
    assert [lrs[0] for lrs in rec.lrs] == pytest.approx([0.05] * 10 + [0.005] * 2)
    assert scheduler.last_epoch == 6 and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.005)


@needs_bnb
def test_an_alias_builds_adamw8bit_and_a_second_fit_swaps_once_again(tmp_path: Path) -> None:
    swap = OptimizerSwap("adamw_8bit", min_8bit_size=16)  # Hugging Face's `optim` spelling
    assert swap.optimizer == "adamw8bit"
    model = Regressor(optimizer="adamw", n=8)
    for _ in range(2):
        probe = _OptimizerProbe()
        trainer = make_trainer(tmp_path, [swap, probe], max_steps=2)
        trainer.fit(model)
        assert probe.types == {"AdamW8bit"}
        # each fit swaps the fresh torch AdamW that configure_optimizers built, never the 8-bit one of the last fit
        assert [type(r.old) for r in swap.results] == [torch.optim.AdamW]
        # nothing is undone at teardown: the trained 8-bit state stays where trainer.save_checkpoint reads it
        assert trainer.optimizers[0] is swap.results[0].new and optimizer_state_bytes(trainer.optimizers[0]) > 0


@needs_bnb
def test_state_bytes_are_logged_once_and_summarised(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    swap = OptimizerSwap()
    trainer = make_trainer(tmp_path, [swap], max_steps=3, logger=logger, log_every_n_steps=1)
    trainer.fit(DemoGPT(SMALL), datamodule=SyntheticTokenDataModule(4, seq_len=32, vocab_size=64))
    logger.save()
    rows = [row for row in csv_rows(logger.log_dir) if row.get(STATE_BYTES_KEY)]
    assert len(rows) == 1
    assert float(rows[0][STATE_BYTES_KEY]) == swap.state_bytes_after == optimizer_state_bytes(trainer.optimizers[0])
    assert swap.state_bytes_before == estimate_state_bytes(swap.results[0].old)
    assert swap.state_bytes_after is not None and swap.state_bytes_before is not None
    assert swap.state_bytes_after < 0.35 * swap.state_bytes_before
    assert swap.summary().startswith("OptimizerSwap: optimizer state 0.") and "(AdamW: " in swap.summary()


class _Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.values.append(float(outputs["loss"]))


def _train(tmp_path: Path, callbacks: list[Callback], steps: int) -> tuple[list[float], float]:
    seed_everything(0)
    losses = _Losses()
    start = time.perf_counter()
    make_trainer(tmp_path, [*callbacks, losses], max_steps=steps).fit(
        DemoGPT(SMALL), datamodule=SyntheticTokenDataModule(16, seq_len=32, vocab_size=64, train_sequences=2048)
    )
    return losses.values, time.perf_counter() - start


@needs_bnb
@pytest.mark.slow
def test_adamw8bit_trains_the_demo_gpt_as_well_as_torch_adamw(tmp_path: Path) -> None:
    reference, t_ref = _train(tmp_path, [], 100)
    swapped, t_swap = _train(tmp_path, [OptimizerSwap("adamw8bit")], 100)
    final_ref, final_swap = sum(reference[-20:]) / 20, sum(swapped[-20:]) / 20
    print(f"AdamW {final_ref:.4f} in {t_ref:.1f}s; AdamW8bit {final_swap:.4f} in {t_swap:.1f}s")
    assert final_ref < 0.5 * reference[0]  # it learned
    assert reference != swapped  # the 8-bit states really were used
    assert abs(final_swap - final_ref) <= 0.05 * final_ref


@needs_bnb
def test_checkpoint_round_trip_restores_the_8bit_state(tmp_path: Path) -> None:
    datamodule = SyntheticTokenDataModule(4, seq_len=32, vocab_size=64, train_sequences=20)  # 5 steps per epoch
    first = make_trainer(tmp_path, [OptimizerSwap()], max_steps=5)
    first.fit(DemoGPT(SMALL), datamodule=datamodule)
    path = tmp_path / "swap.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]

    probe = _OptimizerProbe()
    resumed = make_trainer(tmp_path, [OptimizerSwap(), probe], max_steps=8)
    resumed.fit(DemoGPT(SMALL), datamodule=datamodule, ckpt_path=str(path))
    assert resumed.global_step == 8 and probe.types == {"AdamW8bit"}
    assert probe.state is not None
    _assert_equal(probe.state, saved)
    quant = [s["__bnb_optimizer_quant_state__"] for s in probe.state["state"].values()]
    assert any(q["state1"].dtype == torch.uint8 for q in quant) and any(
        q["state1"].dtype == torch.float32 for q in quant
    )
    assert all(s["step"] == 8 for s in resumed.optimizers[0].state.values())


def _assert_equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_equal(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_equal(a, b)
    else:
        assert got == want


@needs_bnb
def test_resuming_a_torch_checkpoint_with_a_swap_is_refused(tmp_path: Path) -> None:
    datamodule = SyntheticTokenDataModule(4, seq_len=32, vocab_size=64, train_sequences=64)
    first = make_trainer(tmp_path, [], max_steps=2)
    first.fit(DemoGPT(SMALL), datamodule=datamodule)
    first.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(MisconfigurationException, match="the checkpoint holds the state of a torch optimizer"):
        make_trainer(tmp_path, [OptimizerSwap()], max_steps=4).fit(
            DemoGPT(SMALL), datamodule=datamodule, ckpt_path=str(tmp_path / "plain.ckpt")
        )


# ---------------------------------------------------------------------------------------------- inputs


def test_missing_bitsandbytes_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec, real_import = importlib.util.find_spec, importlib.import_module

    def find_spec(name: str, *args: Any) -> Any:
        return None if name.split(".")[0] == "bitsandbytes" else real_find_spec(name, *args)

    def import_module(name: str, *args: Any) -> Any:
        if name.split(".")[0] == "bitsandbytes":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(_imports.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(_imports.importlib, "import_module", import_module)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # imported above; None marks it missing, as Python does
    extra = re.escape("OptimizerSwap needs the optional package `bitsandbytes`, which is not installed. ")
    extra += re.escape("Install it with: pip install 'lightning-tune[bnb]'")
    with pytest.raises(ModuleNotFoundError, match=extra):
        OptimizerSwap()
    with pytest.raises(ModuleNotFoundError, match=extra):
        OptimizerSwap("paged_lion8bit")
    net = nn.Linear(2, 2)
    with pytest.raises(ModuleNotFoundError, match=extra):
        swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw8bit", module=net)
    OptimizerSwap("adamw_fused")  # needs no bitsandbytes
    swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw_fused")


ALLOWED = ", ".join(repr(name) for name in OPTIMIZERS if name in TARGETS)  # the vocabulary's order
ALIASES = (
    "(or an alias: 'adam_8bit', 'adamw_8bit', 'adamw_bnb_8bit', 'adamw_torch_fused', 'lion_8bit', 'paged_adam_8bit', "
    "'paged_adamw_8bit', 'paged_lion_8bit', 'sgd_8bit')"
)

BAD_INPUTS = [
    pytest.param(
        lambda: OptimizerSwap("adam"),
        ValueError,
        f"`optimizer` must be one of {ALLOWED} {ALIASES}, got 'adam'",
        id="unknown-optimizer",
    ),
    pytest.param(
        lambda: OptimizerSwap("adamw"),
        ValueError,
        f"`optimizer` must be one of {ALLOWED} {ALIASES}, got 'adamw'; 'adamw' is an optimizer but not one this "
        "accepts",
        id="module-own-optimizer",
    ),
    pytest.param(
        lambda: OptimizerSwap(torch.optim.AdamW),  # type: ignore[arg-type]
        TypeError,
        "`optimizer` must be a string naming an optimizer, got <class 'torch.optim.adamw.AdamW'> (type)",
        id="optimizer-class",
    ),
    pytest.param(
        lambda: OptimizerSwap(min_8bit_size=0),
        ValueError,
        "`min_8bit_size` must be an integer >= 1, got 0",
        id="min-size-zero",
    ),
    pytest.param(
        lambda: OptimizerSwap(min_8bit_size=4096.0),  # type: ignore[arg-type]
        TypeError,
        "`min_8bit_size` must be an integer, got 4096.0 (float)",
        id="min-size-float",
    ),
    pytest.param(
        lambda: OptimizerSwap(keep_32bit=3),  # type: ignore[arg-type]
        TypeError,
        "`keep_32bit` must be one of 'embeddings', 'none' or a callable (name, param) -> bool, got 3 (int)",
        id="keep-wrong-type",
    ),
    pytest.param(
        lambda: OptimizerSwap(keep_32bit="all"),  # type: ignore[arg-type]
        ValueError,
        "`keep_32bit` must be one of 'embeddings', 'none', got 'all'",
        id="keep-unknown-name",
    ),
    pytest.param(
        lambda: swap_optimizer(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), optimizer="lion"),  # type: ignore[arg-type]
        ValueError,
        f"`optimizer` must be one of {ALLOWED} {ALIASES}, got 'lion'",
        id="engine-unknown-optimizer",
    ),
    pytest.param(
        lambda: swap_optimizer("adamw", optimizer="adamw8bit"),  # type: ignore[arg-type]
        TypeError,
        "`old` must be a torch.optim.Optimizer, got 'adamw' (str)",
        id="engine-not-an-optimizer",
    ),
    pytest.param(
        lambda: swap_optimizer(
            torch.optim.AdamW([nn.Parameter(torch.zeros(1))]),
            optimizer="adamw8bit",
            module="net",  # type: ignore[arg-type]
        ),
        TypeError,
        "`module` must be a torch.nn.Module or None, got 'net' (str)",
        id="engine-module-type",
    ),
]


@pytest.mark.parametrize(("build", "error", "message"), BAD_INPUTS)
def test_bad_inputs_fail_with_a_message_naming_argument_value_and_rule(
    build: Callable[[], Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


def _tiny_llama_with_lora() -> nn.Module:
    peft = pytest.importorskip("peft", reason="needs peft (in the dev extra)")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    return peft.get_peft_model(LlamaForCausalLM(config), lora)


def _train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
    optimizer.step()


@needs_bnb
def test_lora_adapters_under_min_8bit_size_are_reported_as_saving_nothing_and_frozen_params_counted_apart() -> None:
    model = _tiny_llama_with_lora()
    adapters = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert adapters and max(p.numel() for p in adapters) == 512 and frozen
    old = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the module passes its frozen weights too, as many do
    with pytest.warns(UserWarning, match="stores no optimizer state in 8 bits") as rec:
        result = swap_optimizer(old, optimizer="adamw8bit", module=model)
    message = str(rec[0].message)
    assert f"of the {len(adapters)} trainable tensor(s), {len(adapters)} are under min_8bit_size=4,096" in message
    assert f"({len(frozen)} frozen tensor(s) get no state at all)" in message
    assert "pass min_8bit_size=512 (or lower)" in message
    buckets = result.state_buckets()
    assert buckets["8-bit"] == [] and len(buckets["no state (frozen)"]) == len(frozen)
    rows = {line.split("  ")[0]: line.split() for line in result.describe().splitlines()}
    assert rows["8-bit"][1] == "0"
    assert rows["no state (frozen)"][3] == str(len(frozen))
    _train_one_step(model, result.new)  # bitsandbytes' own state says the same: nothing uint8, no frozen state
    assert {id(p) for p in result.new.state} == {id(p) for p in adapters}
    assert all(state["state1"].dtype == torch.float32 for state in result.new.state.values())

    # The advice holds: at the suggested min_8bit_size the adapters get 8-bit state.
    model = _tiny_llama_with_lora()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowered = swap_optimizer(
            torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
            optimizer="adamw8bit",
            module=model,
            min_8bit_size=512,
        )
    _train_one_step(model, lowered.new)
    assert lowered.state_buckets()["no state (frozen)"] == []
    assert all(state["state1"].dtype == torch.uint8 for state in lowered.new.state.values())


@needs_bnb
def test_nothing_in_8bit_is_said_in_the_callback_summary() -> None:
    net = nn.Linear(8, 8)
    with pytest.warns(UserWarning, match="stores no optimizer state in 8 bits"):
        result = swap_optimizer(torch.optim.AdamW(net.parameters()), optimizer="adamw8bit", module=net)
    swap = OptimizerSwap()
    swap.results, swap.state_bytes_before, swap.state_bytes_after = [result], 1000, 999
    assert swap.summary().endswith(
        "(AdamW: 0.00 MiB, 99.9%; nothing is stored in 8 bits: every trainable tensor is under `min_8bit_size` or "
        "kept 32-bit)"
    )


@needs_bnb
def test_an_sgd_learning_rate_carried_into_adamw8bit_gets_advice() -> None:
    net, _ = _two_group_model()
    with pytest.warns(UserWarning, match="changes the algorithm") as rec:
        swap_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), optimizer="adamw8bit", module=net)
    assert (
        "group 0: lr=0.1 was chosen for SGD; AdamW8bit usually trains with a much smaller one (its default is 0.001)"
    ) in str(rec[0].message)
    with warnings.catch_warnings(record=True) as quiet:  # an LR already in Adam's range gets no advice
        warnings.simplefilter("always")
        swap_optimizer(torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9), optimizer="adamw8bit", module=net)
    assert not any("was chosen for SGD" in str(w.message) for w in quiet)
