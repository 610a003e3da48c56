"""The build options of a colocated model, written once (``build_colocated_mimo`` and
``ColocatedMimoModel.from_groups`` / ``from_full`` take them as keywords), and the flows
``flow=`` names (:data:`FLOWS`, :func:`parse_flow`).

===================  ========  ===============================================================
option               default   meaning
===================  ========  ===============================================================
sequence_parallel    False     split the LLM's local sequence across its TP ranks
fused_loss           False     fused linear cross-entropy (no ``[tokens, vocab/tp]`` logits)
device               None      where the shards live (``None``: the reference's device)
flow                 "gather"  ``"gather"`` or ``"routed"`` (or a :class:`~.parts.MimoFlow`)
microbatches         1         microbatches per ``train_step`` with a pipelined LLM
schedule             "auto"    the pipeline schedule with a pipelined LLM
balance              False     balance images over the encoder DP replicas before encoding
cp_comm              "all_g…"  how the LLM's attention moves K/V over CP: ``"all_gather"``,
                               ``"ring"`` or ``"a2a"`` (``context_parallel_attention``)
===================  ========  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from mp_bridge.checks import check_bool, check_choice, check_int
from mp_bridge.layers import COMM_MODES
from mp_bridge.models.colocated.gather import GatherFlow
from mp_bridge.models.colocated.parts import MimoFlow
from mp_bridge.models.colocated.routed import RoutedFlow

__all__ = ["FLOWS", "MimoOptions", "parse_flow"]

#: Flow name -> its class (``ColocatedMimoModel(flow=...)``, ``mp-bridge demo --flow``).
FLOWS: dict[str, type[MimoFlow]] = {"gather": GatherFlow, "routed": RoutedFlow}


def parse_flow(flow: str | MimoFlow) -> MimoFlow:
    """A :class:`MimoFlow` object as is, or the flow a name in :data:`FLOWS` names: the one
    place a flow name becomes a flow object (the model constructor, :class:`MimoOptions`
    and the demo CLI call it at their door).

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


@dataclass(frozen=True)
class MimoOptions:
    """The eight build options (module table); ``MimoOptions(**options)`` raises a
    ``TypeError`` naming an unknown keyword."""

    sequence_parallel: bool = False
    fused_loss: bool = False
    device: torch.device | None = field(default=None, compare=False)
    flow: str | MimoFlow = "gather"
    microbatches: int = 1
    schedule: str = "auto"
    balance: bool = False
    cp_comm: str = "all_gather"

    def agreed(self) -> tuple[tuple[str, object], ...]:
        """The options every rank of the grids must hold equal, validated (``TypeError`` /
        ``ValueError`` naming the option); ``device`` is local and not compared."""
        return (
            ("sequence_parallel", check_bool("sequence_parallel", self.sequence_parallel)),
            ("fused_loss", check_bool("fused_loss", self.fused_loss)),
            ("flow", parse_flow(self.flow).name),
            ("microbatches", check_int("microbatches", self.microbatches, low=1)),
            ("schedule", self.schedule),
            ("balance", check_bool("balance", self.balance)),
            ("cp_comm", check_choice("cp_comm", self.cp_comm, list(COMM_MODES))),
        )

    def model_keywords(self) -> dict[str, object]:
        """The options the model's constructor takes (``flow`` to ``balance``)."""
        skip = ("sequence_parallel", "fused_loss", "device", "cp_comm")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
