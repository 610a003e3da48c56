"""The colocated step's agreement: every rank's parse of its inputs, agreed over the grid.

A bad batch on one rank (a label out of range on one DP replica, too many image tokens,
a wrong shape) must not leave the healthy ranks waiting in a collective the bad rank
never reaches. So each rank parses its inputs first, locally
(:func:`~mp_bridge.models.data.inputs.parse_step_inputs`), and the outcome goes through
:func:`mp_bridge.checks.agree` over the whole grid (the encoder TP group, then the encoder
DP group: together every rank) with a frozen :class:`StepSpec`: a rank's error becomes the
same ``AgreementError`` on every rank, naming that rank and its message.

Packed text adds what one grid-wide exchange cannot state: the ranks of one LLM DP
replica (its TP x CP ranks) hold the *same* ``cu_seqlens`` while other replicas hold their
own documents. One exchange over the replica's groups compares them
(:class:`ReplicaDocsSpec`), and a second grid-wide exchange spreads its outcome, so a
mismatch is the same ``AgreementError`` on every rank of the grid.

Ragged images in the gather flow: :func:`agree_image_counts` (route checks its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import agree
from mp_bridge.comm import Bridge, check_sample_counts
from mp_bridge.models.data.inputs import StepInputs

__all__ = ["WHERE", "ReplicaDocsSpec", "StepSpec", "agree_image_counts", "agree_step_inputs"]

WHERE = "ColocatedMimoModel.forward"

Groups = Sequence[dist.ProcessGroup | None]


@dataclass(frozen=True)
class StepSpec:
    """What every rank of the grid must agree on in one step (``None``: this rank's
    parse failed, its error travels instead)."""

    has_images: bool | None
    packed: bool | None

    def fields(self) -> Mapping[str, object]:
        return {
            "whether images are present": self.has_images,
            "whether the text is packed (cu_seqlens given)": self.packed,
        }


@dataclass(frozen=True)
class ReplicaDocsSpec:
    """The packed documents every rank of one LLM DP replica must hold."""

    cu_seqlens: tuple[int, ...]

    def fields(self) -> Mapping[str, object]:
        return {"cu_seqlens": self.cu_seqlens}


@dataclass(frozen=True)
class _Outcome:
    """No fields: an exchange that only spreads a replica's error to the grid."""

    def fields(self) -> Mapping[str, object]:
        return {}


def agree_step_inputs(
    parse: Callable[[], StepInputs],
    *,
    grid_groups: Groups,
    replica_groups: Groups,
    device: torch.device,
) -> StepInputs:
    """Run this rank's ``parse()`` and agree on its outcome over ``grid_groups``.

    Returns the parsed inputs (then agreed on every rank). Raises the same
    ``AgreementError`` (a ``ValueError``) on every rank when any rank's parse failed or
    the ranks disagree on images being present or on the text being packed; without a
    group of size > 1 the local error itself. Packed: the ranks of ``replica_groups``
    (their product: this rank's LLM DP replica) must hold the same ``cu_seqlens``.
    Collectives: one small all-gather per grid group of size > 1; packed, then one per
    replica group and one more per grid group.
    """
    try:
        inputs, error = parse(), None
        spec = StepSpec(inputs.has_images, inputs.packed)
    except (TypeError, ValueError) as exc:
        inputs, error, spec = None, exc, StepSpec(None, None)
    agree(WHERE, list(grid_groups), spec, device=device, error=error, always=True)
    assert inputs is not None  # agreed above: every rank parsed its inputs
    if inputs.packed:
        docs = ReplicaDocsSpec(tuple(inputs.cu_seqlens.tolist()))
        try:
            agree(
                f"{WHERE} (packed documents of one LLM DP replica)", list(replica_groups),
                docs, device=device, always=True,
            )  # fmt: skip
            replica_error = None
        except ValueError as exc:  # only this replica's ranks saw it: tell the grid
            replica_error = exc
        agree(WHERE, list(grid_groups), _Outcome(), device=device, error=replica_error,
              always=True)  # fmt: skip
    return inputs


def agree_image_counts(bridge: Bridge, inputs: StepInputs) -> None:
    """Every sample's placeholders equal its image tokens, agreed over the bridge's ranks.

    The gather flow's counterpart of ``route``'s count check: this rank's encoder batch
    names each sample's output tokens (``inputs.image_counts``), its LLM batch each
    sample's placeholders (``inputs.placeholders``). A mismatch in one LLM DP replica would
    otherwise raise in that replica only (at placement) and strand the others in the
    loss's all-reduce; here every rank raises the same ``ValueError`` naming the sample.
    Collectives: one small all-gather over ``bridge.world_group``
    (:func:`~mp_bridge.comm.check_sample_counts`). A bridge without a plan (one process:
    :class:`~mp_bridge.comm.LocalBridge`) has no peer to strand: nothing to agree.
    """
    if bridge.plan is None:
        return
    check_sample_counts(
        bridge.plan,
        dist.get_rank(),
        bridge.world_group,
        encoder_counts=inputs.image_counts.tolist(),
        llm_counts=inputs.placeholders.tolist(),
        device=inputs.input_ids.device,
        where=WHERE,
    )
