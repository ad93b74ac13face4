"""Hostile configuration files end quickly in one short error naming the file, the line and the key."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_tune.config import from_config
from lightning_tune.config.loader import KEYS, LIMITS, MAX_MESSAGE
from tests.helpers import alarm

MAX_BYTES = 2048  # no message over 2 KB


def refused(source: Any, error: type[Exception] = ValueError) -> str:
    """The message ``from_config`` raises for ``source``, within 10 s and 2 KB."""
    with alarm(10), pytest.raises(error) as info:
        from_config(source)
    message = str(info.value)
    assert len(message.encode()) < MAX_BYTES, f"{len(message):,} characters: {message[:300]}"
    return message


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return path


def billion_laughs() -> str:
    """Nine levels of nine aliases: 9**9 (387 million) strings once expanded, in under 405 bytes."""
    lines = ["training:", "  micro_batch_size:", '    - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"    - &{n} [{','.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_the_alias(tmp_path: Path) -> None:
    text = billion_laughs()
    assert len(text.encode()) <= 405
    path = write(tmp_path, text)
    assert refused(path) == (
        f"configuration file {str(path)!r}, line 6, column 11: alias `*c` at `training.micro_batch_size[3][0]` "
        "repeats 820 values, and the aliases of the file would repeat 1,729 in all: more than the 1,000 allowed "
        "(write the values out, or repeat fewer)"
    )


def test_aliases_within_the_limit_and_merge_keys_still_load(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "training:\n  learning_rate: &lr {initial: 3e-4, schedule: linear_warmup, warmup_steps: 10}\n"
        "  dynamic_batch_size: {<<: {min_batch_size: 2, max_batch_size: 64}, max_batch_size: 32}\n"
        "  micro_batch_size: 4\n",
    )
    config = from_config(path)  # a merge key's values overridden in the same mapping are not duplicates
    assert (config.initial_lr, config.dynamic_batch_kwargs) == (3e-4, {"min_batch_size": 2, "max_batch_size": 32})
    recursive = write(tmp_path, "training: &a\n  dataloader: *a\n")
    assert refused(recursive) == (
        f"configuration file {str(recursive)!r}, line 2, column 15: alias `*a` at `training.dataloader` is inside "
        "the value it names"
    )


@pytest.mark.parametrize(
    ("text", "line"),
    [
        pytest.param(
            "training:\n  micro_batch_size: " + "[" * 100_000 + "]" * 100_000 + "\n", "line 2, column 51", id="flow"
        ),
        pytest.param(
            "training:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(2000)) + "  " * 2001 + "x: 1\n",
            "line 33, column 65",
            id="block",
        ),
    ],
)
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path: Path, text: str, line: str) -> None:
    path = write(tmp_path, text)
    message = refused(path)
    assert message.startswith(
        f"configuration file {str(path)!r}, {line}: values nested more than 32 deep at `training."
    )
    assert message.endswith("`; a training configuration nests a few levels")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "training:\n  precision: bf16\n  precision: fp32\n",
            "line 3, column 3: key `training.precision` is given twice (first at line 2)",
            id="block",
        ),
        pytest.param(
            "training:\n  learning_rate: {schedule: onecycle, 'schedule': linear_warmup}\n",
            "line 2, column 39: key `training.learning_rate.schedule` is given twice (first at line 2)",
            id="flow-quoted",
        ),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    suffix = "; PyYAML would keep the last silently: keep one"
    assert refused(path) == f"configuration file {str(path)!r}, {message}{suffix}"


def test_twenty_thousand_unknown_keys_are_one_short_problem(tmp_path: Path) -> None:
    keys = {f"k{i}": i for i in range(20_000)}
    for source in (
        {"training": keys},
        write(tmp_path, "training:\n" + "".join(f"  {k}: {v}\n" for k, v in keys.items())),
    ):
        message = refused(source)
        assert re.search(
            r"unknown keys `training.k0`, `training.k1`, .* and 19,995 more; allowed keys here: `amp`", message
        )
        assert "\n" not in message


def test_a_huge_value_is_shown_shortened(tmp_path: Path) -> None:
    path = write(tmp_path, f"training:\n  micro_batch_size: {'x' * 1_000_000}\n")
    message = refused(path, TypeError)
    assert message.startswith(
        f"configuration file {str(path)!r}: `training.micro_batch_size` must be an integer, got 'xxx"
    )
    assert re.search(r"xxx\.\.\. \(1,000,\d{3} characters, cut\)$", message)


def test_many_problems_fit_the_message_limit() -> None:
    training: dict[Any, Any] = {index: 0 for index in range(10_000)}  # 10,000 keys that are not strings
    training |= {"micro_batch_size": "x" * 10_000, "sequence_length": [0] * 10_000}
    message = refused(training, TypeError)
    lines = message.splitlines()
    assert lines[:3] == [
        "10,002 problems in the configuration:",
        "- keys of `training` must be strings, got 0",
        "- keys of `training` must be strings, got 1",
    ]
    assert re.fullmatch(r"- and 9,9\d\d more", lines[-1]) and len(message) <= MAX_MESSAGE


@pytest.mark.parametrize(
    ("training", "message"),
    [
        pytest.param(
            {"dataloader": {"num_workers": 100_000_000}},
            "`training.dataloader.num_workers` must be at most 1,024, got 100000000",
            id="num-workers",
        ),
        pytest.param(
            {"micro_batch_size": 10**32},
            "`training.micro_batch_size` must be at most 16,777,216, got 100000000000000000000000000000000",
            id="micro-batch",
        ),
        pytest.param(
            {"learning_rate": {"initial": 1e32}},
            "`training.learning_rate.initial` must be at most 100, got 1e+32",
            id="lr",
        ),
    ],
)
def test_numbers_above_their_limit_are_refused(training: dict[str, Any], message: str) -> None:
    assert refused(training) == message


def nested(key: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``"a.b"``, with what the key needs to be read at all (its schedule, fp16)."""
    out: dict[str, Any] = {}
    *sections, last = key.split(".")
    inner = out
    for section in sections:
        inner = inner.setdefault(section, {})
    inner[last] = value
    if sections == ["learning_rate"] and last not in ("initial", "schedule"):
        onecycle = last in ("max_lr", "pct_start", "div_factor", "final_div_factor", "anneal_strategy", "total_steps")
        inner["schedule"] = "onecycle" if onecycle else "linear_warmup" if "constant" in last else "cosine_with_warmup"
        if onecycle and last != "max_lr":
            inner["max_lr"] = 0.1
    if sections == ["mixed_precision"]:
        out |= {"precision": "fp16", "cpu_offload": {"enabled": True}}
    return out


