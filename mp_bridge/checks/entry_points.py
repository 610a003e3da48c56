"""The one table of collective entry points, and the ``@agreed`` mark that wires them.

A *collective entry point* is a public callable whose ranks must make the same collective
calls with the same arguments (shapes, dtypes, options) or hang, abort or return garbage.
Each one parses its arguments into a frozen spec and calls :func:`~mp_bridge.checks.agree`
before its first collective, and carries the mark::

    @agreed("mp_bridge.layers.masked_mean")
    def masked_mean(values, mask, *, group=None): ...

:data:`ENTRY_POINTS` lists them by public dotted name (the name a user imports, a method as
``Class.method``), each with the wing that owns it. The mark only records the name on the
function (``fn.__agreed__``) and checks the name is in the table: no wrapper, no cost per
call, and this floor-0 module never imports the floors that use it.
``tests/unit/test_entry_points.py`` walks the public API and fails when a callable that
runs a collective is neither in the table (and marked) nor exempted with a reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["ENTRY_POINTS", "agreed", "agreed_name"]

F = TypeVar("F", bound=Callable)

#: Public dotted name -> the wing that owns it.
ENTRY_POINTS: dict[str, str] = {
    # grid
    "mp_bridge.grid.make_grid": "grid",
    # comm: collectives
    "mp_bridge.comm.deterministic_all_reduce": "collectives",
    # comm: bridge
    "mp_bridge.comm.ColocatedBridgeCommunicator.__init__": "bridge",
    "mp_bridge.comm.ColocatedBridgeCommunicator.communicate": "bridge",
    "mp_bridge.comm.ColocatedBridgeCommunicator.communicate_ragged": "bridge",
    "mp_bridge.comm.ColocatedBridgeCommunicator.route": "bridge",
    "mp_bridge.comm.exchange_rows": "bridge",
    "mp_bridge.comm.ImageBalancer.plan": "bridge",
    "mp_bridge.comm.ImageBalancer.balance": "bridge",
    "mp_bridge.comm.ImageBalancer.restore": "bridge",
    # comm: sequence
    "mp_bridge.comm.PartitionAdapter.shard": "sequence",
    "mp_bridge.comm.PartitionAdapter.unshard": "sequence",
    # layers
    "mp_bridge.layers.VocabParallelEmbedding.forward": "layers",
    "mp_bridge.layers.VocabParallelLMHead.forward": "layers",
    "mp_bridge.layers.masked_sum": "layers",
    "mp_bridge.layers.masked_count": "layers",
    "mp_bridge.layers.masked_mean": "layers",
    "mp_bridge.layers.gather_shard": "layers",
    "mp_bridge.layers.context_parallel_attention": "sequence",
    # layers: loss
    "mp_bridge.layers.vocab_parallel_cross_entropy": "loss",
    "mp_bridge.layers.vocab_parallel_logprobs": "loss",
    "mp_bridge.layers.vocab_parallel_entropy": "loss",
    "mp_bridge.layers.fused_linear_cross_entropy": "loss",
    "mp_bridge.layers.fused_linear_logprobs": "loss",
    # models
    "mp_bridge.models.make_mimo_groups": "models",
    "mp_bridge.models.build_colocated_mimo": "models",
    "mp_bridge.models.ColocatedMimoModel.forward": "models",
    "mp_bridge.models.ColocatedMimoModel.parse_and_agree": "models",
    "mp_bridge.models.ColocatedMimoModel.train_step": "models",
    "mp_bridge.models.ColocatedMimoModel.sync_gradients": "models",
}


def agreed(name: str) -> Callable[[F], F]:
    """Mark a function (or method) as the collective entry point ``name`` of the table.

    ``KeyError`` at import time when ``name`` is not in :data:`ENTRY_POINTS` (add the row),
    so the table stays the one list. Returns the function itself.
    """
    if name not in ENTRY_POINTS:
        raise KeyError(
            f"@agreed({name!r}): not in mp_bridge.checks.entry_points.ENTRY_POINTS; add a row "
            "'public dotted name: wing' there"
        )

    def mark(fn: F) -> F:
        fn.__agreed__ = name  # type: ignore[attr-defined]
        return fn

    return mark


def agreed_name(fn: object) -> str | None:
    """The table name ``fn`` was marked with, or ``None`` (unwraps ``functools.wraps``)."""
    seen = 0
    while fn is not None and seen < 16:
        name = getattr(fn, "__agreed__", None)
        if name is not None:
            return name
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None
