"""Shard a full-sequence batch across context-parallel (and sequence-parallel) ranks.

Layout (``seq_dim = 1``, embeddings ``[b, S, h]``; per-token tensors ``[b, S]`` or ``[S]``):

1. **CP** — rank ``i`` of the CP group keeps chunks ``i`` and ``2·cp−1−i`` of ``2·cp`` equal
   chunks (per sequence for packed input), taken with ``index_select``. No collective;
   the adjoint of ``index_select`` scatters the gradient into zeros, so each CP rank's
   full-sequence gradient holds only its own tokens (the colocated bridge all-reduces it).
2. **SP** (``sequence_parallel=True``) — the CP-local embeddings are then split in
   ``tp`` contiguous pieces; TP rank ``t`` keeps piece ``t``. No collective forward;
   backward all-gathers over TP. Per-token tensors (labels, loss mask, position ids) are
   *not* SP-split: in Megatron-style SP the LM head all-gathers the sequence back
   before the logits and the loss, so they are consumed at the CP-local length.

Example, ``S = 8``, ``cp = 2``, ``tp = 2``, SP on: CP rank 0 keeps tokens
``[0, 1, 6, 7]``; its TP rank 0 holds embeddings of ``[0, 1]``, TP rank 1 of ``[6, 7]``;
both hold labels / positions of ``[0, 1, 6, 7]``.

``None`` groups mean a single process (size 1), never a global group. Every rank of a
group must call ``shard`` / ``unshard`` with the same shapes; a mismatch across ranks
cannot be detected without a collective and would hang or corrupt the gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from .agreement import check_agreement, check_group_arg
from .cp_indices import (
    cp_gather_order,
    cp_shard_indices,
    cp_shard_indices_packed,
    normalize_cu_seqlens,
    seq_len_divisor,
)
from .primitives import gather_along, gather_keep_grad, group_rank, group_size, scatter_along

__all__ = ["PartitionAdapter", "ShardedBatch"]

CuSeqlens = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's part of a batch (see :class:`PartitionAdapter` for the layout).

    - ``embeddings``: ``[b, S/cp, h]`` (``[b, S/(cp·tp), h]`` with SP), autograd-connected.
    - ``labels``, ``loss_mask``: CP-local ``[b, S/cp]`` (or ``[S/cp]``), ``None`` if not given.
    - ``position_ids``: the *original* positions of the local tokens, ``[b, S/cp]`` or
      ``[S/cp]`` as given; when not given, ``arange(S)`` expanded to ``[b, S]`` (``[S]`` for
      2-D ``[T, h]`` embeddings, which have no batch dim) and sharded.
    - ``cu_seqlens``: the *global* cumulative lengths (LongTensor) for packed input, else
      ``None``; the local ones are ``cu_seqlens // cp``. ``context_parallel_attention``
      takes the global ones.
    """

    embeddings: torch.Tensor
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None


def _token_dim(t: torch.Tensor) -> int:
    return 0 if t.dim() == 1 else 1