@pytest.mark.filterwarnings("ignore:this machine .* lacks what the configuration needs")
@pytest.mark.parametrize("key", list(KEYS))
def test_every_key_refuses_a_number_too_large_or_not_finite(key: str) -> None:
    for value in (10**32, 1e300, float("inf"), float("nan")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            refused(nested(key, value), Exception)
    if key in LIMITS:  # the limit itself is allowed
        limit = LIMITS[key]
        value = [0, 1] if key == "multi_gpu.devices" else limit
        training = nested(key, value) | ({"micro_batch_size": limit} if "min_batch_size" in key else {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from_config(training)
            except ValueError as err:  # another rule may refuse the value: never the limit
                assert "must be at most" not in str(err)


def test_base_60_is_read_as_text(tmp_path: Path) -> None:
    path = write(tmp_path, "training:\n  micro_batch_size: 1:30\n  dataloader:\n    num_workers: 190:20:30.15\n")
    message = refused(path, TypeError)
    assert message.splitlines() == [
        f"2 problems in configuration file {str(path)!r}:",
        "- `training.micro_batch_size` must be an integer, got '1:30' (str)",  # YAML 1.1 would read 90
        "- `training.dataloader.num_workers` must be an integer, got '190:20:30.15' (str)",
    ]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "train.yaml"
    os.mkfifo(fifo)
    assert refused(fifo) == f"configuration file {str(fifo)!r} is not a regular file; give the path of a YAML file"


def test_an_integer_python_cannot_read_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, f"training:\n  micro_batch_size: {'9' * 5000}\n")
    message = refused(path)
    assert message.startswith(f"configuration file {str(path)!r} cannot be read: Exceeds the limit (4300 digits)")
    assert "\n" not in message
