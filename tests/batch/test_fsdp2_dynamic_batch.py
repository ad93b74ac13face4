"""GatheredStep without a Trainer: FSDP2 micro-batches with no collective, retried after a failure mid-forward.

One process (a gloo group of one) shows the bookkeeping; the 2-process behaviour is in test_fsdp2_features.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_tune.batch.sharded import GatheredStep, fsdp2_modules


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


class Boom(Exception):
    pass


def test_gathered_step_accumulates_unreduced_then_reduces_and_recovers(group: None) -> None:
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    model = sharded()
    model(x)  # FSDP2's lazy initialisation, as a first step would do it
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    nn.functional.mse_loss(reference(x), y).backward()

    step = GatheredStep(model)
    assert len(fsdp2_modules(model)) == 3
    step.begin()
    groups = [g for m in fsdp2_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]
    # a first attempt fails inside the second layer's forward, after one micro-batch's backward ran
    (nn.functional.mse_loss(model(x[:3]), y[:3]) / 2).backward()
    hook = model[2].register_forward_hook(lambda *_: (_ for _ in ()).throw(Boom()))
    with pytest.raises(Boom):
        model(x[3:])
    hook.remove()
    step.drop_grads()
    step.recover()  # every rank: reset FSDP2's half-done step and gather again
    assert all(g.is_unsharded for g in groups)
    for part in (slice(0, 3), slice(3, 6)):  # the retry: two micro-batches, no reduction in between
        (nn.functional.mse_loss(model(x[part]), y[part]) / 2).backward()
        assert all(g.is_unsharded for g in groups)  # still gathered: the next forward needs no all-gather
        # unreduced: nothing on the shards yet (while gathered, the module's parameters are the whole ones)
        assert all(p.sharded_param.grad is None for g in groups for p in g.fsdp_params)
    step.reduce()
    assert all(not g.is_unsharded for g in groups)  # resharded
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        # the failed attempt's gradient is gone: the retry's sum equals the whole batch's gradient
        assert torch.allclose(ours.grad.full_tensor(), theirs.grad, atol=1e-6)
    # the modules' own reshard-after-forward is back: the blocks reshard after a forward again
    model(x)
    assert len(groups) == 2 and not any(g.is_unsharded for g in groups)  # (the root holds no parameter of its own)
