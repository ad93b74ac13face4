from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import IterableDataset

from lightning_tune.demos import GPT, DemoGPT, GPTConfig, SyntheticTokenDataModule, run_demo
from lightning_tune.demos.data import SyntheticTokenDataset
from lightning_tune.demos.gpt import CausalSelfAttention
from lightning_tune.demos.run import DemoSummary, cpu_threads, prepare_demo

SMALL = GPTConfig(vocab_size=20, seq_len=16, d_model=32, n_layers=2, n_heads=4)


# --- model -------------------------------------------------------------------------------------------------------


def test_gpt_maps_token_ids_to_logits_over_the_vocabulary() -> None:
    model = GPT(SMALL)
    ids = torch.randint(0, SMALL.vocab_size, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, SMALL.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_gpt_rejects_sequences_longer_than_its_position_table() -> None:
    with pytest.raises(ValueError, match=r"at most seq_len=16"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sdpa_and_eager_attention_agree_in_fp32(dropout: float) -> None:
    torch.manual_seed(0)
    sdpa = GPT(GPTConfig(**{**SMALL.__dict__, "attention": "sdpa", "dropout": dropout})).eval()
    eager = GPT(GPTConfig(**{**SMALL.__dict__, "attention": "eager", "dropout": dropout})).eval()
    eager.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, SMALL.vocab_size, (4, SMALL.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids), eager(ids), atol=1e-5, rtol=1e-5)

    attn_sdpa = CausalSelfAttention(GPTConfig(d_model=32, n_heads=4, attention="sdpa"))
    attn_eager = CausalSelfAttention(GPTConfig(d_model=32, n_heads=4, attention="eager"))
    attn_eager.load_state_dict(attn_sdpa.state_dict())
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(attn_sdpa(x), attn_eager(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_is_causal(attention: str) -> None:
    model = GPT(GPTConfig(**{**SMALL.__dict__, "attention": attention})).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % SMALL.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_initial_loss_is_close_to_a_uniform_guess() -> None:
    torch.manual_seed(0)
    module = DemoGPT(SMALL)
    ids = torch.randint(0, SMALL.vocab_size, (8, SMALL.seq_len))
    with torch.no_grad():
        loss = module._loss((ids, ids)).item()
    assert abs(loss - math.log(SMALL.vocab_size)) < 0.1


def test_configure_optimizers_returns_adamw_with_decay_only_on_linear_weights() -> None:
    module = DemoGPT(SMALL, lr=1e-3, weight_decay=0.05)
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)  # an optimizer alone: no scheduler
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert decay["lr"] == no_decay["lr"] == 1e-3
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    assert {id(p) for p in decay["params"]} == linear_weights
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    assert embeddings <= {id(p) for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))


def test_demo_gpt_can_be_rebuilt_from_its_hyperparameters() -> None:
    module = DemoGPT(SMALL, lr=1e-3)
    rebuilt = DemoGPT(**module.hparams)
    assert rebuilt.config == SMALL
    assert rebuilt.lr == 1e-3
    assert module.hparams["config"]["d_model"] == 32  # stored as plain builtins, safe for hparams.yaml


def test_predict_step_accepts_a_training_batch_or_bare_ids() -> None:
    module = DemoGPT(SMALL).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 5))
    with torch.no_grad():
        assert module.predict_step((ids, ids), 0).shape == (2, 5, SMALL.vocab_size)
        assert module.predict_step(ids, 0).shape == (2, 5, SMALL.vocab_size)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param(
            {"vocab_size": 1}, ValueError, r"`vocab_size` must be an integer >= 2, got 1", id="vocab-too-small"
        ),
        pytest.param({"seq_len": 0}, ValueError, r"`seq_len` must be an integer >= 1, got 0", id="seq-len-zero"),
        pytest.param({"d_model": 130}, ValueError, r"`d_model` must be divisible by `n_heads`", id="heads-dont-divide"),
        pytest.param({"n_layers": 0}, ValueError, r"`n_layers` must be an integer >= 1", id="no-layers"),
        pytest.param({"dropout": 1.0}, ValueError, r"`dropout` must be in \[0, 1\), got 1.0", id="dropout-one"),
        pytest.param({"attention": "flash"}, ValueError, r"`attention` must be one of 'sdpa', 'eager'", id="attention"),
        pytest.param({"n_heads": 2.0}, TypeError, r"`n_heads` must be an integer, got 2.0", id="float-heads"),
        pytest.param({"d_model": True}, TypeError, r"`d_model` must be an integer", id="bool-width"),
    ],
)
def test_gpt_config_rejects_bad_values(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GPTConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"lr": 0.0}, ValueError, r"`lr` must be in \(0, inf\]", id="zero-lr"),
        pytest.param({"weight_decay": -0.1}, ValueError, r"`weight_decay` must be in \[0, inf\]", id="negative-wd"),
        pytest.param({"config": "small"}, TypeError, r"`config` must be a GPTConfig", id="config-type"),
    ],
)
def test_demo_gpt_rejects_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DemoGPT(**kwargs)


