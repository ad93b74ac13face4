"""FSDP2 modules gathered once per optimizer step, so that the step's micro-batches run with no collective.

Under FSDP2 (``fully_shard``) every module all-gathers its parameters before its forward and again before its
backward, and reduce-scatters its gradients after it. If one rank runs out of memory inside a micro-batch, the others
would wait forever in the next of those collectives. :class:`GatheredStep` removes them from the micro-batches: the
parameters are all-gathered once before the first micro-batch (every rank, in the same order) and kept whole through
every forward and backward, the last micro-batch's included, and the gradients accumulate unreduced. Only after the
ranks agreed that every micro-batch ran (:class:`~lightning_tune.batch.MicroBatchRunner`'s ``agree``) are they
reduce-scattered and the parameters resharded (:meth:`GatheredStep.reduce`). An allocation failure anywhere in the
step's forward and backward passes is therefore recoverable on every rank (:meth:`GatheredStep.recover`).

The cost is memory and overlap: during the step each rank holds the whole parameters and unreduced gradients (as
``reshard_after_forward=False``), and the reduce-scatters run after the backward passes instead of overlapping the
last one. In exchange a step all-gathers once per module instead of twice per micro-batch.

FSDP2 has no public call for some of this; the private ones (``_get_fsdp_state``, its parameter groups, the
end-of-backward callback) were checked on torch 2.13.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["GatheredStep", "fsdp2_modules"]


def fsdp2_modules(root: nn.Module) -> list[Any]:
    """The modules of ``root`` that ``fully_shard`` sharded, in module order (the same on every rank)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


class GatheredStep:
    """Gather an FSDP2 model's parameters for a whole step; reduce and reshard only in the last backward.

    Args:
        root: The model (the ``LightningModule``) holding the ``fully_shard`` modules.

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

        An exception inside a forward or backward leaves FSDP2 mid-iteration (its end-of-backward callback never ran);
        ``reset_iter_state`` on the root discards the attempt's gradients and reshards, then :meth:`begin` gathers
        the parameters for the retry, on every rank alike.
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
        """Reduce-scatter the step's accumulated gradients and reshard, as FSDP2's own end of backward does.

        Called on every rank once the ranks agreed that every micro-batch ran: the step's only collectives after
        :meth:`begin`'s all-gathers. It runs FSDP2's end-of-backward callback, which reduces every parameter group
        that has not reduced yet (all of them: gradient sync was off), then puts the modules' settings back.
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
