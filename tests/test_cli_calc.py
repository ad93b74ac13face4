"""``lightning-tune calc batch-size``: the breakdown, the recommendation, the advice when nothing fits, bad input."""

from __future__ import annotations

import re
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


def test_says_plainly_when_nothing_fits_and_what_would(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run([*BASE, "--gpu-memory", "24576", "--precision", "fp16"], capsys)
    assert status == 1
    assert "Model size              12.55 GiB (16-mixed, 2 bytes each)" in out
    assert "Nothing fits: batch 1 needs 110.43 GiB and 21.60 GiB is usable at the optimal margin" in out
    assert "  --optimizer adamw8bit: still does not fit: batch 1 needs 73.71 GiB" in out
    assert "  --lora-rank 16: fits batch 1 (optimal margin)" in out
    assert "  --optimizer adamw8bit --grad-checkpointing --lora-rank 16: fits batch 6 (optimal margin)" in out
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