# --- data --------------------------------------------------------------------------------------------------------


def test_dataset_is_map_style_with_shifted_targets() -> None:
    ds = SyntheticTokenDataset(10, 12, 20, seed=3)
    assert not isinstance(ds, IterableDataset)
    assert len(ds) == 10
    ids, targets = ds[4]
    assert ids.shape == targets.shape == (12,)
    assert ids.dtype == targets.dtype == torch.int64
    assert torch.equal(ids[1:], targets[:-1])
    assert int(ids.min()) >= 0 and int(ids.max()) < 20
    assert torch.equal(ds[-1][0], ds[9][0])
    with pytest.raises(IndexError, match="out of range"):
        ds[10]


def test_dataset_items_depend_only_on_seed_and_index() -> None:
    small = SyntheticTokenDataset(5, 16, 32, seed=1)
    large = SyntheticTokenDataset(600, 16, 32, seed=1)
    for i in range(5):
        assert torch.equal(small[i][0], large[i][0]) and torch.equal(small[i][1], large[i][1])
    again = SyntheticTokenDataset(600, 16, 32, seed=1)
    assert torch.equal(large[599][0], again[599][0])
    other = SyntheticTokenDataset(5, 16, 32, seed=2)
    assert not torch.equal(small[0][0], other[0][0])


def test_entropy_floor_is_far_below_a_uniform_guess_and_matches_the_data() -> None:
    ds = SyntheticTokenDataset(512, 64, 64, seed=0)
    assert 0.5 < ds.entropy_floor < math.log(64) - 1.5
    # The chain's own log-likelihood on its samples estimates the entropy rate.
    ids = torch.stack([ds[i][0] for i in range(len(ds))])
    targets = torch.stack([ds[i][1] for i in range(len(ds))])
    empirical = -ds.transition.log()[ids, targets].mean().item()
    assert empirical == pytest.approx(ds.entropy_floor, abs=0.05)


def test_datamodule_splits_and_batch_size_changes() -> None:
    dm = SyntheticTokenDataModule(8, seq_len=16, vocab_size=32, train_sequences=64, val_sequences=16)
    assert dm.entropy_floor < math.log(32)
    ids, targets = next(iter(dm.train_dataloader()))
    assert ids.shape == targets.shape == (8, 16)
    train_first = dm.train_set[0][0] if dm.train_set is not None else None
    assert train_first is not None and dm.val_set is not None
    assert not torch.equal(train_first, dm.val_set[0][0])
    dm.batch_size = 4  # what a dynamic batch-size callback does
    assert next(iter(dm.train_dataloader()))[0].shape == (4, 16)
    assert next(iter(dm.val_dataloader()))[0].shape == (4, 16)
    assert next(iter(dm.predict_dataloader()))[0].shape == (4, 16)


def test_datamodule_rejects_bad_batch_size() -> None:
    with pytest.raises(ValueError, match=r"`batch_size` must be an integer >= 1, got 0"):
        SyntheticTokenDataModule(0)


# --- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_demo_trains_and_writes_tensorboard_logs(tmp_path: Path) -> None:
    summary = run_demo(
        max_steps=40, batch_size=16, accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path
    )
    assert isinstance(summary, DemoSummary)
    assert summary.steps == 40
    assert summary.device.startswith("cpu (") and "thread" in summary.device
    assert summary.start_loss > 3.0  # close to ln(64) = 4.16 at the start
    assert summary.final_loss < summary.start_loss - 1.0
    assert summary.loss_drop > 0.25
    assert 0.5 < summary.entropy_floor < summary.final_loss
    assert summary.seconds > 0 and summary.samples_per_sec > 0
    log_dir = Path(summary.log_dir)
    assert log_dir.is_relative_to(tmp_path / "lightning_logs")
    events = list(log_dir.glob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file in {log_dir}"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"train_loss", "val_loss", "tune/lr", "tune/batch_size", "tune/oom_recoveries"} <= tags
    assert str(tmp_path / "lightning_logs") in summary.tensorboard_command
    # without a GPU the micro-batch is shown against a simulated device where the requested 16 does not fit
    assert summary.batch["simulated"] is True
    assert summary.batch["start"] == 16
    assert summary.batch["oom_recoveries"] >= 1
    assert 1 <= summary.batch["final"] < 16


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param(
            {"max_steps": 0}, ValueError, r"`max_steps` must be an integer from 1 to 1000000, got 0", id="zero-steps"
        ),
        pytest.param({"batch_size": 2.5}, TypeError, r"`batch_size` must be an integer", id="float-batch"),
        pytest.param({"seed": 2**32}, ValueError, r"`seed` must be an integer from 0 to 4294967295", id="huge-seed"),
        pytest.param({"extra_callbacks": [object()]}, TypeError, r"`extra_callbacks` must hold", id="not-callback"),
        pytest.param(
            {"batch_size": 100_000_000},
            ValueError,
            r"`batch_size` must be at most 4096 \(the sequences of the demo's training split\), got 100000000",
            id="huge-batch",
        ),
        pytest.param({"accelerator": 1}, TypeError, r"`accelerator` must be a string", id="accelerator-type"),
        pytest.param({"devices": 1.5}, TypeError, r"`devices` must be an integer or a string", id="devices-type"),
        pytest.param({"precision": 16}, TypeError, r"`precision` must be a string naming a precision", id="precision"),
        pytest.param({"precision": "fp8"}, ValueError, r"`precision` must be one of 'auto', '32-true'", id="fp8"),
        pytest.param(
            {"enable_progress_bar": "no"}, TypeError, r"`enable_progress_bar` must be True or False", id="bar"
        ),
        pytest.param({"default_root_dir": 3}, TypeError, r"`default_root_dir` must be a path, got 3 \(int\)", id="dir"),
        pytest.param(
            {"default_root_dir": ""},
            ValueError,
            r"`default_root_dir` must be a directory path \(use '\.' for the current one\), got ''",
            id="empty-dir",
        ),
        pytest.param(
            {"default_root_dir": "{file}/logs/run"},
            ValueError,
            r"`default_root_dir` '.*a-file/logs/run' cannot be a directory: '.*a-file' is a file",
            id="dir-through-a-file",
        ),
        pytest.param(
            {"default_root_dir": "/proc/forbidden/x"},
            ValueError,
            r"`default_root_dir` '/proc/forbidden/x' cannot hold the logs: No such file or directory",
            id="dir-that-cannot-be-made",
        ),
        pytest.param(
            {"precision": "16-mixed", "accelerator": "cpu"},
            ValueError,
            r"`precision` '16-mixed' needs a CUDA GPU .*; on CPU use 'bf16-mixed'",
            id="fp16-on-cpu",
        ),
        pytest.param(
            {"max_steps": 10**30}, ValueError, r"`max_steps` must be an integer from 1 to 1000000", id="forever"
        ),
    ],
)
def test_run_demo_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    if isinstance(kwargs.get("default_root_dir"), str):
        kwargs = {**kwargs, "default_root_dir": kwargs["default_root_dir"].replace("{file}", str(tmp_path / "a-file"))}
    with pytest.raises(error, match=match):
        run_demo(**kwargs)


def test_run_demo_shows_the_arguments_of_prepare_demo() -> None:
    """``help(run_demo)`` lists every argument, and an unknown one is refused naming ``run_demo``."""
    assert list(inspect.signature(run_demo).parameters.values()) == list(
        inspect.signature(prepare_demo).parameters.values()
    )
    with pytest.raises(TypeError, match=r"run_demo\(\) got an unexpected keyword argument 'steps'"):
        run_demo(steps=1)  # type: ignore[call-arg]


@pytest.mark.parametrize(("precision", "expected"), [("auto", "32-true"), ("bf16", "bf16-mixed"), ("64", "64-true")])
def test_precision_takes_aliases_and_auto_is_decided_for_the_device(
    precision: str, expected: str, tmp_path: Path
) -> None:
    demo = prepare_demo(max_steps=1, accelerator="cpu", precision=precision, default_root_dir=tmp_path)
    assert demo.trainer.precision == expected  # "auto" is 32-true on a CPU


@pytest.mark.slow
def test_example_script_runs_with_the_pack_callbacks(tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "add_to_existing_module.py"
    spec = importlib.util.spec_from_file_location("add_to_existing_module", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    metrics = example.main(max_epochs=1, root_dir=str(tmp_path))
    assert metrics["val_acc"] > 0.5  # four classes: well above chance after one epoch
    assert list((tmp_path / "lightning_logs").glob("version_*/events.out.tfevents.*"))


class _Threads(Callback):
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def on_train_batch_start(self, *args: Any) -> None:
        self.seen.add(torch.get_num_threads())


@pytest.mark.parametrize(
    ("omp", "load", "expected"),
    [
        pytest.param(None, 1.7, 1, id="one-core-busy"),
        pytest.param(None, 9.0, 1, id="overloaded"),
        pytest.param(None, 0.2, 2, id="idle"),
        pytest.param("2", 9.0, 2, id="OMP_NUM_THREADS-decides"),
    ],
)
def test_cpu_threads_are_the_idle_cores(
    omp: str | None, load: float, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (load, load, load))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert cpu_threads(2) == expected


def test_demo_trains_on_the_idle_cores_and_gives_the_threads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On two cores under load two threads were 8 times slower than one: the demo trains on the idle cores only."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (1.7, 1.7, 1.7))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = _Threads()
        summary = run_demo(
            max_steps=2, batch_size=2, accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path,
            extra_callbacks=[threads],
        )  # fmt: skip
        assert threads.seen == {1}
        assert summary.device.endswith(", 1 thread)")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
