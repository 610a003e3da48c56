"""The flows a colocated model runs, by name (``flow="gather"`` / ``"routed"``).

:func:`parse_flow` is the one place a flow name becomes a :class:`~.parts.MimoFlow`
object; the model constructor and the demo CLI call it at their door.
"""

from __future__ import annotations

from mp_bridge.checks import check_choice
from mp_bridge.models.colocated.gather import GatherFlow
from mp_bridge.models.colocated.parts import MimoFlow
from mp_bridge.models.colocated.routed import RoutedFlow

__all__ = ["FLOWS", "parse_flow"]

#: Flow name -> its class (``ColocatedMimoModel(flow=...)``, ``mp-bridge demo --flow``).
FLOWS: dict[str, type[MimoFlow]] = {"gather": GatherFlow, "routed": RoutedFlow}


def parse_flow(flow: str | MimoFlow) -> MimoFlow:
    """A :class:`MimoFlow` object as is, or the flow a name in :data:`FLOWS` names.

    ``ValueError`` listing the names otherwise: ``'routed'`` (partition first, route
    image rows to the shards) or ``'gather'`` (full-sequence embeddings, then partition).
    """
    if isinstance(flow, MimoFlow):
        return flow
    check_choice(
        "flow", flow, list(FLOWS),
        fix="'routed' partitions first and routes image rows to the shards; 'gather' "
        "builds full-sequence embeddings, then partitions",
    )  # fmt: skip
    return FLOWS[flow]()
