"""The warn-once check of the Lightning versions that private internals were checked on."""

from __future__ import annotations

import warnings

import lightning
import pytest

from lightning_tune import _compat
from lightning_tune._compat import LIGHTNING_TESTED, check_lightning_version


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "_warned", set())


def _caught(call) -> tuple[object, list[str]]:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("installed", ["2.4.0", "2.6.5", "2.7.0", "3.0.0", "not-a-version"])
def test_outside_the_tested_range_warns_once_per_feature_naming_both_versions(installed: str) -> None:
    inside, messages = _caught(lambda: check_lightning_version("DynamicBatchSize", installed=installed))
    assert inside is False
    assert messages == [
        "DynamicBatchSize relies on private Lightning internals that were checked on lightning>=2.6.6,<2.7, but "
        f"lightning {installed} is installed; it may misbehave. Install 'lightning>=2.6.6,<2.7' to use "
        "DynamicBatchSize as tested."
    ]
    again, messages = _caught(lambda: check_lightning_version("DynamicBatchSize", installed=installed))
    assert again is False and messages == []  # once per feature
    _, messages = _caught(lambda: check_lightning_version("Other", installed=installed))
    assert len(messages) == 1


@pytest.mark.parametrize("installed", ["2.6.6", "2.6.9"])
def test_inside_the_tested_range_is_quiet(installed: str) -> None:
    assert _caught(lambda: check_lightning_version("DynamicBatchSize", installed=installed)) == (True, [])


def test_the_installed_lightning_is_read_and_is_the_tested_one() -> None:
    # The test environment runs the tested Lightning: this fails when the environment moves and the range does not.
    assert _caught(lambda: check_lightning_version("DynamicBatchSize")) == (True, []), (
        lightning.__version__,
        LIGHTNING_TESTED,
    )


def test_feature_must_be_named() -> None:
    with pytest.raises(TypeError, match=r"`feature` must be a non-empty string, got '' \(str\)"):
        check_lightning_version("")
