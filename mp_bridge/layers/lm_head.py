"""Column-parallel output layer producing vocab-parallel logits (optionally tied).

Weight ``[V_local, H]`` (and bias ``[V_local]``) holds this TP rank's :class:`VocabShard`
rows ``[vocab_start_index, vocab_end_index)`` of the padded vocab (the same layout as
``VocabParallelEmbedding``, so the two can share one Parameter; both declare it with
``mark_sharded``). Padding rows (ids >= ``vocab_size``) are zero; their logits are ignored
by ``vocab_parallel_cross_entropy``.

Forward ``h [..., H] -> logits [..., V_local]``:

- default: ``copy_to_group`` (fwd identity, bwd all-reduce(SUM) over TP: every rank's
  vocab slice contributes to dL/dh), then ``F.linear``;
- ``sequence_parallel=True``: ``h`` holds ``1/tp`` of the sequence along ``seq_dim``;
  all-gather it (bwd reduce-scatter(SUM)), then ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_bridge.checks import FrozenSpec, agree, agreed, check_bool, check_tensor
from mp_bridge.comm import copy_to_group, gather_along
from mp_bridge.layers.embedding import VocabParallelEmbedding, VocabShardModule, token_dim
from mp_bridge.layers.param_shards import load_shard_

__all__ = ["VocabParallelLMHead"]


@dataclass(frozen=True)
class HeadSpec(FrozenSpec):
    """h is TP-replicated, or (SP) split into equal sequence slices: same shape everywhere."""

    h_shape: tuple[int, ...]
    h_dtype: torch.dtype
    v_local: int


class VocabParallelLMHead(VocabShardModule):
    """Output projection ``H -> V`` split by vocab rows over ``tp_group`` (None = 1 process).

    ``tie_to=embedding`` shares ``embedding.weight`` (same vocab, hidden size, ``multiple``
    and TP group size required; checked). ``init_method`` initializes the local shard in
    place (default normal(0, 0.02)); ``from_full`` gives TP-independent weights.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = False,
        multiple: int = 1,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        tie_to: VocabParallelEmbedding | None = None,
        init_method: Callable[[torch.Tensor], object] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        check_bool("bias", bias)
        if tie_to is not None and not isinstance(tie_to, VocabParallelEmbedding):
            raise TypeError(f"tie_to must be a VocabParallelEmbedding, got {type(tie_to).__name__}")
        vocab, width = ("vocab_size", vocab_size), ("hidden_size", hidden_size)
        sp, tied = sequence_parallel, None if tie_to is None else tie_to.weight
        super().__init__(
            vocab, width, tp_group, sp, seq_dim, multiple, init_method, dtype, device, tied
        )
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.tied = tie_to is not None
        if tie_to is not None:
            self._check_tie(tie_to)
        if bias:
            self.bias = self.new_rows(dtype=self.weight.dtype, device=self.weight.device)
        else:
            self.register_parameter("bias", None)

    def _check_tie(self, emb: VocabParallelEmbedding) -> None:
        mine = (self.vocab_size, self.hidden_size, self.vocab_start_index, self.vocab_end_index)
        theirs = (
            emb.num_embeddings,
            emb.embedding_dim,
            emb.vocab_start_index,
            emb.vocab_end_index,
        )
        if mine != theirs or emb.tp_size != self.tp_size:
            raise ValueError(
                "tie_to: the embedding's (vocab, hidden, shard start, shard end, tp) = "
                f"{(*theirs, emb.tp_size)} differ from this head's {(*mine, self.tp_size)}; "
                "build both with the same vocab size, hidden size, multiple and TP group"
            )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron-core's ``dist_checkpointing`` form, as its language models give their
        output layer: ``weight`` (and ``bias``) rows over TP, padded global shape,
        ``allow_shape_mismatch=True``. A tied head leaves ``weight`` to its embedding (as
        megatron does when both sit on one stage). ``metadata`` as the embedding's.
        """
        names = ("weight",) * (not self.tied) + ("bias",) * (self.bias is not None)
        return self._sharded_state_dict(names, prefix, sharded_offsets, metadata)

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        tp_group: dist.ProcessGroup | None,
        multiple: int = 1,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
    ) -> VocabParallelLMHead:
        """Keep this rank's rows of a full ``[V, H]`` weight (and ``[V]`` bias); copies."""
        weight = cls.check_full(weight)
        if bias is not None:
            check_tensor("bias", bias)
            if bias.shape != weight.shape[:1]:
                raise ValueError(
                    f"bias must be a [V] = [{weight.shape[0]}] tensor, got {tuple(bias.shape)}"
                )
            if bias.dtype != weight.dtype:
                raise TypeError(
                    f"bias has dtype {bias.dtype} but weight has {weight.dtype}; pass both in "
                    f"one dtype (e.g. bias.to({weight.dtype}))"
                )
        head = cls(
            weight.shape[1],
            weight.shape[0],
            tp_group=tp_group,
            bias=bias is not None,
            multiple=multiple,
            sequence_parallel=sequence_parallel,
            seq_dim=seq_dim,
            init_method=nn.init.zeros_,
            dtype=weight.dtype,
            device=weight.device,
        )
        load_shard_(head.weight, weight)
        if bias is not None:
            load_shard_(head.bias, bias, name="bias")
        return head

    @agreed("mp_bridge.layers.VocabParallelLMHead.forward")
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [..., H]`` -> vocab-parallel logits ``[..., V_local]`` (SP: full sequence).

        ``h`` must have the weight's dtype (``TypeError`` otherwise, before any collective).
        """
        check_tensor("h", h, dtype="float", fix="pass hidden states, not token ids")
        if h.dtype != self.weight.dtype:
            raise TypeError(
                f"h has dtype {h.dtype} but the head's weight has {self.weight.dtype}; cast "
                f"one of them (e.g. h.to({self.weight.dtype}), or build the head with "
                f"dtype={h.dtype})"
            )
        if h.dim() < 1 or h.shape[-1] != self.hidden_size:
            raise ValueError(
                f"h must be [..., {self.hidden_size}] (hidden_size), got {tuple(h.shape)}"
            )
        spec = HeadSpec(tuple(h.shape), h.dtype, self.weight.shape[0])
        agree("VocabParallelLMHead.forward", self.tp_group, spec, device=h.device)
        if self.sequence_parallel and self.tp_size > 1:
            dim = token_dim(self.seq_dim, h.dim() - 1, f"h of shape {tuple(h.shape)}")
            h = gather_along(h, self.tp_group, dim)
        else:
            h = copy_to_group(h, self.tp_group)
        # (..., H) @ (V_local, H)^T -> (..., V_local)
        return F.linear(h, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, {self.vocab_size}, tp={self.tp_size}, "
            f"rows=[{self.vocab_start_index}, {self.vocab_end_index}), "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )
