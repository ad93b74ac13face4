"""FSDP2 modules gathered once per optimizer step, so that the step's micro-batches run with no collective.

A rank out of memory in a micro-batch would leave the others waiting in FSDP2's next collective; the gradients are
reduced only once the ranks agreed that every micro-batch ran (see "FSDP2 and FSDP" in the docs).

FSDP2 has no public call for some of this; the private ones (``_get_fsdp_state``, its parameter groups, the
end-of-backward callback) were checked on torch 2.13.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def fsdp2_modules(root: nn.Module) -> list[Any]:
    """The modules of ``root`` that ``fully_shard`` sharded, in module order (the same on every rank)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


class GatheredStep:
    """Gather the parameters of ``root``'s ``fully_shard`` modules for a whole step; reduce and reshard at its end.

    Example:
        >>> from torch import nn
        >>> step = GatheredStep(nn.Linear(2, 2))  # nothing sharded: every call is a no-op
        >>> step.begin(); step.drop_grads(); step.recover(); step.reduce()
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._saved: list[tuple[Any, list[tuple[Any, Any]], Any]] = []

    def begin(self) -> None:
        """All-gather every module's parameters and keep them whole, gradients unreduced, until the last backward."""
        modules = fsdp2_modules(self.root)
        if not self._saved:  # the modules' own reshard-after-forward, put back by end()
            for module in modules:
                state = module._get_fsdp_state()
                groups = [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]
                self._saved.append((state, groups, getattr(state, "_auto_reshard_after_forward", None)))
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
            module.set_requires_gradient_sync(False, recurse=False)
            module.unshard()  # a no-op where already gathered (a retried step)

    def drop_grads(self) -> None:
        """Drop the unreduced gradients on the gathered parameters (an optimizer's ``zero_grad`` reaches the shards)."""
        for module in fsdp2_modules(self.root):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None

    def recover(self) -> None:
        """After a failed attempt (on every rank, after the agreement): reset FSDP2's state and gather again.

        An exception inside a forward or backward leaves FSDP2 mid-iteration (its end-of-backward callback never ran).
        """
        modules = fsdp2_modules(self.root)
        if not modules:
            return
        reset = getattr(modules[0], "reset_iter_state", None)  # the outermost module is FSDP2's root
        if reset is None:
            raise RuntimeError(
                "DynamicBatchSize: this torch's FSDP2 cannot be reset after an out-of-memory error "
                "(FSDPModule.reset_iter_state is missing); upgrade torch"
            )
        reset()
        self.end()
        self.begin()

    def reduce(self) -> None:
        """Reduce-scatter the step's gradients and reshard, on every rank once they agreed that every micro-batch ran.

        FSDP2's end-of-backward callback reduces every parameter group that has not reduced yet (all: sync was off).
        """
        modules = fsdp2_modules(self.root)
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
        for module in modules:
            state = module._get_fsdp_state()
            if state._is_root:
                state._root_post_backward_final_callback()
        self.end()

    def end(self) -> None:
        """Put the modules' own reshard-after-forward back (for validation and the next step's first forward)."""
        for state, groups, auto in self._saved:
            for group, mesh_info in groups:
                group.post_forward_mesh_info = mesh_info
            if auto is not None:
                state._auto_reshard_after_forward = auto
        self._saved = []
