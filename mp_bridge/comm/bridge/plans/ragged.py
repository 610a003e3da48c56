"""Which samples and tokens each rank holds in the ragged bridge: pure, from a BridgePlan.

Ragged data contract: a rank's src batch is ``n`` samples with per-sample token counts
``c`` (zeros allowed), flattened sample-major into ``[T, *rest]``, ``T = sum(c)``. As in the
uniform bridge, the global batch is split over DP in contiguous sample blocks in both
grids, so every member of a gather group holds the same number of samples.

A rank's step is described against its gather group's *concatenated batch*: the dest
batch for FAN_IN (the members' src batches, slot order), the src batch for FAN_OUT (the
members' dest batches, slot order: ``n / k`` samples each), the local batch for EQUAL.
:class:`RaggedRoute` holds the token count of every slot of it and this rank's range:

=========  =============================  =======================================
direction  forward                        backward (adjoint)
=========  =============================  =======================================
FAN_IN     exchange: receive every slot   keep ``own_range`` of the gradient
FAN_OUT    keep ``own_range`` of ``x``    exchange: receive every slot's gradient
EQUAL      copy                           identity
=========  =============================  =======================================

Example: FAN_IN k=2, rank in slot 1, members' counts ``(3, 0)`` and ``(2, 5)``:
``slot_tokens == (3, 7)``, ``own_range == (3, 10)``, ``dest_counts == (3, 0, 2, 5)``.
FAN_OUT k=2, src counts ``(3, 0, 2, 5)``, slot 1: ``slot_tokens == (3, 7)``,
``own_range == (3, 10)``, ``dest_counts == (2, 5)``.

This module never imports ``torch.distributed`` (nor torch): unit-testable with no group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mp_bridge.checks import is_int
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection

__all__ = ["RaggedRoute", "check_member_headers", "route_ragged", "route_ragged_trusted"]


@dataclass(frozen=True)
class RaggedRoute:
    """One rank's ragged bridge step (see the module docstring for the directions).

    - ``slot_tokens``: tokens of each slot of the gather group's concatenated batch, in
      slot order (``k`` entries; one for EQUAL).
    - ``slot``: this rank's slot (``plan.slot_of(rank)``).
    - ``dest_counts``: per-sample token counts of this rank's dest (LLM) batch.
    """

    direction: BridgeDirection
    slot: int
    slot_tokens: tuple[int, ...]
    dest_counts: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        """Tokens of the concatenated batch (FAN_IN ``T_dest``, FAN_OUT ``T_src``)."""
        return sum(self.slot_tokens)

    @property
    def own_range(self) -> tuple[int, int]:
        """``(start, stop)`` of this rank's slot in the concatenated batch's tokens."""
        start = sum(self.slot_tokens[: self.slot])
        return start, start + self.slot_tokens[self.slot]

    @property
    def exchanged_tokens(self) -> int:
        """Tokens this rank receives in the exchange (FAN_IN fwd, FAN_OUT bwd; EQUAL 0)."""
        return self.total_tokens - self.slot_tokens[self.slot]


def _check_counts(name: str, counts: Sequence[int]) -> tuple[int, ...]:
    out = tuple(counts)
    bad = [c for c in out if not is_int(c) or c < 0]
    if bad:
        raise ValueError(
            f"{name}={list(out)} has entries {bad} that are not non-negative ints; pass one "
            f"token count >= 0 per sample (0 for a text-only sample)"
        )
    return out


def check_member_headers(members: Sequence[int], sample_counts: Sequence[int]) -> None:
    """Raise unless every gather-group member passed the same number of samples.

    ``members``: the group's ranks in slot order; ``sample_counts``: each one's number of
    samples (exchanged in a fixed-size header, so every member raises the same error).
    """
    if len(set(sample_counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in zip(members, sample_counts))
        raise ValueError(
            f"the ranks of gather group {list(members)} passed different numbers of samples "
            f"in tokens_per_sample ({per_rank}); the global batch splits over DP in equal "
            f"sample blocks, so every member must pass the same number of samples (one "
            f"count per sample, 0 for a text-only sample)"
        )


def route_ragged(
    plan: BridgePlan, rank: int, member_counts: Sequence[Sequence[int]]
) -> RaggedRoute:
    """The ragged step of ``rank`` given its gather group's src per-sample token counts.

    ``member_counts``: the src counts of each member of ``plan.gather_group_of(rank)``, in
    slot order (``plan.scale`` entries). FAN_OUT and EQUAL members hold the same src batch
    (they are one src DP replica), so their entries must be equal. Raises ``ValueError``
    for negative or non-int counts, members with different numbers of samples, unequal
    FAN_OUT entries, or a FAN_OUT batch not divisible by ``k``.
    """
    members, k = plan.gather_group_of(rank), plan.scale
    if len(member_counts) != k:
        raise ValueError(
            f"member_counts has {len(member_counts)} entries but rank {rank}'s gather group "
            f"{list(members)} has {k} members; pass one count sequence per member"
        )
    counts = [_check_counts(f"member_counts[{i}]", c) for i, c in enumerate(member_counts)]
    check_member_headers(members, [len(c) for c in counts])
    if plan.direction is not BridgeDirection.FAN_IN and any(c != counts[0] for c in counts):
        raise ValueError(
            f"member_counts={[list(c) for c in counts]}: the members {list(members)} of a "
            f"{plan.direction.name} group hold the same src batch, so their counts must be equal"
        )
    return route_ragged_trusted(plan, rank, counts)


def route_ragged_trusted(
    plan: BridgePlan, rank: int, member_counts: Sequence[tuple[int, ...]]
) -> RaggedRoute:
    """:func:`route_ragged` on counts already checked (the communicator's path: its counts
    were parsed once by ``check_tokens_per_sample`` and, FAN_IN, its members' sample
    numbers compared in the header). Still raises for a FAN_OUT batch not divisible by
    ``k`` (a local fact nothing earlier checks)."""
    slot, k, direction = plan.slot_of(rank), plan.scale, plan.direction
    if direction is BridgeDirection.FAN_IN:
        slot_tokens = tuple(sum(c) for c in member_counts)
        dest = tuple(n for c in member_counts for n in c)
        return RaggedRoute(direction, slot, slot_tokens, dest)
    src = member_counts[0]
    if len(src) % k:
        raise ValueError(
            f"tokens_per_sample has {len(src)} samples but {direction.name} with scale {k} "
            f"splits the batch into {k} equal sample slots; use a local batch divisible by {k}"
        )
    per = len(src) // k
    slots = [src[i * per : (i + 1) * per] for i in range(k)]
    return RaggedRoute(direction, slot, tuple(sum(s) for s in slots), slots[slot])
