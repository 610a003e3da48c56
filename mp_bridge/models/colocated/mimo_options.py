"""The build options of a colocated model, written once (``build_colocated_mimo`` and
``ColocatedMimoModel.from_groups`` / ``from_full`` take them as keywords).

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
===================  ========  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from mp_bridge.checks import check_bool, check_int
from mp_bridge.models.colocated.flows import parse_flow
from mp_bridge.models.colocated.parts import MimoFlow

__all__ = ["MimoOptions"]


@dataclass(frozen=True)
class MimoOptions:
    """The seven build options (module table); ``MimoOptions(**options)`` raises a
    ``TypeError`` naming an unknown keyword."""

    sequence_parallel: bool = False
    fused_loss: bool = False
    device: torch.device | None = field(default=None, compare=False)
    flow: str | MimoFlow = "gather"
    microbatches: int = 1
    schedule: str = "auto"
    balance: bool = False

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
        )

    def model_keywords(self) -> dict[str, object]:
        """The options the model's constructor takes (``flow`` to ``balance``)."""
        skip = ("sequence_parallel", "fused_loss", "device")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
