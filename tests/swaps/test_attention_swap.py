"""AttentionSwap and swap_attention: detection, numerics, undo, idempotence, backend choice and errors."""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import lightning_tune.callbacks.surgery as callback_module
from lightning_tune import _imports
from lightning_tune.callbacks import AttentionSwap
from lightning_tune.demos import GPT, DemoGPT, GPTConfig, SyntheticTokenDataModule
from lightning_tune.swaps.attention import (
    SWAP_KINDS,
    AttentionSwapResult,
    find_attention,
    resolve_backend,
    sdpa_backends,
    swap_attention,
)
from tests.helpers import make_trainer

ALLOWED = (
    "'auto', 'flash', 'sdpa', 'eager' (or an alias: 'flash-attn', 'flash_attention_2', 'flash_attention_3', "
    "'scaled_dot_product_attention')"
)
EXTRA = "pip install 'lightning-tune[flash4]' on Hopper or newer, 'lightning-tune[flash2]' on Ampere"


# ----------------------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def no_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make flash-attn (2 and 4) look uninstalled, whatever this machine has."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


def run_with_grads(module: nn.Module, run: Callable[[nn.Module], Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    module.zero_grad(set_to_none=True)
    out = run(module)
    (out.float().square().mean()).backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
    assert grads, "no parameter received a gradient"
    return out.detach().clone(), grads


def assert_close_run(
    module: nn.Module, run: Callable[[nn.Module], Tensor], reference: tuple[Tensor, dict[str, Tensor]]
) -> None:
    out, grads = run_with_grads(module, run)
    torch.testing.assert_close(out, reference[0], atol=1e-5, rtol=1e-5)
    assert grads.keys() == reference[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[1][name], atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


def swapped_paths(result: AttentionSwapResult) -> list[tuple[str, str]]:
    return [(entry.path, entry.kind) for entry in result.entries]


def quiet_swap(module: nn.Module, backend: str = "sdpa", **kwargs: Any) -> AttentionSwapResult:
    messages: list[str] = []
    result = swap_attention(module, backend, notify=messages.append, **kwargs)
    return result


def instance_forwards(module: nn.Module) -> dict[str, Any]:
    return {name: vars(child)["forward"] for name, child in module.named_modules() if "forward" in vars(child)}


# -------------------------------------------------------------------------------------------------- MultiheadAttention


def mha_inputs(batch_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    x = torch.randn(3, 6, 16) if batch_first else torch.randn(6, 3, 16)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, -2:] = True  # the first sequence ends early
    causal = torch.ones(6, 6, dtype=torch.bool).triu(diagonal=1)
    return x, padding, causal


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_outputs_and_gradients_match(batch_first: bool) -> None:
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    x, padding, causal = mha_inputs(batch_first)

    def run(module: nn.Module) -> Tensor:
        return module(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)[0]

    reference = run_with_grads(mha, run)
    result = quiet_swap(mha, "sdpa")
    assert swapped_paths(result) == [("", "MultiheadAttention")]
    assert result.backend == "sdpa" and result.entries[0].backend == "sdpa"
    assert "MultiheadAttention" in result.describe()
    assert_close_run(mha, run, reference)
    for backend in ("eager", "auto"):
        quiet_swap(mha, backend)
        assert_close_run(mha, run, reference)
    result.restore()
    assert "forward" not in vars(mha)
    assert mha.forward.__func__ is nn.MultiheadAttention.forward  # type: ignore[attr-defined]
    assert_close_run(mha, run, reference)


def test_multihead_attention_with_need_weights_warns_once_and_still_matches() -> None:
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x, padding, _ = mha_inputs(True)
    expected, weights = mha(x, x, x, key_padding_mask=padding)
    with quiet_swap(mha, "sdpa"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out, got_weights = mha(x, x, x, key_padding_mask=padding)
    assert [str(w.message) for w in caught if "need_weights=True" in str(w.message)] == [str(caught[0].message)], (
        "exactly one need_weights notice"
    )
    assert "Pass need_weights=False" in str(caught[0].message)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_weights, weights)
    assert "forward" not in vars(mha)  # the `with` block restored it


def test_transformer_encoder_outputs_gradients_and_fast_path_match() -> None:
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x, padding, _ = mha_inputs(True)

    def run(module: nn.Module) -> Tensor:
        return module(x, src_key_padding_mask=padding)

    reference = run_with_grads(encoder, run)
    encoder.eval()
    with torch.no_grad():  # the inference fast path calls the fused op, not self_attn.forward
        fast_reference = encoder(x, src_key_padding_mask=padding)
    encoder.train()

    result = quiet_swap(encoder, "sdpa")
    assert swapped_paths(result) == [
        ("layers.0.self_attn", "MultiheadAttention"),
        ("layers.1.self_attn", "MultiheadAttention"),
    ]
    assert set(instance_forwards(encoder)) == {"layers.0", "layers.0.self_attn", "layers.1", "layers.1.self_attn"}
    assert_close_run(encoder, run, reference)
    encoder.eval()
    with torch.no_grad():
        torch.testing.assert_close(encoder(x, src_key_padding_mask=padding), fast_reference, atol=1e-5, rtol=1e-5)
    result.restore()
    assert instance_forwards(encoder) == {}


# ----------------------------------------------------------------------------------------------------------- demo GPT


def gpt_run(ids: Tensor) -> Callable[[nn.Module], Tensor]:
    return lambda module: module(ids)


def test_demo_gpt_sdpa_calls_match_and_are_listed() -> None:
    model = GPT(GPTConfig(d_model=32, n_heads=4, n_layers=2, seq_len=16))
    ids = torch.randint(0, 64, (2, 16))
    reference = run_with_grads(model, gpt_run(ids))
    result = quiet_swap(model, "sdpa")
    assert swapped_paths(result) == [("blocks.0.attn", "sdpa-call"), ("blocks.1.attn", "sdpa-call")]
    assert all(entry.module_type == "CausalSelfAttention" for entry in result.entries)
    assert_close_run(model, gpt_run(ids), reference)
    result.restore()
    assert instance_forwards(model) == {}
    assert_close_run(model, gpt_run(ids), reference)


class KernelProbe(nn.Module):
    """Calls F.scaled_dot_product_attention and records which SDPA kernels are enabled at that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list[tuple[bool, bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(
            (
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        q = self.proj(x).view(x.shape[0], 1, x.shape[1], 8)
        return F.scaled_dot_product_attention(q, q, q).squeeze(1)


def test_the_chosen_kernels_are_enabled_only_inside_the_swapped_forward() -> None:
    probe = KernelProbe()
    x = torch.randn(2, 4, 8)
    with quiet_swap(probe, "eager"):
        probe(x)
    with quiet_swap(probe, "sdpa"):
        probe(x)
    probe(x)
    assert probe.seen == [(False, False, True), (True, False, True), (True, True, True)]  # CPU: no efficient kernel
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_the_cpu_kernels_are_those_torch_runs_on_cpu_and_math_stays_off_cuda() -> None:
    q = torch.randn(2, 2, 8, 16)
    runs_alone_on_cpu = set()
    for kernel in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        with warnings.catch_warnings(), contextlib.suppress(RuntimeError), sdpa_kernel([kernel]):
            warnings.simplefilter("ignore")  # torch explains each refused kernel in a warning
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
            runs_alone_on_cpu.add(kernel)
    assert set(sdpa_backends("sdpa", "cpu")) == runs_alone_on_cpu  # every kernel torch has on CPU, and no other
    assert sdpa_backends("sdpa", "cpu") == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]  # flash first
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True)
    with swap_attention(layer, "sdpa", device="cpu") as result:
        assert result.describe().splitlines()[-1].endswith("sdpa     SDPA flash, math")  # the table's Kernel column
    assert [k.name for k in sdpa_backends("sdpa", "cuda")] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"]
    assert [k.name for k in sdpa_backends("flash", "cuda")] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"]
    assert [k.name for k in sdpa_backends("eager", "cuda")] == ["MATH"]
    with pytest.raises(ValueError, match="`backend` must be one of 'flash', 'sdpa', 'eager', got 'auto'"):
        sdpa_backends("auto", "cpu")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------- transformers


@pytest.fixture
def gpt2() -> Iterator[Any]:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install transformers)"
    )
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=100,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.set_attn_implementation("eager")
    yield model


def hf_run(ids: Tensor) -> Callable[[nn.Module], Tensor]:
    return lambda module: module(input_ids=ids).logits


def test_transformers_eager_to_sdpa_matches_the_eager_original(gpt2: Any) -> None:
    ids = torch.randint(0, 100, (2, 16))
    assert gpt2.config._attn_implementation == "eager"
    raw_before = vars(gpt2.config)["_attn_implementation_internal"]
    signature = inspect.signature(gpt2.forward)
    reference = run_with_grads(gpt2, hf_run(ids))

    result = quiet_swap(gpt2, "sdpa")
    assert swapped_paths(result) == [("", "transformers")]
    assert result.entries[0].detail.startswith("attn_implementation 'eager' -> 'sdpa'")
    assert gpt2.config._attn_implementation == "sdpa"
    assert inspect.signature(gpt2.forward) == signature  # generate() and friends inspect it
    assert_close_run(gpt2, hf_run(ids), reference)

    result.restore()
    assert vars(gpt2.config)["_attn_implementation_internal"] == raw_before == "eager"
    assert "forward" not in vars(gpt2)
    assert_close_run(gpt2, hf_run(ids), reference)


def test_transformers_swap_back_to_eager_restores_sdpa(gpt2: Any) -> None:
    gpt2.set_attn_implementation("sdpa")
    result = quiet_swap(gpt2, "eager")
    assert gpt2.config._attn_implementation == "eager"
    assert result.entries[0].backend == "eager" and "forward" not in vars(gpt2)  # no SDPA left to restrict
    result.restore()
    assert gpt2.config._attn_implementation == "sdpa"


def test_transformers_model_inside_a_container_next_to_multihead_attention(gpt2: Any) -> None:
    model = nn.ModuleDict({"lm": gpt2, "mha": nn.MultiheadAttention(8, 2)})
    result = quiet_swap(model, "sdpa")
    assert swapped_paths(result) == [("lm", "transformers"), ("mha", "MultiheadAttention")]
    result.restore()
    assert gpt2.config._attn_implementation == "eager" and instance_forwards(model) == {}


def test_transformers_model_without_sdpa_falls_back_under_auto_and_fails_when_explicit(
    gpt2: Any, no_flash_attn: None
) -> None:
    gpt2._supports_sdpa = False  # an architecture transformers has no SDPA path for
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(8, 2), "lm": gpt2})
    with pytest.raises(ValueError, match="GPT2LMHeadModel cannot use attn_implementation='sdpa'"):
        quiet_swap(model, "sdpa")
    assert instance_forwards(model) == {}, "the MultiheadAttention swapped before the failure was rolled back"
    assert gpt2.config._attn_implementation == "eager"

    messages: list[str] = []
    result = swap_attention(model, "auto", notify=messages.append)
    assert [(e.path, e.kind, e.backend) for e in result.entries] == [
        ("mha", "MultiheadAttention", "sdpa"),
        ("lm", "transformers", "eager"),
    ]
    assert len(messages) == 2 and "cannot use attn_implementation='sdpa'" in messages[1]
    result.restore()


@pytest.mark.slow
def test_detection_does_not_import_transformers_models() -> None:
    # Lightning may import the top-level (lazy) transformers package; its modeling code must stay unloaded
    code = (
        "import sys, torch; from lightning_tune.swaps.attention import swap_attention; "
        "swap_attention(torch.nn.MultiheadAttention(8, 2), 'sdpa'); "
        "assert 'transformers.modeling_utils' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------------------------------------- undo and idempotence


def test_swapping_twice_does_not_double_wrap_and_either_restore_undoes_all(gpt2: Any) -> None:
    demo = GPT(GPTConfig(d_model=32, n_heads=4, n_layers=1, seq_len=16))
    model = nn.ModuleDict({"lm": gpt2, "demo": demo, "mha": nn.MultiheadAttention(8, 2)})
    first = quiet_swap(model, "sdpa")
    wrappers = instance_forwards(model)
    second = quiet_swap(model, "sdpa")
    assert instance_forwards(model) == wrappers  # the very same wrappers: nothing wrapped twice
    assert swapped_paths(second) == swapped_paths(first)
    third = quiet_swap(model, "eager")  # another backend replaces the wrap instead of stacking on it
    assert all(w.original is None for w in instance_forwards(model).values())
    assert gpt2.config._attn_implementation == "eager"
    second.restore()
    assert instance_forwards(model) == {} and gpt2.config._attn_implementation == "eager"
    assert vars(gpt2.config)["_attn_implementation_internal"] == "eager"
    first.restore()
    third.restore()
    assert first.restored and second.restored and third.restored
    assert instance_forwards(model) == {}


def test_an_instance_level_forward_of_the_user_is_restored_exactly() -> None:
    probe = KernelProbe()
    own = probe.forward  # a bound method stored on the instance, as some libraries do
    probe.forward = own  # type: ignore[method-assign]
    result = quiet_swap(probe, "sdpa")
    assert vars(probe)["forward"] is not own
    probe(torch.randn(1, 2, 8))
    result.restore()
    assert vars(probe)["forward"] is own


def test_a_deep_copy_of_a_swapped_model_calls_its_own_module() -> None:
    model = GPT(GPTConfig(d_model=32, n_heads=4, n_layers=1, seq_len=16))
    result = quiet_swap(model, "sdpa")
    clone = copy.deepcopy(model)
    attn = clone.blocks[0].attn
    assert vars(attn)["forward"].module is attn
    ids = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(clone(ids), model(ids))
    result.restore()
    assert "forward" in vars(attn), "restoring the original leaves the copy alone"


def test_the_result_is_a_context_manager() -> None:
    model = nn.MultiheadAttention(8, 2)
    with quiet_swap(model, "sdpa") as result:
        assert "forward" in vars(model) and not result.restored
    assert "forward" not in vars(model) and result.restored


# ------------------------------------------------------------------------------------------------ nothing, refusals


def test_a_model_without_attention_gets_one_warning() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.warns(UserWarning) as caught:
        result = swap_attention(model, "auto")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "found no attention in Sequential" in message
    assert all(kind in message for kind in SWAP_KINDS)
    assert result.entries == [] and result.backend is None and result.restored
    assert "no attention found" in result.describe()


def test_a_data_parallel_wrapper_is_refused() -> None:
    with pytest.raises(TypeError, match="wrapped in DataParallel.*before the strategy wraps it"):
        swap_attention(nn.DataParallel(nn.MultiheadAttention(8, 2)), "sdpa")


def test_a_ddp_wrapped_model_is_refused(tmp_path: Path) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.MultiheadAttention(8, 2))
        with pytest.raises(
            TypeError,
            match="swap_attention got the model wrapped in DistributedDataParallel. Apply it to the bare model",
        ):
            swap_attention(ddp, "sdpa")
        assert instance_forwards(ddp) == {}
    finally:
        dist.destroy_process_group()


def test_not_a_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="`module` must be a torch.nn.Module, got 'model'"):
        swap_attention("model", "sdpa")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- backend choice


def test_unknown_backend_names_every_allowed_one() -> None:
    mha = nn.MultiheadAttention(8, 2)
    for call in (
        lambda: swap_attention(mha, "fast"),
        lambda: resolve_backend("fast", device="cpu", dtype=torch.float32),
        lambda: AttentionSwap("fast"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match=re.escape(f"`backend` must be one of {ALLOWED}, got 'fast'")):
            call()
    assert "forward" not in vars(mha)
    with pytest.raises(TypeError, match="`verbose` must be True or False"):
        AttentionSwap(verbose="yes")  # type: ignore[arg-type]


def test_hugging_face_backend_names_are_aliases(no_flash_attn: None) -> None:
    assert AttentionSwap("flash_attention_2").backend == "flash"
    with pytest.raises(ModuleNotFoundError, match="backend='flash' needs FlashAttention"):
        resolve_backend("flash_attention_2", device="cpu", dtype=torch.bfloat16)
    mha = nn.MultiheadAttention(8, 2)
    with quiet_swap(mha, "scaled_dot_product_attention") as result:
        assert (result.requested, result.backend) == ("sdpa", "sdpa") and "forward" in vars(mha)
    with pytest.raises(TypeError, match=r"`backend` must be a string naming an attention backend, got 2 \(int\)"):
        AttentionSwap(2)  # type: ignore[arg-type]


def test_auto_without_flash_attn_uses_sdpa_with_one_message(no_flash_attn: None) -> None:
    messages: list[str] = []
    assert resolve_backend("auto", device="cpu", dtype=torch.bfloat16, notify=messages.append) == "sdpa"
    assert len(messages) == 1
    assert "flash-attn is not installed" in messages[0] and EXTRA in messages[0]

    model = GPT(GPTConfig(d_model=32, n_heads=4, n_layers=2, seq_len=16))
    with pytest.warns(UserWarning) as caught:
        result = swap_attention(model, "auto")
    assert len(caught) == 1 and "flash-attn is not installed" in str(caught[0].message)
    assert result.backend == "sdpa" and {e.backend for e in result.entries} == {"sdpa"}
    result.restore()


def test_flash_without_flash_attn_names_the_extra(no_flash_attn: None) -> None:
    model = nn.MultiheadAttention(8, 2)
    with pytest.raises(ModuleNotFoundError, match=r"FlashAttention.*pip install 'lightning-tune\[flash4\]'"):
        swap_attention(model, "flash")
    with pytest.raises(ModuleNotFoundError, match=r"lightning-tune\[flash2\]' on Ampere"):
        resolve_backend("flash", device="cuda", dtype=torch.bfloat16)
    assert "forward" not in vars(model)


def test_flash_names_the_unmet_condition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_imports, "is_available", lambda module: True)  # as if flash-attn were installed
    with pytest.raises(
        ValueError, match="backend='flash' cannot run here: flash-attn needs a CUDA device, got device 'cpu'"
    ):
        resolve_backend("flash", device="cpu", dtype=torch.bfloat16, head_dim=64)
    messages: list[str] = []
    assert resolve_backend("auto", device="cpu", dtype=torch.bfloat16, notify=messages.append) == "sdpa"
    assert len(messages) == 1 and "needs a CUDA device" in messages[0]


def test_explicit_sdpa_and_eager_need_nothing() -> None:
    for backend in ("sdpa", "eager"):
        assert resolve_backend(backend, device="cuda", dtype=torch.float32, head_dim=1024) == backend


def test_find_attention_changes_nothing() -> None:
    model = GPT(GPTConfig(d_model=32, n_heads=4, n_layers=1, seq_len=16))
    assert [(s.path, s.kind) for s in find_attention(model)] == [("blocks.0.attn", "sdpa-call")]
    assert instance_forwards(model) == {}


# ------------------------------------------------------------------------------------------------------- the callback


class WrapProbe(Callback):
    def __init__(self) -> None:
        self.wrapped: list[bool] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        attn = pl_module.model.blocks[0].attn  # type: ignore[union-attr, index]
        self.wrapped.append("forward" in vars(attn))


def test_callback_swaps_during_fit_prints_the_table_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_flash_attn: None
) -> None:
    printed: list[str] = []
    monkeypatch.setattr(callback_module, "rank_zero_info", printed.append)
    config = GPTConfig(d_model=32, n_heads=4, n_layers=2, seq_len=16)
    module = DemoGPT(config)
    probe = WrapProbe()
    callback = AttentionSwap()
    trainer = make_trainer(tmp_path, [callback, probe], max_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=SyntheticTokenDataModule(4, seq_len=16, vocab_size=config.vocab_size))
    assert not [w for w in caught if "flash-attn" in str(w.message)], "the backend notice goes to the log"
    assert trainer.global_step == 3
    assert probe.wrapped == [True, True, True]
    assert len(printed) == 2
    assert "flash-attn is not installed" in printed[0]
    table = printed[1]
    assert "backend 'sdpa' (requested 'auto')" in table
    assert "model.blocks.0.attn" in table and "model.blocks.1.attn" in table and "sdpa-call" in table
    assert instance_forwards(module) == {} and callback.result is None


def test_callback_reads_dtype_and_device_from_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_swap(module: nn.Module, backend: str, **kwargs: Any) -> AttentionSwapResult:
        seen.update(kwargs, backend=backend)
        return AttentionSwapResult(requested=backend, backend=None)

    monkeypatch.setattr(callback_module, "swap_attention", fake_swap)
    trainer = Trainer(accelerator="cpu", precision="bf16-mixed", logger=False)
    AttentionSwap("eager").setup(trainer, DemoGPT(), "fit")
    assert seen["backend"] == "eager" and seen["dtype"] == torch.bfloat16 and seen["device"] == torch.device("cpu")


# ------------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_multihead_attention_bf16_matches_math() -> None:
    mha = nn.MultiheadAttention(64, 4, batch_first=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        expected = mha(x, x, x, need_weights=False)[0]
    with quiet_swap(mha, "auto", device="cuda", dtype=torch.bfloat16) as result:
        assert result.backend in ("flash", "sdpa")
        torch.testing.assert_close(mha(x, x, x, need_weights=False)[0], expected, atol=2e-2, rtol=2e-2)


SDPA_OPS = {
    "flash": "aten::_scaled_dot_product_flash_attention",
    "efficient": "aten::_scaled_dot_product_efficient_attention",
    "math": "aten::_scaled_dot_product_attention_math",
}


def sdpa_ops_run(run: Callable[[], object]) -> set[str]:
    """Which SDPA kernels ran, from the profiler's op names."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    return {kernel for kernel, op in SDPA_OPS.items() if op in names}


@pytest.mark.gpu
def test_gpu_demo_gpt_sdpa_uses_only_fused_kernels() -> None:
    model = GPT(GPTConfig(d_model=64, n_heads=4, n_layers=1, seq_len=32)).cuda()
    ids = torch.randint(0, 64, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = model(ids)
        with quiet_swap(model, "sdpa", dtype=torch.bfloat16):
            ran = sdpa_ops_run(lambda: model(ids).float().sum().backward())
            torch.testing.assert_close(model(ids), expected, atol=2e-2, rtol=2e-2)
        assert sdpa_ops_run(lambda: quiet_swap(model, "eager", dtype=torch.bfloat16) and model(ids)) == {"math"}
    assert ran and ran <= {"flash", "efficient"}, ran


@pytest.mark.gpu
def test_gpu_float64_and_3d_calls_fall_back_to_math_with_one_warning() -> None:
    probe = ThreeD(dtype=torch.float64).cuda()
    x = torch.randn(2, 6, 8, device="cuda", dtype=torch.float64)
    expected = probe(x)
    with quiet_swap(probe, "sdpa", dtype=torch.float64), pytest.warns(UserWarning, match="MATH kernel"):
        ran = sdpa_ops_run(lambda: probe(x))
        torch.testing.assert_close(probe(x), expected)
    assert ran == {"math"}


@pytest.mark.gpu
def test_gpu_transformers_flash_attention_2(gpt2: Any) -> None:
    if not _imports.is_available("flash_attn"):
        pytest.skip("flash-attn 2 is not installed (pip install 'lightning-tune[flash2]')")
    model = gpt2.to("cuda", torch.bfloat16)
    ids = torch.randint(0, 100, (2, 32), device="cuda")
    expected = model(input_ids=ids).logits
    with quiet_swap(model, "flash") as result:
        assert result.entries[0].backend == "flash" and "flash" in model.config._attn_implementation
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=3e-2, rtol=3e-2)
    assert model.config._attn_implementation == "eager"


# ------------------------------------------------------------- flash-attn 2 and 4, the MATH fallback (CPU, mocked)


class ThreeD(nn.Module):
    """Calls F.scaled_dot_product_attention on 3-D (batch * heads, seq, head_dim) tensors."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        q = self.proj(x)
        return F.scaled_dot_product_attention(q, q, q)


def flash_attn_4_module(calls: list[dict[str, Any]]) -> tuple[Any, Any]:
    """A stand-in for flash-attn-4 as it installs: a ``flash_attn`` namespace (no ``__file__``) holding ``cute``."""
    import types

    def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Any = None, causal: bool = False) -> Any:
        calls.append({"shape": tuple(q.shape), "causal": causal, "scale": softmax_scale})
        out = F.scaled_dot_product_attention(  # the reference, in flash-attn's (B, S, H, D) layout
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale
        )
        return out.transpose(1, 2), None  # flash-attn-4 returns (out, lse)

    namespace = types.ModuleType("flash_attn")
    namespace.__path__ = []  # type: ignore[attr-defined]
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    return namespace, cute


@pytest.fixture
def as_if_cuda(monkeypatch: pytest.MonkeyPatch) -> Callable[[tuple[int, int]], None]:
    """Make the device checks see a CUDA GPU of a given compute capability, and route CPU calls as CUDA ones."""
    import lightning_tune.swaps.attention as attention

    def install(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU sm{capability[0]}{capability[1]}")
        monkeypatch.setattr(attention, "_routes", lambda device: True)

    return install


def test_flash_attn_4_alone_is_not_flash_attn_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # on disk, as the wheel installs it: flash_attn/cute/__init__.py and no flash_attn/__init__.py
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn.cute", raising=False)
    assert not _imports.is_available("flash_attn") and _imports.is_available("flash_attn.cute")
    assert "flash_attn" not in sys.modules  # nothing was imported to find out
    # and with flash-attn 2 (a regular package) installed too, both count
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    assert _imports.is_available("flash_attn") and _imports.is_available("flash_attn.cute")
    # mocked modules: an imported namespace without __file__ is not flash-attn 2
    namespace, cute = flash_attn_4_module([])
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    assert not _imports.is_available("flash_attn") and _imports.is_available("flash_attn.cute")


@pytest.mark.parametrize(
    ("capability", "installed", "engine"),
    [
        pytest.param((9, 0), ("flash4",), "flash-attn-4", id="hopper-fa4"),
        pytest.param((10, 0), ("flash2", "flash4"), "flash-attn-4", id="blackwell-prefers-fa4"),
        pytest.param((9, 0), ("flash2",), "flash-attn-2", id="hopper-fa2-only"),
        pytest.param((8, 0), ("flash2", "flash4"), "flash-attn-2", id="ampere-fa2"),
        pytest.param((8, 0), ("flash4",), None, id="ampere-fa4-only"),
        pytest.param((12, 0), ("flash4",), None, id="consumer-blackwell-fa4"),
        pytest.param((7, 5), ("flash2",), None, id="turing"),
    ],
)
def test_the_flash_package_follows_the_compute_capability(
    monkeypatch: pytest.MonkeyPatch,
    as_if_cuda: Any,
    capability: tuple[int, int],
    installed: tuple[str, ...],
    engine: str | None,
) -> None:
    from lightning_tune.swaps.attention import _choose_flash

    as_if_cuda(capability)
    modules = {"flash2": "flash_attn", "flash4": "flash_attn.cute"}
    monkeypatch.setattr(_imports, "is_available", lambda module: module in {modules[i] for i in installed})
    chosen, problem = _choose_flash(torch.device("cuda"), torch.bfloat16, 64)
    assert chosen == engine
    if engine is None:
        assert problem is not None and f"got {capability[0]}.{capability[1]}" in problem
        if installed == ("flash4",):
            assert "pip install 'lightning-tune[flash2]'" in problem
        with pytest.raises(ValueError, match="backend='flash' cannot run here"):
            resolve_backend("flash", device="cuda", dtype=torch.bfloat16, head_dim=64)


def test_flash_on_hopper_runs_flash_attn_4_in_its_layout(monkeypatch: pytest.MonkeyPatch, as_if_cuda: Any) -> None:
    calls: list[dict[str, Any]] = []
    namespace, cute = flash_attn_4_module(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    as_if_cuda((9, 0))
    model = GPT(GPTConfig(d_model=32, n_heads=4, n_layers=2, seq_len=16)).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 16))
    expected = model(ids)
    with quiet_swap(model, "flash", device="cuda", dtype=torch.bfloat16) as result:
        assert result.backend == "flash" and "flash-attn-4" in result.entries[0].detail
        torch.testing.assert_close(model(ids), expected, atol=2e-2, rtol=2e-2)
    assert calls == [{"shape": (2, 16, 4, 8), "causal": True, "scale": None}] * 2  # (B, S, H, D), one per layer
    model(ids)
    assert len(calls) == 2  # restored: plain SDPA again


def test_transformers_get_flash_attention_4_on_hopper() -> None:
    from lightning_tune.swaps.attention import _hf_name

    assert _hf_name("flash", "flash-attn-4") == "flash_attention_4"
    assert _hf_name("flash", "flash-attn-2") == "flash_attention_2"
    assert _hf_name("sdpa", "flash-attn-4") == "sdpa"


@pytest.mark.parametrize(
    ("shape", "dtype", "problem"),
    [
        pytest.param((2, 4, 8, 64), torch.bfloat16, None, id="bf16-64"),
        pytest.param((2, 4, 8, 64), torch.float64, "float64 inputs", id="float64"),
        pytest.param((8, 8, 64), torch.float32, "3-D inputs", id="3d"),
        pytest.param((1, 2, 8, 260), torch.bfloat16, "head dimension 260 in bfloat16", id="bf16-260"),
        pytest.param((1, 2, 8, 264), torch.bfloat16, None, id="bf16-264-aligned"),
        pytest.param((1, 2, 8, 250), torch.bfloat16, None, id="bf16-250-flash-takes-it"),
    ],
)
def test_which_calls_no_fused_kernel_takes(shape: tuple[int, ...], dtype: torch.dtype, problem: str | None) -> None:
    from lightning_tune.swaps.attention import fused_problem

    q = torch.zeros(shape, dtype=dtype)
    found = fused_problem(q, q, q)
    assert found == problem if problem is None else (found is not None and found.startswith(problem))


def fused_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA restricted to the fused kernels, as on CUDA; on CPU the flash kernel then declines 3-D and dropout."""
    import lightning_tune.swaps.attention as attention

    fused = [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]
    original = attention.sdpa_backends
    monkeypatch.setattr(attention, "sdpa_backends", lambda b, d: fused if b != "eager" else original(b, d))
    monkeypatch.setattr(attention, "_routes", lambda device: True, raising=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["3d-float32", "3d-float64"])
def test_calls_no_fused_kernel_takes_run_on_math_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    probe = ThreeD(dtype)
    x = torch.randn(4, 6, 8, dtype=dtype)
    expected = probe(x)
    fused_only(monkeypatch)
    with quiet_swap(probe, "sdpa"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [probe(x) for _ in range(3)]
    notes = [str(w.message) for w in caught if "MATH kernel" in str(w.message)]
    assert len(notes) == 1 and "ThreeD" in notes[0]
    assert ("float64 inputs" if dtype == torch.float64 else "3-D inputs") in notes[0]
    for out in outs:
        torch.testing.assert_close(out, expected)


@pytest.mark.filterwarnings("ignore:.*kernel not used because", "ignore:Both fused kernels")  # torch's own reasons
def test_a_call_pytorch_refuses_for_another_reason_also_runs_on_math(monkeypatch: pytest.MonkeyPatch) -> None:
    class Dropout(nn.Module):
        def forward(self, q: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)

    fused_only(monkeypatch)
    module = Dropout()
    with quiet_swap(module, "sdpa"), pytest.warns(UserWarning, match="PyTorch found no fused kernel"):
        out = module(torch.randn(1, 2, 4, 8))
    assert out.shape == (1, 2, 4, 8)
