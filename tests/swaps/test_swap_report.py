"""The optimizer swap reports the same whether OptimizerSwap or TunePlugin(optimizer=...) does it."""

from __future__ import annotations

import importlib
import logging
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_tune as lt
from lightning_tune import _imports, keys
from lightning_tune.swaps.optimizer import optimizer_state_bytes, swap_optimizer
from tests.helpers import Regressor, csv_rows, make_trainer

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # raised by torch.jit APIs bitsandbytes uses at import
    bnb = importlib.import_module("bitsandbytes") if _imports.is_available("bitsandbytes") else None
needs_bnb = pytest.mark.skipif(bnb is None, reason="needs bitsandbytes: pip install 'lightning-tune[bnb]'")


def _run(tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, **kwargs: object) -> tuple[str, list[dict]]:
    logger = CSVLogger(str(tmp_path), name=name)
    trainer = make_trainer(tmp_path, max_steps=3, logger=logger, log_every_n_steps=1, **kwargs)  # type: ignore[arg-type]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        torch.manual_seed(0)
        trainer.fit(Regressor(optimizer="adamw", n=16))
    logger.save()
    rows = [row for row in csv_rows(logger.log_dir) if row.get(keys.OPTIMIZER_STATE_BYTES)]
    assert len(rows) == 1 and float(rows[0][keys.OPTIMIZER_STATE_BYTES]) == optimizer_state_bytes(trainer.optimizers[0])
    lines = [r.getMessage() for r in caplog.records if "optimizer state" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0], rows


@needs_bnb
def test_the_plugin_prints_and_logs_the_state_as_the_callback_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    swap = lt.OptimizerSwap("adamw8bit", min_8bit_size=16)
    line, rows = _run(tmp_path, caplog, "callback", callbacks=[swap])
    plugin = lt.TunePlugin(optimizer="adamw8bit", min_8bit_size=16)
    plugin_line, plugin_rows = _run(tmp_path, caplog, "plugin", callbacks=[], plugins=[plugin])
    assert line.startswith("OptimizerSwap: optimizer state 0.") and "after the first step (AdamW: 0.00 MiB, " in line
    assert plugin_line == line.replace("OptimizerSwap:", "TunePlugin:", 1)
    assert plugin_rows[0]["step"] == rows[0]["step"] == "0"  # the first step, as self.log numbers it
    assert plugin_rows[0][keys.OPTIMIZER_STATE_BYTES] == rows[0][keys.OPTIMIZER_STATE_BYTES]


@pytest.mark.parametrize(
    "optimizer",
    [pytest.param("adamw_fused", id="fused"), pytest.param("adamw8bit", id="8bit", marks=needs_bnb)],
)
def test_the_swap_configured_twice_is_refused_naming_both(tmp_path: Path, optimizer: str) -> None:
    trainer = make_trainer(
        tmp_path, [lt.OptimizerSwap(optimizer)], max_steps=1, plugins=[lt.TunePlugin(optimizer=optimizer)]
    )
    match = rf"OptimizerSwap and TunePlugin\(optimizer='{optimizer}'\) both swap the optimizer"
    with pytest.raises(MisconfigurationException, match=match):
        trainer.fit(Regressor(optimizer="adamw"))


@needs_bnb
def test_frozen_embeddings_are_counted_in_the_frozen_row_not_named_as_kept() -> None:
    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 128), nn.Embedding(64, 64))
    model[0].weight.requires_grad_(False)  # a frozen embedding the module still hands its optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = swap_optimizer(torch.optim.AdamW(model.parameters()), optimizer="adamw8bit", module=model)
    rows = {line.split("  ")[0]: line.split("  ")[1:] for line in result.describe().splitlines()}
    kept, frozen = (
        [cell.strip() for cell in rows[label] if cell.strip()] for label in ("32-bit (kept)", "no state (frozen)")
    )
    assert kept == ["1", "4,096", "2.weight"]  # counted and named: the trainable embedding
    assert frozen == ["1", "4,096"]
    assert result.kept_32bit == ("2.weight",)
