"""Vocab-parallel token embedding (Megatron layout; any vocab size, explicit TP group).

Each TP rank holds the rows of its :class:`VocabShard` ``[vocab_start_index,
vocab_end_index)`` of the padded vocab (padding rows past ``num_embeddings`` are zero; the
weight declares its shard with ``mark_sharded``, so ``from_full`` and the models'
``load_full_state`` / ``gather_full_state`` read the same declaration). A lookup takes
the rows this rank owns, writes zeros for the others, and sums over TP:

- default: all-reduce(SUM) over ``tp_group`` (``reduce_from_group``; backward identity),
  output ``[..., H]`` TP-replicated;
- ``sequence_parallel=True``: reduce-scatter(SUM) along ``seq_dim`` instead (backward
  all-gather), output holds this rank's contiguous ``1/tp`` of the sequence.

Example (vocab 1001, TP 4): rank 2 owns ids ``[502, 753)``; its weight is ``[251, H]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_bridge.checks import (
    FrozenSpec,
    agree,
    agreed,
    check_bool,
    check_group,
    check_int,
    check_tensor,
)
from mp_bridge.comm import group_rank, group_size, reduce_from_group, reduce_scatter_along
from mp_bridge.layers.megatron_state import (
    check_megatron_metadata,
    check_sharded_offsets,
    vocab_sharded_tensor,
)
from mp_bridge.layers.param_shards import KeepsShardSpecs, load_shard_, mark_sharded
from mp_bridge.layers.vocab_shards import VocabShard, vocab_shards

__all__ = ["VocabParallelEmbedding", "VocabShardModule"]


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    """A floating ``torch.dtype`` (weights are trained: integer rows have no gradient)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{name}={dtype!r} must be a floating torch.dtype (e.g. torch.float32 or "
            "torch.bfloat16): the weight is trained, and integer tensors have no gradient"
        )
    return dtype


def token_dim(seq_dim: int, ndim: int, what: str) -> int:
    """Normalize ``seq_dim`` against the ``ndim`` token dims (the hidden dim excluded)."""
    check_int("seq_dim", seq_dim)
    if not -ndim <= seq_dim < ndim:
        raise ValueError(
            f"seq_dim={seq_dim} is out of range for {what} with {ndim} token dim(s); "
            f"use a dim in [0, {ndim}) (batch-first [b, s, h] -> seq_dim=1)"
        )
    return seq_dim % ndim


def check_seq_split(length: int, tp: int, dim: int) -> None:
    """Sequence parallelism splits ``length`` tokens equally over ``tp`` ranks."""
    if length % tp:
        raise ValueError(
            f"sequence_parallel needs the sequence dim {dim} (length {length}) divisible by "
            f"the TP size {tp}; pad the sequence to a multiple of {tp}"
        )


