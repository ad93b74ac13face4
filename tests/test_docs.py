"""The documented logged keys are exactly the keys the callbacks emit."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_tune as lt
from tests.helpers import Regressor, csv_rows, make_trainer

DOCS = Path(__file__).resolve().parents[1] / "docs"
PLACEHOLDERS = {"{i}": r"\d+", "{j}": r"[1-9]\d*", "{q}": r"\d+(\.\d+)?"}


def documented() -> dict[str, tuple[re.Pattern[str], str]]:
    """Documented key -> (pattern matching the concrete keys, the 'When' column)."""
    text = (DOCS / "logged_keys.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|", text, flags=re.MULTILINE)
    out = {}
    for key, when in rows:
        pattern = re.escape(key)
        for placeholder, regex in PLACEHOLDERS.items():
            pattern = pattern.replace(re.escape(placeholder), regex)
        out[key] = (re.compile(pattern + "$"), when)
    return out


def test_logged_keys_table_matches_what_is_emitted(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(
        tmp_path,
        [
            lt.WarmupCosine(warmup_steps=2),
            lt.AdaptiveLROnPlateau(patience=0),
            lt.ThroughputLatencyMonitor(latency_budget_ms=60_000.0),  # emits the over-budget keys too
            lt.OptimizerSwap("adamw_fused"),
        ],
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=1,
        logger=logger,
        log_every_n_steps=1,
    )
    model = Regressor(group_lrs=[0.1, 0.01])
    trainer.fit(model)
    trainer.predict(model, dataloaders=DataLoader(torch.randn(4, 8), batch_size=2))
    logger.save()
    # token batches: a few steps of the demo GPT
    from lightning_tune.demos import DemoGPT, GPTConfig, SyntheticTokenDataModule

    token_logger = CSVLogger(str(tmp_path), name="tokens")
    config = GPTConfig(d_model=32, n_layers=1, seq_len=16)
    memory = lt.SimulatedMemory(total_bytes=10_000, fixed_bytes=2_000, bytes_per_sample=100)
    dynamic = lt.DynamicBatchSize(adjust_every=1, multiple_of=2, probe=memory)
    make_trainer(
        tmp_path, [lt.ThroughputLatencyMonitor(), dynamic], max_steps=3, logger=token_logger, log_every_n_steps=1
    ).fit(DemoGPT(config), datamodule=SyntheticTokenDataModule(4, seq_len=16, vocab_size=config.vocab_size))
    # padded variable-length batches (Hugging Face's collator): the token budget and the padding share
    from tests.hf_data import TokenDataset, long_tailed_lengths
    from tests.test_dynamic_batch_varlen import Cheap, roomy

    varlen_logger = CSVLogger(str(tmp_path), name="varlen")
    make_trainer(
        tmp_path,
        [lt.ThroughputLatencyMonitor(), lt.DynamicBatchSize(probe=roomy(), adjust_every=1)],
        max_steps=2,
        logger=varlen_logger,
        log_every_n_steps=1,
    ).fit(Cheap(TokenDataset(long_tailed_lengths(16, median=8, max_len=32))))
    rows = csv_rows(logger.log_dir) + csv_rows(token_logger.log_dir) + csv_rows(varlen_logger.log_dir)
    emitted = {k for row in rows for k, v in row.items() if v and k.startswith(("tune/", "perf/"))}
    table = documented()
    unmatched = {key for key in emitted if not any(p.match(key) for p, _ in table.values())}
    assert not unmatched, f"logged but not documented in docs/logged_keys.md: {sorted(unmatched)}"
    # GPU-only and multi-device keys cannot appear in a single-process CPU run; every other one must
    cpu_keys = {key for key, (_, when) in table.items() if not any(w in when for w in ("GPU", "several"))}
    unused = {key for key in cpu_keys if not any(table[key][0].match(k) for k in emitted)}
    assert not unused, f"documented but never logged: {sorted(unused)}"


def test_monitor_page_documents_the_same_keys_as_the_overview() -> None:
    page = set(re.findall(r"^\| `(perf/[^`]+)` \|", (DOCS / "throughput.md").read_text(), flags=re.MULTILINE))
    overview = {key for key in documented() if key.startswith("perf/")}
    assert page == overview


def test_every_public_name_has_a_docs_page() -> None:
    text = "".join(page.read_text() for page in DOCS.glob("*.md"))
    for name in lt.__all__:
        if not name.startswith("_"):
            assert f"`{name}" in text, f"{name} is public but no page under docs/ mentions it"
