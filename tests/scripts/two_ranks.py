"""Every 2-process scenario of the suite in one launch: two CPU processes (gloo) start Python, torch and Lightning once.

``python two_ranks.py OUT [SCENARIO ...]`` runs the named scenarios (all but the GPU ones when none is named) one after
another in the same two processes; each writes what its rank saw to ``OUT/<scenario>/rank<r>.json``, or the error it
raised (once one fails on any rank, the later ones are not run). Lightning starts rank 1 by running this command again,
so both ranks run the same scenarios in the same order.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: name: (module in tests/scripts, its ``main``'s keyword arguments); the first creates the gloo group, with a 60 s
#: timeout on every collective, so a rank left waiting by the other's failure fails in a minute, not half an hour
SCENARIOS: dict[str, tuple[str, dict[str, Any]]] = {
    "dynamic_batch": ("ddp_dynamic_batch_script", {}),
    "dynamic_batch_reference": ("ddp_dynamic_batch_script", {"with_callback": False}),
    "eval_sized": ("ddp_dynamic_batch_eval_script", {"sized": True}),
    "eval_plain": ("ddp_dynamic_batch_eval_script", {"sized": False}),
    "features_ddp": ("fsdp2_features_script", {"strategy": "ddp"}),
    "features_fsdp2": ("fsdp2_features_script", {"strategy": "fsdp2"}),
    "loss_swap": ("ddp_loss_swap_script", {}),
    "lr": ("ddp_lr_script", {}),
    "pack_ddp": ("ddp_pack_script", {"strategy": "ddp"}),
    "pack_fsdp2": ("ddp_pack_script", {"strategy": "fsdp2"}),
    "plugin": ("ddp_plugin_script", {}),
    "throughput": ("ddp_throughput_script", {}),
    "varlen": ("ddp_varlen_script", {}),
}
#: FSDPStrategy refuses a CPU: run only by name, on a machine with 2 GPUs
GPU_SCENARIOS = {"features_fsdp": ("fsdp2_features_script", {"strategy": "fsdp", "only": ("dynamic_batch_refused",)})}


def main(out: Path, names: list[str]) -> None:
    seed = torch.initial_seed()  # what a fresh process starts from: each scenario starts from it too
    rank, failed = int(os.environ.get("LOCAL_RANK", 0)), ""
    for name in names or list(SCENARIOS):
        module, kwargs = {**SCENARIOS, **GPU_SCENARIOS}[name]
        where = out / name
        where.mkdir(parents=True, exist_ok=True)
        os.chdir(where)
        torch.manual_seed(seed)
        error = (
            f"not run: scenario {failed!r} failed before it, and the ranks may no longer be in step" if failed else ""
        )
        if not failed:
            try:
                importlib.import_module(f"tests.scripts.{module}").main(where, **kwargs)
            except Exception:  # noqa: BLE001 - recorded so the test names the failing scenario
                error = traceback.format_exc()[-4000:]
            failed = name if _on_any_rank(bool(error)) else ""
        if error:
            (where / f"rank{rank}.json").write_text(json.dumps({"error": error}))
    if dist.is_initialized():  # torn down before exit: exit-time teardown of a gloo group can abort
        with contextlib.suppress(Exception) if failed else contextlib.nullcontext():  # out of step: recorded already
            dist.barrier()
            dist.destroy_process_group()


def _on_any_rank(flag: bool) -> bool:
    """Whether any rank raised; a rank that raised alone leaves the other in a collective, which then times out."""
    if not dist.is_initialized():
        return flag
    try:
        agreed = torch.tensor([float(flag)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return flag or bool(agreed.item())
    except Exception:  # noqa: BLE001 - a collective out of step: the ranks are no longer in step
        return True


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), sys.argv[2:])
