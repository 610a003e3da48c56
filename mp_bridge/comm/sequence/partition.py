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

from mp_bridge.checks import agree, agreed, check_bool, check_group, check_int, check_tensor
from mp_bridge.comm.collectives.primitives import (
    gather_along,
    gather_keep_grad,
    group_rank,
    group_size,
    scatter_along,
)
from mp_bridge.comm.sequence.cut import (
    cp_gather_order,
    cp_shard_indices,
    cp_shard_indices_packed,
    normalize_cu_seqlens,
    seq_len_divisor,
)
from mp_bridge.comm.sequence.padding import PaddedLayout, original_layout, pad_along, pad_layout
from mp_bridge.comm.sequence.partition_specs import PartitionShardSpec, PartitionUnshardSpec

__all__ = ["PAD_LABEL", "PartitionAdapter", "ShardedBatch"]

CuSeqlens = PaddedLayout | Sequence[int] | torch.Tensor

#: Label written at padding tokens (the usual ``ignore_index``).
PAD_LABEL = -100


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's part of a batch (see :class:`PartitionAdapter` for the layout).

    Lengths below are of the *padded* layout (``S`` itself when no padding was needed).

    - ``embeddings``: ``[b, S/cp, h]`` (``[b, S/(cp·tp), h]`` with SP), autograd-connected;
      ``None`` when ``shard`` got no embeddings.
    - ``labels``, ``loss_mask``, ``input_ids``: CP-local ``[b, S/cp]`` (or ``[S/cp]``),
      ``None`` if not given. Padding tokens hold label ``PAD_LABEL`` (-100), loss mask 0
      and input id 0.
    - ``position_ids``: the *original* positions of the local tokens, ``[b, S/cp]`` or
      ``[S/cp]`` as given; when not given, ``arange(S)`` expanded to ``[b, S]`` (``[S]`` for
      2-D ``[T, h]`` embeddings, which have no batch dim) and sharded. Padding tokens
      continue their sequence: ``last + 1, last + 2, ...``.
    - ``cu_seqlens``: the *global* cumulative lengths of the padded layout (LongTensor) for
      packed input, else ``None``; the local ones are ``cu_seqlens // cp``.
      ``context_parallel_attention`` takes these.
    - ``token_mask``: bool CP-local ``[S/cp]``, ``True`` at real tokens, ``False`` at
      padding; ``None`` when nothing was padded.
    - ``layout``: the parsed :class:`PaddedLayout` of the step (plain or packed): pass it
      to ``route(layout=...)`` and ``context_parallel_attention(cu_seqlens=...)`` so
      neither parses ``cu_seqlens`` again.
    """

    embeddings: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    input_ids: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    layout: PaddedLayout | None = None


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

    Any length: a sequence (every packed document) is padded at its end to the cut
    (:func:`~mp_bridge.comm.sequence.padding.pad_layout`): ``S`` to a multiple of ``2·cp``
    (``2·cp·tp`` with SP; ``tp`` with SP at cp = 1; no padding at cp = 1 without SP),
    each packed document to a multiple of ``2·cp``, plus with SP one padding-only document
    completing the packed total to a multiple of ``2·cp·tp``. Cost: at most ``2·cp − 1``
    tokens per document (``cp − ½`` on average) and per plain row (``2·cp·tp − 1`` with
    SP) of compute and activation memory; already-divisible input is not padded at all.

    Padding contract: padding tokens get label ``PAD_LABEL`` (-100, the usual
    ``ignore_index``), loss mask 0 and ``token_mask`` False, so the loss skips them; with
    the padded ``ShardedBatch.cu_seqlens`` and ``position_ids`` (padding continues its
    document's positions at its end), causal ``context_parallel_attention`` never shows a
    padding key to a real query (it sits after every real token of its document), so
    real tokens' outputs are exactly those of the unpadded sequence. Non-causal attention
    would see padding keys: it needs input that is already divisible. ``unshard(x,
    cu_seqlens=<original>)`` (or ``seq_len=<original S>``) drops the padding again.
    """

    def __init__(
        self,
        *,
        cp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
    ) -> None:
        check_bool("sequence_parallel", sequence_parallel)
        check_int("seq_dim", seq_dim)
        check_group("cp_group", cp_group)
        check_group("tp_group", tp_group)
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
    @agreed("mp_bridge.comm.PartitionAdapter.shard")
    def shard(
        self,
        embeddings: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> ShardedBatch:
        """This rank's :class:`ShardedBatch` of a full-sequence batch.

        ``embeddings`` may be ``None`` (shard the integer tensors first, embed the local
        tokens after): the sequence length and batch then come from the first per-token
        tensor given. Sequences of any length are padded to the cut first (see the class
        docstring). Collectives: none forward. Backward: embeddings' gradient is zero
        outside this CP rank's tokens (``index_select`` adjoint); with SP it is first
        all-gathered over TP. Packed input (``cu_seqlens``, global ``[0, l0, l0+l1, ...]``)
        is sharded per sequence.
        """
        tokens = [
            ("input_ids", input_ids),
            ("labels", labels),
            ("loss_mask", loss_mask),
            ("position_ids", position_ids),
        ]
        if embeddings is not None:
            if not isinstance(embeddings, torch.Tensor):
                raise TypeError(
                    f"embeddings must be a torch.Tensor or None, got {type(embeddings).__name__}"
                )
            dim = self._seq_dim(embeddings, self.seq_dim, "embeddings")
            seq_len, device = embeddings.shape[dim], embeddings.device
            # [b, s, h] / [s, b, h]: the batch is the other of dims 0 and 1. A 2-D [T, h]
            # (packed, seq_dim=0) has no batch dim: its default positions are 1-D [T].
            batch = embeddings.shape[1 - dim] if embeddings.dim() >= 3 and dim <= 1 else None
        else:
            first = next((t for _, t in tokens if t is not None), None)
            if first is None:
                raise ValueError(
                    "shard() got no tensor: pass embeddings or at least one per-token tensor "
                    "(input_ids, labels, loss_mask or position_ids)"
                )
            if not isinstance(first, torch.Tensor) or first.dim() not in (1, 2):
                raise ValueError(
                    f"per-token tensors must be [b, S] or [S] tensors, got "
                    f"{getattr(first, 'shape', type(first).__name__)}"
                )
            seq_len, device = first.shape[-1], first.device
            batch = first.shape[0] if first.dim() == 2 else None
        for name, t in tokens:
            if t is not None:
                self._check_token_tensor(name, t, seq_len, batch)
        layout = self.layout(seq_len, cu_seqlens=cu_seqlens)
        pad = layout.padding > 0
        src = layout.source_index(device) if pad else None

        given = {name: t is not None for name, t in tokens}
        spec = PartitionShardSpec(
            None if embeddings is None else tuple(embeddings.shape),
            None if embeddings is None else embeddings.dtype,
            seq_len, layout.padded_bounds, tuple(sorted(given.items())),
        )  # fmt: skip
        agree(  # the full batch is identical on every CP (and SP) rank
            "PartitionAdapter.shard",
            [self.cp_group, self.tp_group if self.sequence_parallel else None],
            spec,
            identical={n: t for n, t in tokens if t is not None},
            device=device,
        )
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device)
            if batch is not None:
                position_ids = position_ids.repeat(batch, 1)  # materialised, not a view
        idx = layout.local_positions(self.cp_rank, device)

        def take(t: torch.Tensor | None, d: int, fill: float | None = 0) -> torch.Tensor | None:
            if t is None:
                return None
            if pad:
                t = pad_along(t, d, src, fill)
            if self.cp_size == 1:
                return t
            return t.index_select(d, idx.to(t.device))

        local = None
        if embeddings is not None:
            local = take(embeddings, dim)
            if self.sequence_parallel:
                local = scatter_along(local, self.tp_group, dim)
        token_mask = None
        if pad:
            real = torch.ones(seq_len, dtype=torch.bool, device=device)
            token_mask = take(real, 0, False)
        bounds = layout.padded_bounds
        cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=device)
        return ShardedBatch(
            embeddings=local,
            labels=take(labels, _token_dim(labels) if labels is not None else 0, PAD_LABEL),
            loss_mask=take(loss_mask, _token_dim(loss_mask) if loss_mask is not None else 0),
            position_ids=take(position_ids, _token_dim(position_ids), None),
            cu_seqlens=cu,
            input_ids=take(input_ids, _token_dim(input_ids) if input_ids is not None else 0),
            token_mask=token_mask,
            layout=layout,
        )

    def layout(self, seq_len: int, *, cu_seqlens: CuSeqlens | None = None) -> PaddedLayout:
        """The padded layout ``shard`` cuts a sequence of ``seq_len`` tokens with (pure)."""
        return pad_layout(
            seq_len,
            self.cp_size,
            self.tp_size,
            sequence_parallel=self.sequence_parallel,
            cu_seqlens=cu_seqlens,
        )

    # ---------------------------------------------------------------------- unshard
    @agreed("mp_bridge.comm.PartitionAdapter.unshard")
    def unshard(
        self,
        x: torch.Tensor,
        *,
        seq_dim: int | None = None,
        cu_seqlens: CuSeqlens | None = None,
        sequence_parallel: bool | None = None,
        grad: Literal["slice", "sum"] = "slice",
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """The full-sequence tensor, in original order, on every rank (inverse of ``shard``).

        ``x`` is this rank's local tensor with its sequence along ``seq_dim`` (default: the
        adapter's, or 0 for a 1-D ``x``). ``sequence_parallel`` says whether ``x`` is also
        SP-split. Default: a per-token tensor -- one whose sequence dim is its last dim,
        ``[s]`` or ``[b, s]`` (labels, loss mask, positions, per-token losses) -- is not,
        as ``shard`` never SP-splits them; anything else (embeddings / hidden states end
        with ``h``) is SP-split iff the adapter is. ``cu_seqlens``: the global cumulative
        lengths if the batch was packed: the original ones (padding is dropped) or the
        padded ``ShardedBatch.cu_seqlens`` (nothing dropped). ``seq_len``: the original
        length of a plain batch that ``shard`` padded (default: keep the padded length).
        E.g. with SP at tp=2, cp=2 and ``[2, 16, h]`` input: ``unshard(batch.embeddings)``
        gathers ``[2, 4, h]`` pieces and ``unshard(batch.labels)`` gathers ``[2, 8]`` pieces,
        both back to length 16.

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
        if sequence_parallel is not None:
            check_bool("sequence_parallel", sequence_parallel, fix="or None (the default)")
        if seq_dim is None:
            seq_dim = 0 if x.dim() == 1 else self.seq_dim
        dim = self._seq_dim(x, seq_dim, "x")
        if sequence_parallel is None:
            per_token = x.dim() <= 2 and dim == x.dim() - 1
            sequence_parallel = self.sequence_parallel and not per_token
        sp = sequence_parallel
        full_len = x.shape[dim] * self.cp_size * (self.tp_size if sp else 1)
        self._check_len(full_len, sp, f"full sequence length (local {x.shape[dim]} x ranks)")
        bounds, keep = None, None
        if cu_seqlens is not None or seq_len is not None:
            layout = original_layout(
                full_len, seq_len, cu_seqlens, self.cp_size, self.tp_size, self.sequence_parallel
            )
            bounds = layout.padded_bounds
            if layout.padding:
                keep = layout.kept_positions(x.device)
        spec = PartitionUnshardSpec(tuple(x.shape), x.dtype, dim, sp, grad, seq_len, bounds)
        agree("PartitionAdapter.unshard", [self.tp_group if sp else None, self.cp_group], spec,
              device=x.device)  # fmt: skip
        order = cp_gather_order(full_len, self.cp_size, cu_seqlens=bounds, device=x.device)

        gather = gather_keep_grad if grad == "slice" else gather_along
        if sp:
            x = gather(x, self.tp_group, dim)
        if self.cp_size > 1:
            x = gather(x, self.cp_group, dim)
            x = x.index_select(dim, order.argsort())
        return x if keep is None else x.index_select(dim, keep)

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _seq_dim(t: torch.Tensor, seq_dim: int, name: str) -> int:
        check_int("seq_dim", seq_dim)
        if not -t.dim() <= seq_dim < t.dim():
            raise ValueError(
                f"seq_dim={seq_dim} is out of range for {name} of shape {tuple(t.shape)}; "
                f"use a dim in [{-t.dim()}, {t.dim() - 1}]"
            )
        return seq_dim % t.dim()

    @staticmethod
    def _check_token_tensor(name: str, t: torch.Tensor, seq_len: int, batch: int | None) -> None:
        check_tensor(name, t, dtype="int" if name in ("input_ids", "position_ids") else None)
        if t.dim() == 1:
            ok = t.shape[0] == seq_len
        else:
            ok = t.dim() == 2 and t.shape[1] == seq_len and batch in (None, t.shape[0])
        if not ok:
            want = f"[{batch}, {seq_len}] or [{seq_len}]" if batch else f"[b, {seq_len}]"
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want} (per token)")
