"""The vocab layers in megatron-core's ``dist_checkpointing`` form (``sharded_state_dict``).

Megatron's format, not ours (``mp_bridge.checkpoint`` stores unpadded tensors): each TP
rank's ``[V_local, H]`` rows are one ``ShardedTensor`` of the *padded* global shape
``[tp * V_local, H]`` at row offset ``tp_rank * V_local``, with ``allow_shape_mismatch=True``
(what megatron's ``VocabParallelEmbedding`` and its language models' output layer set, so
a checkpoint of another padding loads), and ``replica_id = (0, 0, dp_rank)``: the rank of
DP replica 0 writes. The data-parallel group comes from ``metadata["dp_cp_group"]``, the
key megatron's own layers read; it is required, never looked up in ``parallel_state``.

Example (vocab 1001, TP 4, ``H`` = 8): TP rank 3 of DP rank 1 gives
``ShardedTensor(key="weight", local_shape=(251, 8), global_shape=(1004, 8),
global_offset=(753, 0), replica_id=(0, 0, 1), allow_shape_mismatch=True)``.

Megatron does not zero padding rows after a load (its own are random), so the layers
zero theirs after every ``load_state_dict`` (``VocabShardModule.zero_padding_``).
``megatron.core.dist_checkpointing`` is imported on the first call only (it is heavy).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mp_bridge.checks import check_group
from mp_bridge.comm import group_rank, group_size

__all__ = ["DP_GROUP_KEY", "check_megatron_metadata", "vocab_sharded_tensor"]

#: The ``metadata`` key megatron's ``sharded_state_dict`` implementations read the
#: data-parallel (× context-parallel) group from (megatron-core 0.16 - 0.19).
DP_GROUP_KEY = "dp_cp_group"


def check_megatron_metadata(metadata: object) -> dist.ProcessGroup | None:
    """The DP×CP group of ``metadata`` (``ValueError`` / ``TypeError`` naming the fix)."""
    if not isinstance(metadata, dict) or DP_GROUP_KEY not in metadata:
        raise ValueError(
            f"metadata={metadata!r} must be a dict holding the data-parallel group under "
            f"{DP_GROUP_KEY!r}: pass metadata={{'{DP_GROUP_KEY}': dp_group}} (the group of "
            "the ranks holding replicas of this layer; None for no data parallelism). It is "
            "never read from megatron's parallel_state"
        )
    group = metadata[DP_GROUP_KEY]
    check_group(f"metadata[{DP_GROUP_KEY!r}]", group)
    return group


def check_sharded_offsets(sharded_offsets: object) -> tuple[tuple[int, int, int], ...]:
    """Megatron's prepended ``(axis, rank, size)`` triples (e.g. for stacked layers)."""
    triples = tuple(sharded_offsets) if isinstance(sharded_offsets, (tuple, list)) else None
    if triples is None or not all(
        isinstance(t, tuple) and len(t) == 3 and all(isinstance(v, int) for v in t) for t in triples
    ):
        raise ValueError(
            f"sharded_offsets={sharded_offsets!r} must be a tuple of (axis, rank, size) int "
            "triples, as megatron passes them (usually ())"
        )
    return triples


def vocab_sharded_tensor(
    key: str,
    tensor: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    sharded_offsets: tuple[tuple[int, int, int], ...] = (),
) -> Any:
    """Megatron's ``ShardedTensor`` for ``tensor``, rows split over ``tp_group`` along dim 0.

    The same metadata as megatron's ``make_tp_sharded_tensor_for_checkpoint(tensor, key,
    allow_shape_mismatch=True, prepend_offsets=sharded_offsets, tp_group=...,
    dp_cp_group=...)``, built without it: that helper falls back to ``parallel_state``
    when both groups are ``None`` (one process). No collective.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    prepend = len(sharded_offsets)
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *sharded_offsets,
        (prepend, group_rank(tp_group), group_size(tp_group)),
        replica_id=(0, 0, group_rank(dp_group)),
        prepend_axis_num=prepend,
        allow_shape_mismatch=True,
    )
