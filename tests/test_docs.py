"""docs/logged_keys.md lists exactly the keys of lightning_tune.keys, and the callbacks log exactly those."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_tune as lt
from lightning_tune import keys
from tests.helpers import Regressor, csv_rows, make_trainer

DOCS = Path(__file__).resolve().parents[1] / "docs"


def documented() -> list[tuple[str, str]]:
    """The rows of docs/logged_keys.md: (key, its 'When' column)."""
    text = (DOCS / "logged_keys.md").read_text()
    return re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|", text, flags=re.MULTILINE)


def test_logged_keys_table_is_the_keys_module() -> None:
    # every key of lightning_tune.keys documented once, and nothing else
    assert sorted(key for key, _ in documented()) == sorted(keys.ALL)


def test_the_callbacks_log_exactly_the_keys_of_the_keys_module(tmp_path: Path) -> None:
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
    token_trainer = make_trainer(
        tmp_path,
        [lt.ThroughputLatencyMonitor(), dynamic],
        max_steps=3,
        limit_val_batches=1,
        limit_predict_batches=1,
        logger=token_logger,
        log_every_n_steps=1,
    )
    gpt, tokens = DemoGPT(config), SyntheticTokenDataModule(4, seq_len=16, vocab_size=config.vocab_size)
    token_trainer.fit(gpt, datamodule=tokens)
    token_trainer.validate(gpt, datamodule=tokens)  # and predict: validation and predict tokens per second
    token_trainer.predict(gpt, datamodule=tokens)
    token_logger.save()
    # padded variable-length batches (Hugging Face's collator): the token budget and the padding share
    from tests.batch.test_dynamic_batch_varlen import Cheap, roomy
    from tests.hf_data import TokenDataset, long_tailed_lengths

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
    patterns = {key: keys.pattern(key) for key in keys.ALL}
    unmatched = {key for key in emitted if not any(p.match(key) for p in patterns.values())}
    assert not unmatched, f"logged but not in lightning_tune.keys: {sorted(unmatched)}"
    # GPU-only and multi-device keys cannot appear in a single-process CPU run; every other one must
    cpu_keys = {key for key, when in documented() if not any(w in when for w in ("GPU", "several"))}
    unused = {key for key in cpu_keys if not any(patterns[key].match(k) for k in emitted)}
    assert not unused, f"in lightning_tune.keys but never logged: {sorted(unused)}"


def test_monitor_page_documents_the_same_keys_as_the_overview() -> None:
    first_cells = re.findall(r"^\| (`perf/.+?) \|", (DOCS / "throughput.md").read_text(), flags=re.MULTILINE)
    page = [key for cell in first_cells for key in re.findall(r"`(perf/[^`]+)`", cell)]
    assert sorted(page) == sorted(key for key in keys.ALL if key.startswith("perf/"))


def test_every_public_name_has_a_docs_page() -> None:
    text = "".join(page.read_text() for page in DOCS.glob("*.md"))
    for name in lt.__all__:
        if not name.startswith("_"):
            assert f"`{name}" in text, f"{name} is public but no page under docs/ mentions it"


def _tables(text: str) -> list[list[tuple[int, str]]]:
    """Runs of consecutive lines starting with ``|`` outside code fences, each line with its number."""
    runs: list[list[tuple[int, str]]] = [[]]
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and line.startswith("|"):
            runs[-1].append((number, line))
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def test_every_table_in_the_docs_renders_as_one_table() -> None:
    """A header, a delimiter row, then rows of as many cells: rows cut off by a paragraph render as plain text."""

    def cells(line: str) -> int:
        return len(re.split(r"(?<!\\)\|", line.strip().removeprefix("|").removesuffix("|")))

    broken = []
    for page in sorted([*DOCS.glob("*.md"), DOCS.parent / "README.md"]):
        for (first, header), *rows in _tables(page.read_text()):
            if not rows or not re.fullmatch(r"\|( *:?-{3,}:? *\|)+", rows[0][1].strip()):
                broken.append(f"{page.name}:{first}: table rows without a header and delimiter row above them")
            broken += [
                f"{page.name}:{n}: {cells(row)} cells, header has {cells(header)}"
                for n, row in rows[1:]
                if cells(row) != cells(header)
            ]
    assert not broken, "\n".join(broken)
