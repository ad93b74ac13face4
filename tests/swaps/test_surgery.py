"""Module surgery and its callbacks: activation checkpointing, torch.compile in place, the one base that swaps in
``setup`` and undoes in ``teardown``, and the DeepSpeed strategy built from a plan."""

from __future__ import annotations

import copy
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import deepspeed as lightning_deepspeed
from torch import nn

from lightning_tune import _surgery
from lightning_tune.callbacks import (
    ActivationCheckpointing,
    AttentionSwap,
    OptimizerSwap,
    SurgeryCallback,
    TorchCompile,
)
from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule
from lightning_tune.plugins import DeepSpeedSettings, deepspeed_settings, deepspeed_strategy
from lightning_tune.swaps import checkpoint_blocks, compile_modules
from tests.helpers import Regressor, make_trainer

TINY = GPTConfig(d_model=32, n_layers=2, seq_len=16, vocab_size=32)


def instance_forwards(module: nn.Module) -> dict[str, Any]:
    return {name: vars(child)["forward"] for name, child in module.named_modules() if "forward" in vars(child)}


# ----------------------------------------------------------------------------------------- the surgery callback base

SURGERY_CALLBACKS = [
    pytest.param(lambda: ActivationCheckpointing(verbose=False), ["model.blocks.0", "model.blocks.1"], id="checkpoint"),
    pytest.param(lambda: TorchCompile(backend="eager", verbose=False), ["model"], id="compile"),
    pytest.param(
        lambda: AttentionSwap("sdpa", verbose=False), ["model.blocks.0.attn", "model.blocks.1.attn"], id="attn"
    ),
]


@pytest.mark.parametrize(("make", "paths"), SURGERY_CALLBACKS)
@pytest.mark.slow
def test_surgery_callbacks_swap_in_setup_undo_in_teardown_and_never_stack(
    make: Any, paths: list[str], tmp_path: Any
) -> None:
    model = DemoGPT(TINY)
    callback = make()
    assert isinstance(callback, SurgeryCallback)
    trainer = make_trainer(tmp_path, [])
    callback.setup(trainer, model, "fit")
    first = instance_forwards(model)
    assert sorted(first) == paths
    callback.setup(trainer, model, "fit")  # a setup without its teardown (an interrupted run): start afresh
    again = instance_forwards(model)
    assert sorted(again) == paths
    for wrapper in again.values():  # each wrap runs the class's forward, never an earlier wrap
        assert not isinstance(wrapper, _surgery.InstanceForward) or wrapper.original is None
    callback.teardown(trainer, model, "fit")
    assert instance_forwards(model) == {} and callback.result is None

    seen: list[list[str]] = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            seen.append(sorted(instance_forwards(pl_module)))

    for _ in range(2):  # a second fit with the same callback swaps again, once
        trainer = make_trainer(tmp_path, [callback, Probe()], max_steps=1)
        trainer.fit(model, datamodule=SyntheticTokenDataModule(2, seq_len=16, vocab_size=32, train_sequences=8))
        assert instance_forwards(model) == {} and callback.result is None
    assert seen == [paths, paths]


#: Lightning's callback hooks that run every batch
STEP_HOOKS = {
    f"on_{hook}"
    for hook in ("before_backward", "after_backward", "before_optimizer_step", "before_zero_grad")
    + tuple(
        f"{stage}_batch_{when}" for stage in ("train", "validation", "test", "predict") for when in ("start", "end")
    )
}


