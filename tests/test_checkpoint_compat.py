"""Checkpoints written by an earlier release (commit 5d2ad38) still resume: same state, same samples, same LR.

The checkpoints in ``tests/data`` were saved mid-epoch by that commit's code (``tests/data/make_checkpoint_5d2ad38.py``
made them and records what its run did after the checkpoint). Each is resumed here with the same configuration and
must continue where the old run left off: from its global step, with DynamicBatchSize's micro-batch, decisions and
token budget, with exactly the samples of the epoch not yet trained, in the old run's order, with the LR of the
schedule at each step, and without a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from tests.data.make_checkpoint_5d2ad38 import EXPECTED, Trace, callbacks, checkpoint_name, cosine_lr, module, trainer

DATA = Path(__file__).parent / "data"
CASES = [pytest.param(case, id=case) for case in EXPECTED]
RESTORED = ("global_step", "epoch", "batch_size", "decisions", "micro_batch_tokens")


class AtResume(Callback):
    """What the run holds when its first step after the checkpoint starts."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.state is None:
            dyn = trainer.callbacks[0]  # type: ignore[attr-defined]
            self.state = {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "batch_size": dyn.batch_size,
                "decisions": dyn.decisions,
                "micro_batch_tokens": dyn.micro_batch_tokens,
            }


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_of_5d2ad38_resumes_where_it_stopped(tmp_path: Path, case: str) -> None:
    spec = EXPECTED[case]
    saved, after = spec["state"], spec["after"]
    trace, at_resume = Trace(), AtResume()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(case, tmp_path, [trace, at_resume]).fit(module(case), ckpt_path=DATA / checkpoint_name(case))
    # none of ours or Lightning's about the checkpoint (other arguments, callbacks missing, a sampler not resumable);
    # libraries' deprecation notices and Lightning's hint about DataLoader workers are no matter of the checkpoint
    notices = (DeprecationWarning, FutureWarning)
    messages = [str(w.message) for w in caught if not issubclass(w.category, notices)]
    assert not [m for m in messages if "does not have many workers" not in m], messages

    assert at_resume.state == {key: saved[key] for key in RESTORED}
    assert list(trace.steps) == list(after)  # from the saved step to the end of its epoch, none lost or repeated
    trained = [i for samples, *_ in trace.steps.values() for i in samples]
    assert len(trained) == len(set(trained)) == spec["n"] - saved["consumed"]
    assert set(trained) == set(range(spec["n"])) - set(saved["seen"])  # what the epoch had left, nothing else
    for step, (samples, lr, batch_size, tokens) in after.items():
        assert trace.steps[step][0] == samples, f"step {step}: other samples or order than the old run"
        if case == "tokens":  # the budget is restored; how short samples are grouped under it changed since (no
            # longer one a micro-batch when rounded up to `pad_to_multiple_of`), so the largest micro-batch may differ
            assert trace.steps[step][3] == tokens, f"step {step}: other token budget"
        else:
            assert trace.steps[step][2:] == (batch_size, tokens), f"step {step}: other micro-batch or token budget"
        assert trace.steps[step][1] == pytest.approx(lr, rel=1e-12), f"step {step}: other LR than the old run"
        # the schedule's documented formula at the step (0-based: the step before it is counted), halved by the
        # plateau's reduction at the end of epoch 1 where there is one
        reference = cosine_lr(spec, step - 1) * spec["plateau_scale"]
        assert trace.steps[step][1] == pytest.approx(reference, rel=1e-12), f"step {step}: off the schedule"


@pytest.mark.parametrize("case", CASES)
def test_fresh_callbacks_accept_every_saved_state(case: str) -> None:
    checkpoint = torch.load(DATA / checkpoint_name(case), weights_only=True)  # plain data: loads without pickles
    states: dict[str, Any] = checkpoint["callbacks"]
    fresh = {cb.state_key: cb for cb in callbacks(case)}
    assert set(states) <= set(fresh), f"saved states no callback claims: {set(states) - set(fresh)}"
    for key, state in states.items():
        fresh[key].load_state_dict(state)
    if case == "samples":
        plateau = fresh["AdaptiveLROnPlateau{'monitor': 'plateau_metric', 'mode': 'min'}"]
        assert plateau.reductions == 1  # type: ignore[attr-defined]
        saved = plateau.state_dict()
        assert saved.pop("arguments") == plateau.arguments()  # type: ignore[attr-defined]  # recorded since
        assert saved == states["AdaptiveLROnPlateau{'monitor': 'plateau_metric', 'mode': 'min'}"]
    assert checkpoint["global_step"] == EXPECTED[case]["state"]["global_step"]
    assert states["DynamicBatchSize"]["batch_size"] == EXPECTED[case]["state"]["batch_size"]
