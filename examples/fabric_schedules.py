"""Warm-up + cosine learning rates and plateau reductions in a ``lightning.fabric`` loop, without a Trainer.

The callbacks ``WarmupCosine`` and ``AdaptiveLROnPlateau`` are thin Trainer adapters over ``lightning_tune.lr``: a
schedule is a factor function of the optimizer step (``warmup_cosine``, its arguments bound with
``functools.partial``), ``ScheduleLR`` applies it to every parameter group's configured LR as a torch scheduler (step
it once per optimizer step; it saves and loads with ``state_dict``), and ``PlateauDetector`` decides when a monitored
value has stopped improving. A reduction multiplies the schedule (``ScheduleLR.scale_group``) instead of being
overwritten by it at the next step.

Run it (a few seconds on a CPU)::

    python examples/fabric_schedules.py --steps 40
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_tune.lr import PlateauDetector, ScheduleLR, warmup_cosine


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Fit a small regression with a warm-up + cosine schedule, halving the LR when the validation loss stalls.

    Args:
        argv: Command-line arguments (``None`` reads ``sys.argv``).

    Returns:
        ``{"lrs": the LR used at each optimizer step, "val_losses": one per evaluation, "reductions": steps where the
        LR was halved}``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--patience", type=int, default=1)
    args = parser.parse_args(argv)

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    fabric.seed_everything(0)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)

    factor = partial(warmup_cosine, warmup_steps=args.warmup_steps, total_steps=args.steps, min_ratio=0.01)
    scheduler = ScheduleLR(optimizer, factor)  # each group's LR: its configured LR times the factor of the step
    detector = PlateauDetector(mode="min", patience=args.patience)
    result: dict[str, list[float]] = {"lrs": [], "val_losses": [], "reductions": []}
    for step in range(args.steps):
        batch = torch.randint(0, len(x), (16,))
        loss = F.mse_loss(model(x[batch]), y[batch])
        fabric.backward(loss)
        result["lrs"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()  # once per optimizer step
        if (step + 1) % args.eval_every == 0:
            with torch.no_grad():
                val_loss = float(F.mse_loss(model(x[:64]), y[:64]))
            result["val_losses"].append(val_loss)
            if detector.update(val_loss):
                scheduler.scale_group(0, 0.5)  # the schedule goes on, at half height
                result["reductions"].append(float(step + 1))
            fabric.print(f"step {step + 1}: lr {optimizer.param_groups[0]['lr']:.5f}, val_loss {val_loss:.4f}")
    return result


if __name__ == "__main__":
    main()