class _Dispatched(PassThroughProfiler):
    """Records the callback hooks Lightning dispatches (each inside a profiler action ``[Callback]<key>.<hook>``)."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[str] = []

    def start(self, action_name: str) -> None:
        self.actions.append(action_name)


@pytest.mark.slow
def test_swap_callbacks_get_no_per_batch_hook_calls_and_a_subclass_hook_still_runs(tmp_path: Any) -> None:
    """Lightning skips the swap callbacks in every step (it dispatches a hook only when it is callable, checked on
    Lightning 2.6.6): the test fails if Lightning starts dispatching them again or calling a ``None`` hook."""
    ran: list[int] = []

    class Counting(AttentionSwap):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            ran.append(batch_idx)

    profiler = _Dispatched()
    callbacks = [ActivationCheckpointing(verbose=False), OptimizerSwap("adamw_fused"), Counting("sdpa", verbose=False)]
    trainer = make_trainer(tmp_path, callbacks, max_steps=3, limit_val_batches=1, val_check_interval=3)
    trainer.profiler = profiler
    data = SyntheticTokenDataModule(2, seq_len=16, vocab_size=32, train_sequences=8, val_sequences=2)
    trainer.fit(DemoGPT(TINY), datamodule=data)
    dispatched = {tuple(a[len("[Callback]") :].rsplit(".", 1)) for a in profiler.actions if a.startswith("[Callback]")}
    assert ("OptimizerSwap", "on_fit_start") in dispatched and ("ActivationCheckpointing", "setup") in dispatched
    step_hooks = {(owner.rsplit(".", 1)[-1], hook) for owner, hook in dispatched if hook in STEP_HOOKS}
    assert step_hooks == {("Counting", "on_train_batch_end")}
    assert ran == [0, 1, 2]
    assert callbacks[1].state_bytes_after is not None  # OptimizerSwap still reports after the first step


def test_surgery_callback_prints_what_it_changed(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import lightning_tune.callbacks.surgery as surgery

    printed: list[str] = []
    monkeypatch.setattr(surgery, "rank_zero_info", printed.append)
    model = DemoGPT(TINY)
    for callback in (ActivationCheckpointing(), ActivationCheckpointing(verbose=False)):
        callback.setup(make_trainer(tmp_path, []), model, "fit")
        callback.teardown(make_trainer(tmp_path, []), model, "fit")
    assert printed == [
        "Activation checkpointing: 2 module(s)\n  Block via torch.utils.checkpoint: model.blocks.0, model.blocks.1"
    ]


# ------------------------------------------------------------------------------------------ activation checkpointing


def encoder(layers: int = 4, dropout: float = 0.1) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=dropout, batch_first=True)
    return nn.Sequential(nn.Linear(8, 16), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False))


def grads_and_saved_bytes(model: nn.Module, x: torch.Tensor, seed: int = 0) -> tuple[list[torch.Tensor], int]:
    """Gradients of a sum loss, and the bytes autograd keeps for backward (what activation memory is made of)."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    model.zero_grad()
    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], saved  # type: ignore[union-attr]


@pytest.mark.slow
def test_checkpointed_gradients_equal_the_original_module_and_keep_less() -> None:
    torch.manual_seed(0)
    original = encoder()
    model = copy.deepcopy(original)
    x = torch.randn(4, 32, 8)
    reference, saved_plain = grads_and_saved_bytes(original.train(), x)

    result = checkpoint_blocks(model.train())
    assert [e.path for e in result.entries] == [f"1.layers.{i}" for i in range(4)]
    grads, saved_ckpt = grads_and_saved_bytes(model, x)
    for got, want in zip(grads, reference, strict=True):  # dropout included: the RNG state is replayed
        torch.testing.assert_close(got, want)
    assert saved_ckpt < 0.35 * saved_plain, (saved_ckpt, saved_plain)

    result.restore()
    assert result.restored and "forward" not in model.get_submodule("1.layers.0").__dict__
    _, saved_after = grads_and_saved_bytes(model, x)
    assert saved_after == saved_plain


def test_finds_the_largest_list_of_identical_blocks_in_a_hand_written_model() -> None:
    model = DemoGPT(GPTConfig(d_model=32, n_layers=3, seq_len=16, vocab_size=32))
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 16))
    with checkpoint_blocks(model) as result:
        assert [(e.path, e.module_type) for e in result.entries] == [(f"model.blocks.{i}", "Block") for i in range(3)]
        got, saved = grads_and_saved_bytes(model, ids)
    want, saved_plain = grads_and_saved_bytes(reference, ids)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert saved < saved_plain


def test_block_types_by_class_or_name_take_the_outermost_instances() -> None:
    model = encoder(layers=2)
    by_name = checkpoint_blocks(model, "TransformerEncoderLayer")
    assert [e.path for e in by_name.entries] == ["1.layers.0", "1.layers.1"]
    by_name.restore()
    by_class = checkpoint_blocks(model, nn.TransformerEncoder)
    assert [e.path for e in by_class.entries] == ["1"]
    by_class.restore()


@pytest.mark.slow
def test_hugging_face_models_use_their_own_switch_and_get_it_back() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = nn.ModuleDict({"lm": transformers.GPT2LMHeadModel(config)})
    ids = torch.randint(0, 50, (2, 16))
    reference = copy.deepcopy(model)
    with checkpoint_blocks(model) as result:
        assert [(e.path, e.method) for e in result.entries] == [("lm", "transformers")]
        got, saved = grads_and_saved_bytes(ModuleLogits(model["lm"]).train(), ids)
    want, saved_plain = grads_and_saved_bytes(ModuleLogits(reference["lm"]).train(), ids)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert saved < saved_plain
    _, saved_after = grads_and_saved_bytes(ModuleLogits(model["lm"]).train(), ids)
    assert saved_after == saved_plain


class ModuleLogits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits


def test_refuses_ddp_wrapped_modules_and_models_without_blocks() -> None:
    wrapped = nn.Module()
    wrapped.inner = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="'inner' inside Module wrapped in DataParallel. Apply it to the bare model"):
        checkpoint_blocks(wrapped)
    with pytest.raises(ValueError, match="found no transformer blocks in Linear"):
        checkpoint_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"`block_types` 'Nope' matched no module of Linear"):
        checkpoint_blocks(nn.Linear(2, 2), "Nope")


# --------------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.slow  # inductor compiles forward and backward: about 25 s on two CPU cores
def test_compiled_run_gives_the_eager_losses(tmp_path: Any) -> None:
    class Losses(Regressor):
        def __init__(self) -> None:
            super().__init__(optimizer="adamw", lr=0.01, n=12)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    runs = []
    for callbacks in ([], [TorchCompile(verbose=False)]):
        torch.manual_seed(0)
        model = Losses()
        make_trainer(tmp_path, callbacks, max_steps=3, deterministic=False).fit(model)
        runs.append(model)
    eager, compiled = runs
    assert counters["stats"]["unique_graphs"] >= 1  # something was compiled (inductor, the default backend)
    assert len(compiled.losses) == 3
    torch.testing.assert_close(compiled.losses, eager.losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compiled.net.__dict__.get("_compiled_call_impl") is None  # restored at teardown


def test_compile_keeps_parameters_and_restore_returns_to_eager() -> None:
    calls: list[int] = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls.append(1)
        return graph.forward

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # torch's own classes: nn.Module.compile() traced nothing
    params = list(model.parameters())
    parent = nn.Module()
    parent.net = model
    parent.loss = nn.MSELoss()  # no parameters: stays eager
    result = compile_modules(parent, backend=counting_backend)
    assert result.paths == ["net"] and list(model.parameters()) == params
    model(torch.randn(2, 4))
    assert len(calls) == 1
    result.restore()
    torch._dynamo.reset()
    model(torch.randn(2, 4))
    assert len(calls) == 1, "restore() did not return the module to eager"
    assert "forward" not in model.__dict__


# ------------------------------------------------------------------------------------------------------- DeepSpeed


@pytest.fixture
def lightning_without_deepspeed_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let Lightning's real DeepSpeedStrategy be built on a machine without deepspeed, to read the config it makes.

    Only the constructor runs (it builds `strategy.config` from its arguments); a stub module stands in for the
    deepspeed import, whose only use there is setting the log level.
    """
    stub = types.ModuleType("deepspeed")
    logger = types.SimpleNamespace(setLevel=lambda level: None)
    stub.utils = types.SimpleNamespace(logging=types.SimpleNamespace(logger=logger))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", stub)
    monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_AVAILABLE", True)
    monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_GREATER_EQUAL_0_16", True)
    yield


@pytest.mark.parametrize(
    ("plan", "zero"),
    [
        pytest.param(
            (2, True, False), {"stage": 2, "offload_optimizer": "cpu", "offload_param": None}, id="stage2-opt"
        ),
        pytest.param(
            (3, True, True), {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}, id="stage3-all"
        ),
        pytest.param((1, False, False), {"stage": 1, "offload_optimizer": None, "offload_param": None}, id="stage1"),
    ],
)
def test_strategy_from_a_plan_gives_lightnings_zero_config(
    lightning_without_deepspeed_check: None, plan: tuple[int, bool, bool], zero: dict[str, Any]
) -> None:
    stage, optimizer, parameters = plan
    zero_plan = types.SimpleNamespace(stage=stage, offload_optimizer=optimizer, offload_parameters=parameters)
    strategy = deepspeed_strategy(zero_plan, pin_memory=True)
    config = strategy.config["zero_optimization"]
    assert config["stage"] == zero["stage"]
    for key in ("offload_optimizer", "offload_param"):
        if zero[key] is None:
            assert key not in config
        else:
            assert config[key]["device"] == zero[key] and config[key]["pin_memory"] is True


def test_strategy_from_plan_zero_result(lightning_without_deepspeed_check: None) -> None:
    from lightning_tune.plan import estimate_memory
    from lightning_tune.plan.zero import plan_zero

    estimate = estimate_memory("llama-2-7b", sequence_length=2048, precision="bf16", gradient_checkpointing=True)
    plan = plan_zero(estimate, gpu_memory_bytes=24 * 2**30, num_gpus=1, batch_size=1)
    strategy = deepspeed_strategy(plan)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == plan.stage
    assert ("offload_optimizer" in zero) == plan.offload_optimizer
    assert ("offload_param" in zero) == plan.offload_parameters


def test_deepspeed_strategy_shows_the_arguments_of_deepspeed_settings() -> None:
    """``help(deepspeed_strategy)`` lists stage, offload and pinning, not a bare ``**settings``."""
    assert inspect.signature(deepspeed_strategy).parameters == inspect.signature(deepspeed_settings).parameters


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # an import of it now raises ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-tune\[deepspeed\]'"):
        deepspeed_strategy(stage=2)


SURGERY_BAD = [
    pytest.param(
        lambda: DeepSpeedSettings(stage=4), ValueError, "`stage` must be one of 0, 1, 2, 3, got 4", id="ds-stage"
    ),
    pytest.param(
        lambda: DeepSpeedSettings(stage=2, offload_parameters=True),
        ValueError,
        "`offload_parameters` needs ZeRO stage 3 (only stage 3 shards parameters), got stage 2",
        id="ds-param-offload-stage2",
    ),
    pytest.param(
        lambda: DeepSpeedSettings(stage=0, offload_optimizer=True),
        ValueError,
        "`offload_optimizer` needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads sharded state), got stage 0",
        id="ds-offload-stage0",
    ),
    pytest.param(
        lambda: deepspeed_settings(types.SimpleNamespace(stage=2, offload_optimizer=True)),
        TypeError,
        "`plan` must have the fields stage, offload_optimizer and offload_parameters (like ZeroPlan); "
        "SimpleNamespace has no `offload_parameters`",
        id="ds-plan-missing-field",
    ),
    pytest.param(
        lambda: deepspeed_settings(types.SimpleNamespace(stage="2", offload_optimizer=True, offload_parameters=False)),
        TypeError,
        "`plan.stage` must be an integer, got '2' (str)",
        id="ds-plan-bad-type",
    ),
    pytest.param(
        lambda: deepspeed_settings(types.SimpleNamespace(stage=2, offload_optimizer=1, offload_parameters=0), stage=3),
        ValueError,
        "give a plan or explicit `stage`, not both",
        id="ds-plan-and-stage",
    ),
    pytest.param(
        lambda: deepspeed_settings(stage=2, offload=True),
        TypeError,
        "`offload` is not an argument of Lightning's DeepSpeedStrategy; allowed: accelerator, remote_device",
        id="ds-unknown-kwarg",
    ),
    pytest.param(
        lambda: deepspeed_settings(offload_optimizer="no"),
        TypeError,
        "`offload_optimizer` must be True or False, got 'no' (str)",
        id="ds-offload-type",
    ),
    pytest.param(
        lambda: TorchCompile(mode="fast"),
        ValueError,
        "`mode` must be one of 'default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs', got 'fast'",
        id="compile-mode",
    ),
    pytest.param(
        lambda: TorchCompile(backend="tensorrt-ish"), ValueError, "`backend` must be one of ", id="compile-backend"
    ),
    pytest.param(
        lambda: TorchCompile(mode="max-autotune", options={"trace.enabled": True}),
        ValueError,
        "give `mode` or `options`, not both (torch.compile refuses both), got mode='max-autotune'",
        id="compile-mode-and-options",
    ),
    pytest.param(
        lambda: TorchCompile(fullgraph="yes"),
        TypeError,
        "`fullgraph` must be True or False, got 'yes' (str)",
        id="compile-fullgraph",
    ),
    pytest.param(
        lambda: compile_modules(nn.Sequential(nn.Linear(2, 2)), ["head"], backend="eager"),
        ValueError,
        "`modules` names 'head', which is not a submodule of Sequential (its children: '0'; '' is the module itself)",
        id="compile-missing-module",
    ),
    pytest.param(
        lambda: ActivationCheckpointing([]),
        ValueError,
        "`block_types` must name at least one module class, got an empty sequence",
        id="ckpt-empty",
    ),
    pytest.param(
        lambda: ActivationCheckpointing(3),  # type: ignore[arg-type]
        TypeError,
        "`block_types` must be nn.Module subclasses or class names (e.g. 'Block' or "
        "'torch.nn.TransformerEncoderLayer'), got 3 (int)",
        id="ckpt-bad-type",
    ),
]


@pytest.mark.parametrize(("build", "error", "message"), SURGERY_BAD)
def test_bad_surgery_arguments(build: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        build()
    assert str(info.value).startswith(message), str(info.value)


def test_compile_traces_through_checkpointed_blocks() -> None:
    """Activation checkpointing must not make torch.compile fall back to eager (a graph break per block)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = DemoGPT(GPTConfig(d_model=32, n_layers=2, seq_len=16, vocab_size=32))
    checkpoint_blocks(model)
    compile_modules(model, backend="eager")
    ids = torch.randint(0, 32, (4, 16))
    for _ in range(2):
        model(ids).sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