class VocabShardModule(KeepsShardSpecs):
    """This TP rank's rows ``[vocab_start_index, vocab_end_index)`` of a ``[V, H]`` weight.

    The part ``VocabParallelEmbedding`` and ``VocabParallelLMHead`` share: argument checks,
    the shard (``vocab_shard``: ``vocab_shards(vocab, tp, multiple=multiple)[rank]``), a
    local ``[V_local, H]`` Parameter declared sharded along dim 0 over ``tp_group``
    (``mark_sharded``) whose padding rows (ids >= ``vocab``) are zero. ``tp_group=None``
    means one process (TP = 1).
    """

    def __init__(
        self,
        vocab: tuple[str, int],
        dim: tuple[str, int],
        tp_group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        seq_dim: int,
        multiple: int,
        init_method: Callable[[torch.Tensor], object] | None,
        dtype: torch.dtype,
        device: torch.device | str | None,
        weight: nn.Parameter | None = None,
    ):
        super().__init__()
        rows, width = check_int(*vocab, low=1), check_int(*dim, low=1)
        check_int("multiple", multiple, low=1)
        check_int("seq_dim", seq_dim)
        check_group("tp_group", tp_group)
        check_bool("sequence_parallel", sequence_parallel)
        if weight is None:
            check_float_dtype("dtype", dtype)
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.sequence_parallel = bool(sequence_parallel)
        self.seq_dim = seq_dim
        self.multiple = multiple
        self.vocab_shard: VocabShard = vocab_shards(rows, self.tp_size, multiple=multiple)[
            group_rank(tp_group)
        ]
        if weight is not None:  # tied: the owner initialized and declared it
            self.weight = weight
            return
        self.weight = self.new_rows(width, dtype=dtype, device=device)
        with torch.no_grad():
            if init_method is None:
                nn.init.normal_(self.weight, mean=0.0, std=0.02)
            else:
                init_method(self.weight)
            self.weight[self.vocab_shard.num_real :].zero_()

    @property
    def vocab_start_index(self) -> int:
        """First vocab id this rank holds (``vocab_shard.start``)."""
        return self.vocab_shard.start

    @property
    def vocab_end_index(self) -> int:
        """One past the last id this rank holds, padding included (``vocab_shard.stop``)."""
        return self.vocab_shard.stop

    def new_rows(self, *trailing: int, dtype: torch.dtype, device) -> nn.Parameter:
        """A ``[V_local, *trailing]`` Parameter declared sharded along dim 0 over TP."""
        shape = (self.vocab_shard.size, *trailing)
        param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        group, full = self.tp_group, self.vocab_shard.vocab_size
        return mark_sharded(param, dim=0, group=group, full_size=full)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron-core's ``dist_checkpointing`` form: ``{prefix + "weight": ShardedTensor}``
        of the padded global shape (``mp_bridge.layers.megatron_state``).

        ``metadata={"dp_cp_group": dp_group}`` is required (``None`` as the group: no DP);
        ``sharded_offsets``: megatron's prepended ``(axis, rank, size)`` triples. No collective.
        """
        return self._sharded_state_dict(("weight",), prefix, sharded_offsets, metadata)

    def _sharded_state_dict(
        self, names: tuple[str, ...], prefix: object, sharded_offsets: object, metadata: object
    ) -> dict:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix={prefix!r} must be a str, e.g. 'embedding.word_embeddings.'")
        offsets = check_sharded_offsets(sharded_offsets)
        dp_group = check_megatron_metadata(metadata)
        return {
            prefix + name: vocab_sharded_tensor(
                prefix + name,
                getattr(self, name),  # the Parameter itself: megatron loads into it in place
                tp_group=self.tp_group,
                dp_group=dp_group,
                sharded_offsets=offsets,
            )
            for name in names
        }

    @torch.no_grad()
    def zero_padding_(self) -> None:
        """Zero the padding rows (ids >= vocab) of this layer's own parameters (in place).

        Runs after every ``load_state_dict``: megatron's checkpoints hold its padding rows
        as they were (megatron does not zero them), and ours must be zero.
        """
        for param in self.parameters(recurse=False):
            param[self.vocab_shard.num_real :].zero_()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.zero_padding_()

    @staticmethod
    def check_full(weight: object) -> torch.Tensor:
        """``weight`` if it is a full floating ``[V, H]`` tensor, else ``TypeError`` /
        ``ValueError``."""
        check_tensor("weight", weight)
        if weight.dim() != 2:
            raise ValueError(f"weight must be a [V, H] tensor, got shape {tuple(weight.shape)}")
        check_float_dtype("weight.dtype", weight.dtype)
        return weight


@dataclass(frozen=True)
class EmbeddingSpec(FrozenSpec):
    """What every TP rank of one lookup must hold alike (the ids' bits are compared too)."""

    ids_shape: tuple[int, ...]
    weight_dtype: torch.dtype


class VocabParallelEmbedding(VocabShardModule):
    """Embedding ``[V, H]`` split by vocab rows over ``tp_group`` (``None`` = one process).

    Args: ``num_embeddings`` (true vocab V), ``embedding_dim`` (H), ``multiple`` (rows per
    rank are a multiple of it), ``init_method`` (in-place init of the local ``[V_local, H]``
    shard; default normal(0, 0.02); use ``from_full`` for TP-independent weights).
    Forward: ``ids [...]`` (integer, in ``[0, num_embeddings)``, checked locally before the
    collective; same on every TP rank) -> ``[..., H]`` (see the module docstring for SP).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        multiple: int = 1,
        init_method: Callable[[torch.Tensor], object] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        vocab, width = ("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)
        super().__init__(
            vocab, width, tp_group, sequence_parallel, seq_dim, multiple, init_method, dtype, device
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        *,
        tp_group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        multiple: int = 1,
    ) -> VocabParallelEmbedding:
        """Keep this rank's rows of a full ``[V, H]`` weight (padding rows zero); copies."""
        weight = cls.check_full(weight)
        emb = cls(
            weight.shape[0],
            weight.shape[1],
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            seq_dim=seq_dim,
            multiple=multiple,
            init_method=nn.init.zeros_,
            dtype=weight.dtype,
            device=weight.device,
        )
        load_shard_(emb.weight, weight)
        return emb

    @agreed("mp_bridge.layers.VocabParallelEmbedding.forward")
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` -> embeddings ``[..., H]`` (SP: seq_dim split over TP)."""
        check_tensor("ids", ids, dtype="int", fix="pass token ids, e.g. ids.long()")
        if self.sequence_parallel and self.tp_size > 1:
            dim = token_dim(self.seq_dim, ids.dim(), f"ids of shape {tuple(ids.shape)}")
            check_seq_split(ids.shape[dim], self.tp_size, dim)
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bool(bad.any()):  # host sync, but a bad id must not become a silent zero row
            raise ValueError(
                f"ids hold {int(ids[bad].flatten()[0])}, outside [0, {self.num_embeddings}) "
                f"(num_embeddings={self.num_embeddings}); check the tokenizer / vocab size"
            )
        agree(  # every TP rank embeds the same ids
            "VocabParallelEmbedding.forward",
            self.tp_group,
            EmbeddingSpec(tuple(ids.shape), self.weight.dtype),
            identical={"ids": ids},
            device=ids.device,
        )
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = torch.where(outside, 0, ids - self.vocab_start_index)
        out = F.embedding(local_ids, self.weight)
        # masked_fill's adjoint zeroes those grads, so row 0 gets nothing from foreign ids.
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_along(out, self.tp_group, dim)
        return reduce_from_group(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"rows=[{self.vocab_start_index}, {self.vocab_end_index}), "
            f"sequence_parallel={self.sequence_parallel}"
        )
