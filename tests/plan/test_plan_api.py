"""The planner's public surface: a sorted ``__all__`` that matches what is importable."""

from __future__ import annotations

import lightning_tune.plan as plan


def test_all_is_sorted_and_importable() -> None:
    assert plan.__all__ == sorted(plan.__all__)
    assert all(hasattr(plan, name) for name in plan.__all__)
    public = {
        k
        for k, v in vars(plan).items()
        if not k.startswith("_") and getattr(v, "__module__", "").startswith(plan.__name__)
    }
    assert public <= set(plan.__all__), public - set(plan.__all__)
    assert {"estimate_memory", "measure_memory", "MemoryEstimate", "plan_zero", "ZeroPlan", "TransformerShape"} <= set(
        plan.__all__
    )