class PartitionAdapter:
    """Shards full-sequence batches for CP (load-balanced) and optional SP, and inverts it.

    Args:
        cp_group: context-parallel group (``None`` = no CP).
        tp_group: tensor-parallel group, used only with ``sequence_parallel=True``.
        sequence_parallel: also split the CP-local embeddings across ``tp_group``.
        seq_dim: sequence dim of embeddings / hidden states (1 for ``[b, s, h]``, 0 for
            ``[s, b, h]``). Per-token tensors are always ``[b, s]`` or ``[s]``.

    Divisibility: ``S`` (and every packed length) by ``2·cp``; with SP, ``S`` by ``2·cp·tp``.
    With ``cp = 1`` the factor 2 is dropped (nothing to balance): any ``S``, or ``S`` a
    multiple of ``tp`` with SP.
    """

    def __init__(
        self,
        *,
        cp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
    ) -> None:
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
            raise TypeError(f"seq_dim must be an int, got {seq_dim!r}")
        check_group_arg("cp_group", cp_group)
        check_group_arg("tp_group", tp_group)
        self.cp_group = cp_group
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.cp_size = group_size(cp_group)
        self.cp_rank = group_rank(cp_group)
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)

    def __repr__(self) -> str:
        return (
            f"PartitionAdapter(cp={self.cp_size}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}, seq_dim={self.seq_dim})"
        )

    # ------------------------------------------------------------------ pure helpers
    def _check_len(self, seq_len: int, sequence_parallel: bool, what: str) -> None:
        sp = sequence_parallel and self.tp_size > 1
        factor = seq_len_divisor(self.cp_size, self.tp_size, sequence_parallel=sp)
        if seq_len % factor:
            cp_part = "2·cp" if self.cp_size > 1 else "cp"
            need = (
                f"{cp_part}·tp={factor} (cp={self.cp_size}, tp={self.tp_size}, sequence parallel)"
                if sp
                else f"2·cp={factor} (cp={self.cp_size})"
            )
            raise ValueError(
                f"{what}={seq_len} must be divisible by {need}; pad the sequence to a "
                f"multiple of {factor}"
            )

    def local_indices(
        self, seq_len: int, *, cu_seqlens: CuSeqlens | None = None, device=None
    ) -> torch.Tensor:
        """Global token indices this CP rank keeps (see :func:`cp_shard_indices`)."""
        if cu_seqlens is None:
            return cp_shard_indices(seq_len, self.cp_size, self.cp_rank, device=device)
        bounds = normalize_cu_seqlens(cu_seqlens, seq_len_divisor(self.cp_size), total=seq_len)
        return cp_shard_indices_packed(bounds, self.cp_size, self.cp_rank, device=device)

    # ------------------------------------------------------------------------ shard
    def shard(
        self,
        embeddings: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> ShardedBatch:
        """This rank's :class:`ShardedBatch` of a full-sequence batch.

        Collectives: none forward. Backward: embeddings' gradient is zero outside this CP
        rank's tokens (``index_select`` adjoint); with SP it is first all-gathered over TP.
        Packed input (``cu_seqlens``, global ``[0, l0, l0+l1, ...]``) is sharded per sequence.
        """
        if not isinstance(embeddings, torch.Tensor):
            raise TypeError(f"embeddings must be a torch.Tensor, got {type(embeddings).__name__}")
        dim = self._seq_dim(embeddings, self.seq_dim, "embeddings")
        seq_len = embeddings.shape[dim]
        self._check_len(seq_len, self.sequence_parallel, f"sequence length embeddings.shape[{dim}]")
        bounds = None
        if cu_seqlens is not None:
            bounds = normalize_cu_seqlens(cu_seqlens, seq_len_divisor(self.cp_size), total=seq_len)
        # [b, s, h] / [s, b, h]: the batch is the other of dims 0 and 1. A 2-D [T, h]
        # (packed, seq_dim=0) has no batch dim: its default positions are 1-D [T].
        batch = embeddings.shape[1 - dim] if embeddings.dim() >= 3 and dim <= 1 else None
        for name, t in (
            ("labels", labels),
            ("loss_mask", loss_mask),
            ("position_ids", position_ids),
        ):
            if t is not None:
                self._check_token_tensor(name, t, seq_len, batch)

        check_agreement(  # the full batch is identical on every CP (and SP) rank
            "PartitionAdapter.shard",
            [self.cp_group, self.tp_group if self.sequence_parallel else None],
            {
                "embeddings.shape": tuple(embeddings.shape),
                "embeddings.dtype": embeddings.dtype,
                "cu_seqlens": bounds,
                "given (labels, loss_mask, position_ids)": tuple(
                    t is not None for t in (labels, loss_mask, position_ids)
                ),
            },
            identical={
                n: t
                for n, t in (("labels", labels), ("position_ids", position_ids))
                if t is not None
            },
            device=embeddings.device,
        )
        device = embeddings.device
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device)
            if batch is not None:
                position_ids = position_ids.repeat(batch, 1)  # materialised, not a view
        idx = self.local_indices(seq_len, cu_seqlens=bounds, device=device)

        def cp_take(t: torch.Tensor, d: int) -> torch.Tensor:
            if self.cp_size == 1:
                return t
            return t.index_select(d, idx.to(t.device))

        local = cp_take(embeddings, dim)
        if self.sequence_parallel:
            local = scatter_along(local, self.tp_group, dim)
        cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=device)
        return ShardedBatch(
            embeddings=local,
            labels=None if labels is None else cp_take(labels, _token_dim(labels)),
            loss_mask=None if loss_mask is None else cp_take(loss_mask, _token_dim(loss_mask)),
            position_ids=cp_take(position_ids, _token_dim(position_ids)),
            cu_seqlens=cu,
        )

    # ---------------------------------------------------------------------- unshard
    def unshard(
        self,
        x: torch.Tensor,
        *,
        seq_dim: int | None = None,
        cu_seqlens: CuSeqlens | None = None,
        sequence_parallel: bool | None = None,
        grad: Literal["slice", "sum"] = "slice",
    ) -> torch.Tensor:
        """The full-sequence tensor, in original order, on every rank (inverse of ``shard``).

        ``x`` is this rank's local tensor with its sequence along ``seq_dim`` (default: the
        adapter's, or 0 for a 1-D ``x``). ``sequence_parallel`` says whether ``x`` is also
        SP-split. Default: a per-token tensor -- one whose sequence dim is its last dim,
        ``[s]`` or ``[b, s]`` (labels, loss mask, positions, per-token losses) -- is not,
        as ``shard`` never SP-splits them; anything else (embeddings / hidden states end
        with ``h``) is SP-split iff the adapter is. ``cu_seqlens``: the global cumulative
        lengths if the batch was packed. E.g. with SP at tp=2, cp=2 and ``[2, 16, h]``
        input: ``unshard(batch.embeddings)`` gathers ``[2, 4, h]`` pieces and
        ``unshard(batch.labels)`` gathers ``[2, 8]`` pieces, both back to length 16.

        Forward: all-gather over TP (with SP), then over CP, then a fixed permutation back
        to sequence order — one all-gather per group of size > 1.
        Backward, chosen by ``grad``:

        - ``"slice"`` (default): the gradient of the full tensor is identical on every rank
          (every rank computes the same function of it, e.g. a loss on the full sequence);
          each rank keeps its own tokens' gradient. No collective.
        - ``"sum"``: each rank's gradient is a different partial (e.g. behind a
          column-parallel layer, or per-rank partial losses); they are summed with one
          reduce-scatter per group (the exact adjoint of the gather).
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if grad not in ("slice", "sum"):
            raise ValueError(f"grad={grad!r}; use 'slice' (replicated gradient) or 'sum'")
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool or None, got {sequence_parallel!r}")
        if seq_dim is None:
            seq_dim = 0 if x.dim() == 1 else self.seq_dim
        dim = self._seq_dim(x, seq_dim, "x")
        if sequence_parallel is None:
            per_token = x.dim() <= 2 and dim == x.dim() - 1
            sequence_parallel = self.sequence_parallel and not per_token
        sp = sequence_parallel
        full_len = x.shape[dim] * self.cp_size * (self.tp_size if sp else 1)
        self._check_len(full_len, sp, f"full sequence length (local {x.shape[dim]} x ranks)")
        check_agreement(
            "PartitionAdapter.unshard",
            [self.tp_group if sp else None, self.cp_group],
            {"x.shape": tuple(x.shape), "x.dtype": x.dtype, "seq_dim": dim, "sequence_parallel": sp,
             "grad": grad, "cu_seqlens": None if cu_seqlens is None else str(cu_seqlens)},
            device=x.device,
        )  # fmt: skip
        order = cp_gather_order(full_len, self.cp_size, cu_seqlens=cu_seqlens, device=x.device)

        gather = gather_keep_grad if grad == "slice" else gather_along
        if sp:
            x = gather(x, self.tp_group, dim)
        if self.cp_size == 1:
            return x
        x = gather(x, self.cp_group, dim)
        return x.index_select(dim, order.argsort())

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _seq_dim(t: torch.Tensor, seq_dim: int, name: str) -> int:
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
            raise TypeError(f"seq_dim must be an int, got {seq_dim!r}")
        if not -t.dim() <= seq_dim < t.dim():
            raise ValueError(
                f"seq_dim={seq_dim} is out of range for {name} of shape {tuple(t.shape)}; "
                f"use a dim in [{-t.dim()}, {t.dim() - 1}]"
            )
        return seq_dim % t.dim()

    @staticmethod
    def _check_token_tensor(name: str, t: torch.Tensor, seq_len: int, batch: int | None) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 1:
            ok = t.shape[0] == seq_len
        else:
            ok = t.dim() == 2 and t.shape[1] == seq_len and batch in (None, t.shape[0])
        if not ok:
            want = f"[{batch}, {seq_len}] or [{seq_len}]" if batch else f"[b, {seq_len}]"
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want} (per token)")
