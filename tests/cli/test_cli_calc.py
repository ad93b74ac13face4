"""``lightning-tune calc batch-size``: the breakdown, the recommendation, the advice when nothing fits, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaConfig

from lightning_tune.cli import main
from lightning_tune.plan import estimate_memory

BASE = ["calc", "batch-size", "--model", "llama-2-7b", "--sequence-length", "2048"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def recommended(out: str) -> tuple[int, int, int]:
    match = re.search(r"^Recommended: (\d+) \(safe\), (\d+) \(optimal\), (\d+) \(aggressive\)$", out, re.MULTILINE)
    assert match, out
    safe, optimal, aggressive = (int(g) for g in match.groups())
    return safe, optimal, aggressive


def test_prints_the_breakdown_and_the_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*BASE, "--gpu-memory", "81920", "--precision", "bf16", "--lora-rank", "8", "--grad-checkpointing"]
    status, out, err = run(argv, capsys)
    assert status == 0 and err == ""
    assert "Parameters              6.75 B (6,746,804,224; 8,388,608 trainable)" in out
    assert "Model size              12.57 GiB (bf16-mixed, 2 bytes each)" in out
    for label in ("Gradients", "Optimizer states", "Activations per sample"):
        assert f"  {label}" in out
    estimate = estimate_memory("llama-2-7b", sequence_length=2048, lora_rank=8, gradient_checkpointing=True)
    assert recommended(out) == tuple(estimate.batch_sizes(81920 * 2**20).values())
    safe, optimal, aggressive = recommended(out)
    assert 0 < safe <= optimal <= aggressive
    assert "Nothing fits" not in out


def test_training_output_gives_the_evaluation_batch_inside_fit_and_alone(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run([*BASE, "--gpu-memory", "80GB", "--optimizer", "adamw8bit", "--grad-checkpointing"], capsys)
    evaluation = estimate_memory("llama-2-7b", sequence_length=2048, optimizer="adamw8bit", mode="eval")
    assert evaluation.fit_fixed_bytes is not None
    usable = evaluation.usable_bytes(80 * 2**30)
    in_fit = (usable - evaluation.fit_fixed_bytes) // evaluation.bytes_per_sample
    alone = (usable - evaluation.fixed_bytes) // evaluation.bytes_per_sample
    assert (status, err, recommended(out)) == (0, "", (0, 5, 8))
    assert out.splitlines()[-1].startswith(f"Evaluation: batch {in_fit} fits inside fit (the training state resident)")
    assert f", {alone} in trainer.validate or test (optimal margin" in out
    assert (in_fit, alone) == (12, 73)  # 2.4x and 14.6x the training micro-batch (5)


@pytest.mark.parametrize("mode", ["eval", "predict"])
def test_mode_plans_evaluation_and_predict(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run([*BASE, "--gpu-memory", "40GB", "--mode", mode], capsys)
    estimate = estimate_memory("llama-2-7b", sequence_length=2048, mode=mode)  # type: ignore[arg-type]
    assert (status, err) == (0, "")
    assert recommended(out) == tuple(estimate.batch_sizes(40 * 2**30).values())
    assert "Working set per sample" in out and "Gradients" not in out and "Optimizer states" not in out
    assert "Model size              25.10 GiB (bf16-mixed, 4 bytes each)" in out  # Lightning's float32 weights
    assert ("Fixed inside fit" in out) == ("Evaluation: batch" in out) == (mode == "eval")


def test_says_plainly_when_nothing_fits_and_what_would(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run([*BASE, "--gpu-memory", "24576", "--precision", "fp16"], capsys)
    assert status == 1
    assert "Model size              12.55 GiB (16-mixed, 2 bytes each)" in out
    assert "Nothing fits: batch 1 needs 110.43 GiB and 21.60 GiB is usable at the optimal margin" in out
    assert "  --optimizer adamw8bit: still does not fit: batch 1 needs 73.71 GiB" in out
    assert "  --lora-rank 16: fits batch 1 (optimal margin)" in out
    assert "  --precision bf16-true: still does not fit: batch 1 needs 60.23 GiB" in out
    assert (
        "  --optimizer adamw8bit --grad-checkpointing --loss-swap --precision bf16-true: still does not fit: batch 1 "
        "needs 39.47 GiB" in out
    )
    assert (
        "  --optimizer adamw8bit --grad-checkpointing --loss-swap --precision bf16-true --lora-rank 16: fits batch 10 "
        "(optimal margin)" in out
    )
    assert "DeepSpeed on 1 GPU: ZeRO stage 3 with optimizer and weights offloaded to CPU needs 10.51 GiB" in out
    assert "  16 GPUs: ZeRO stage 3 needs 17.57 GiB per GPU" in out
    assert recommended(out) == (0, 0, 0)


def test_reads_a_hugging_face_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2).save_pretrained(tmp_path)
    argv = ["calc", "batch-size", "--model", str(tmp_path / "config.json"), "--gpu-memory", "8192"]
    status, out, _ = run([*argv, "--sequence-length", "512", "--precision", "fp32", "--optimizer", "sgd"], capsys)
    assert status == 0
    assert "Model size              " in out and "(32-true, 4 bytes each)" in out
    assert "Master weights" not in out  # fp32 has none


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(
            ["--model", "llama-2-8b", "--gpu-memory", "1GB", "--sequence-length", "8"],
            "unknown model 'llama-2-8b'; did you mean",
            id="unknown-model",
        ),
        pytest.param(
            ["--model", "missing/config.json", "--gpu-memory", "1GB", "--sequence-length", "8"],
            "no Hugging Face config.json at",
            id="missing-config",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "0GB", "--sequence-length", "8"],
            "--gpu-memory: must be from 1 GiB to 64 TiB, such as '24GB', got '0GB'",
            id="zero-memory",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "24", "--sequence-length", "8"],
            "--gpu-memory: a bare number is MiB, so '24' is 24 MiB, less than any GPU; give a unit, such as '24GB' "
            "for 24 GiB",
            id="bare-number-below-1024",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "24 XB", "--sequence-length", "8"],
            "--gpu-memory: must be an amount such as '24GB', '24GiB', '80G' or '24576' (MiB), got '24 XB'",
            id="unknown-unit",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "nan", "--sequence-length", "8"],
            "--gpu-memory: must be an amount such as",
            id="not-a-number",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "-1"],
            "argument --sequence-length/--seq-len: must be an integer from 1 to 16777216, got '-1'",
            id="sequence",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--precision", "fp8"],
            "argument --precision: must be one of '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', "
            "'64-true' (or an alias: ",
            id="precision",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--precision", "auto"],
            "argument --precision: must be one of '32-true',",
            id="auto-needs-a-gpu",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--optimizer", "adam"],
            "argument --optimizer: must be one of 'adamw', 'sgd', 'adamw_fused', 'adam8bit',",
            id="optimizer",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--lora-rank", "0"],
            "--lora-rank: must be an integer >= 1",
            id="rank",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--lora-rank", "100000"],
            "`lora_rank` must be an integer from 1 to 768 for gpt2",
            id="rank-above-hidden-size",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--attention", "flash3"],
            "argument --attention: must be one of 'auto', 'flash', 'sdpa', 'eager' (or an alias: ",
            id="attention",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--grad-checkpointing=yes"],
            "--grad-checkpointing: ignored explicit argument 'yes'",
            id="flag-value",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--no-master-weights=no"],
            "--no-master-weights: ignored explicit argument 'no'",
            id="no-master-flag-value",
        ),
        pytest.param(
            ["--gpu-memory", "1GB", "--sequence-length", "8"],
            "the following arguments are required: --model",
            id="no-model",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--mode", "validate"],
            "argument --mode: invalid choice: 'validate' (choose from 'train', 'eval', 'predict')",
            id="mode",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "1GB", "--sequence-length", "8", "--gpus", "2"],
            "unrecognized arguments: --gpus 2",
            id="unknown-flag",
        ),
        pytest.param(
            ["--model", "gpt2", "--gpu-memory", "81920", "--sequence-length", "8192"],
            "`sequence_length` must be at most 1024 for gpt2 (its learned position table), got 8192",
            id="longer-than-positions",
        ),
        pytest.param(
            ["--model", "tests", "--gpu-memory", "1GB", "--sequence-length", "8"],
            "`model`: the directory 'tests' has no config.json",
            id="directory-without-config",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line_message(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(["calc", "batch-size", *argv], capsys)
    assert status == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0] and expected in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        (["--precision", "bf16"], {"precision": "bf16-mixed"}),
        (["--precision", "fp32", "--optimizer", "adamw_8bit"], {"precision": "32-true", "optimizer": "adamw8bit"}),
        (["--attention", "flash_attention_2", "--precision", "16"], {"attention": "flash", "precision": "16-mixed"}),
    ],
    ids=["bf16", "fp32-adamw_8bit", "flash_attention_2-16"],
)
def test_aliases_give_the_same_plan_as_the_canonical_names(
    alias: list[str], canonical: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["calc", "batch-size", "--model", "llama-2-7b", "--gpu-memory", "81920", "--lora-rank", "8"]
    status, out, err = run([*argv, "--sequence-length", "1024", *alias], capsys)
    assert (status, err) == (0, "")
    spelled = [word for key, value in canonical.items() for word in (f"--{key}", value)]
    assert run([*argv, "--seq-len", "1024", *spelled], capsys) == (status, out, err)  # --seq-len: the short form
    estimate = estimate_memory("llama-2-7b", sequence_length=1024, lora_rank=8, **canonical)  # type: ignore[arg-type]
    assert recommended(out) == tuple(estimate.batch_sizes(81920 * 2**20).values())
    assert f"({canonical['precision']}, " in out  # the breakdown names the canonical precision


def test_calc_without_a_calculation_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(["calc"], capsys)
    assert (status, err.count("\n")) == (2, 1)
    assert "the following arguments are required: <calculation> (see 'lightning-tune calc --help')" in err


@pytest.mark.parametrize("flag", ["--model", "--gpu-memory", "--seq-len", "--lora-rank", "--grad-checkpointing"])
def test_a_flag_of_batch_size_given_to_calc_names_the_calculation(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(["calc", flag, "llama-2-7b"], capsys)
    assert status == 2
    assert err == (
        f"lightning-tune calc: error: {flag} is an option of 'lightning-tune calc batch-size': run "
        f"'lightning-tune calc batch-size {flag} ...'\n"
    )


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        pytest.param("24GB", 24 * 1024, id="GB-is-GiB"),
        pytest.param("24GiB", 24 * 1024, id="GiB"),
        pytest.param("80G", 80 * 1024, id="G"),
        pytest.param("24000MiB", 24000, id="MiB"),
        pytest.param("24000", 24000, id="bare-MiB"),
        pytest.param("1.5 tb", 1536 * 1024, id="decimal-lower-case-space"),
    ],
)
def test_gpu_memory_takes_units(text: str, mib: int, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run([*BASE, "--gpu-memory", text], capsys)
    assert err == ""
    assert f"({mib} MiB); peak = fixed total" in out
    estimate = estimate_memory("llama-2-7b", sequence_length=2048)
    assert recommended(out) == tuple(estimate.batch_sizes(mib * 2**20).values())


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(["calc", "batch-size", "--help"], capsys)
    assert status == 0
    for flag in ("--model", "--gpu-memory", "--sequence-length", "--precision", "--optimizer", "--lora-rank"):
        assert flag in out
    assert "--grad-checkpointing" in out


def test_a_null_dropout_in_a_config_means_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        '{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 100, "attn_pdrop": null}'
    )
    status, out, err = run(
        ["calc", "batch-size", "--model", str(config), "--gpu-memory", "1024", "--sequence-length", "128"], capsys
    )
    assert status == 0, err
    config.write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "attn_pdrop": "high"}')
    status, out, err = run(
        ["calc", "batch-size", "--model", str(config), "--gpu-memory", "1024", "--sequence-length", "128"], capsys
    )
    assert status == 2 and "`config.attn_pdrop` must be a number, got 'high'" in err


def test_what_would_fit_tries_the_loss_swap_and_bf16_true(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["calc", "batch-size", "--model", "llama-3-8b", "--gpu-memory", "80GB", "--sequence-length", "2048"]
    status, out, _ = run([*argv, "--optimizer", "adamw8bit", "--grad-checkpointing"], capsys)
    assert status == 1 and "Nothing fits: batch 1 needs 81.24 GiB" in out
    lean = estimate_memory(
        "llama-3-8b", sequence_length=2048, optimizer="adamw8bit", gradient_checkpointing=True, precision="bf16-true"
    )
    assert lean.max_batch_size(80 * 2**30) == 7
    assert "  --precision bf16-true: fits batch 7 (optimal margin); fixed total 48.03 GiB" in out
    assert "  --loss-swap: still does not fit: batch 1 needs 78.86 GiB, 6.86 GiB too much" in out
    # together, first those that still train every weight, then with LoRA
    assert "  --loss-swap --precision bf16-true: fits batch 26 (optimal margin)" in out
    assert "  --loss-swap --precision bf16-true --lora-rank 16: fits batch 67 (optimal margin)" in out
    assert "--optimizer adamw8bit:" not in out and "  --grad-checkpointing:" not in out  # already chosen


def test_what_would_fit_leaves_out_what_saves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["calc", "batch-size", "--model", "llama-2-7b", "--gpu-memory", "24GB", "--sequence-length", "2048"]
    status, out, _ = run([*argv, "--precision", "bf16-true", "--loss-swap"], capsys)
    assert status == 1 and "What would fit:" in out
    assert "--precision bf16-true:" not in out and "  --loss-swap:" not in out


@pytest.mark.parametrize(
    ("config", "parameters"),
    [
        pytest.param(
            {"n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 1000, "n_positions": 64}, "46.8 K", id="K"
        ),
        pytest.param({"n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 5000}, "1.17 M", id="M"),
        pytest.param({"n_embd": 768, "n_layer": 12, "n_head": 12}, "124 M", id="gpt2"),
    ],
)
@pytest.mark.slow
def test_small_models_print_their_parameters_in_a_readable_unit(
    config: dict[str, int], parameters: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = {**config, "bos_token_id": 0, "eos_token_id": 0}
    GPT2Config(**config).save_pretrained(tmp_path)
    count = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**config)).parameters())
    argv = ["calc", "batch-size", "--model", str(tmp_path), "--gpu-memory", "80GB", "--sequence-length", "16"]
    status, out, _ = run(argv, capsys)
    assert status == 0
    assert f"  Parameters              {parameters} ({count:,}; {count:,} trainable)" in out


@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["unbuffered", "buffered"])
def test_a_reader_that_closes_early_ends_the_command_quietly(unbuffered: str) -> None:
    """``lightning-tune calc ... | head``: no traceback, the status a shell gives a Unix tool stopped by SIGPIPE."""
    reader, writer = os.pipe()
    os.close(reader)  # the reader has gone before the first line is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lightning_tune", *BASE, "--gpu-memory", "24GB"],
            stdout=writer,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
            timeout=60,
        )
    finally:
        os.close(writer)
    assert done.stderr.decode() == ""
    assert done.returncode == 141


@pytest.fixture
def alarm() -> Iterator[None]:
    def expire(*_: object) -> None:
        pytest.fail("over 10 s")  # not an OSError, which the command would report as a usage error

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_million_layers_are_counted_at_once(alarm: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def plan(layers: int) -> tuple[str, int, int]:
        config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512}
        path = tmp_path / f"{layers}.json"
        path.write_text(json.dumps({**config, "num_hidden_layers": layers, "num_attention_heads": 4}))
        status, out, err = run(
            ["calc", "batch-size", "--model", str(path), "--gpu-memory", "80GB", "--seq-len", "64", "--lora-rank", "4"]
            + ["--optimizer", "adamw8bit"],
            capsys,
        )
        assert status in (0, 1) and err == ""
        estimate = estimate_memory(path, sequence_length=64, optimizer="adamw8bit", lora_rank=4)
        return out, estimate.parameters, estimate.optimizer_bytes

    _, one, state_one = plan(1)
    _, two, state_two = plan(2)
    out, million, state = plan(10**6)
    assert million == one + (10**6 - 1) * (two - one)  # every layer counted, each alike
    assert state == state_one + (10**6 - 1) * (state_two - state_one)
    assert f"({million:,}; " in out
