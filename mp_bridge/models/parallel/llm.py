"""TP/CP(/SP) language model: vocab-parallel embedding, CP attention blocks, vocab-parallel head.

Data flow on one rank (``S`` full sequence, ``c`` CP size, ``t`` TP size):

1. :meth:`TPLLM.embed_tokens`: ids ``[b, s]`` -> ``[b, s, h]`` TP-replicated (vocab-parallel
   lookup + TP all-reduce), never SP-split. The MIMO model's gather flow embeds the full
   sequence (``s = S``) and places image embeddings before the partition adapter shards
   it; its routed flow embeds the CP-local ids (``s = S/c``) and SP-splits after.
2. :meth:`TPLLM.token_loss`: partitioned embeddings ``[b, S/c (/t with SP), h]`` and
   original ``position_ids [b, S/c]`` -> blocks (sequence-first inside; attention
   all-gathers K/V over CP with a causal mask on the original positions) -> final norm ->
   vocab-parallel logits ``[b, S/c, V/t]`` (the SP head all-gathers the sequence back) ->
   fp32 per-token cross-entropy ``[b, S/c]`` (TP max / sum-exp all-reduces inside).

Packed input (THD): ``b = 1``, the partition adapter's CP-local layout of the documents,
and ``cu_seqlens=ShardedBatch.layout`` (or its raw ``ShardedBatch.cu_seqlens``, parsed
once per step in :meth:`TPLLM.final_hidden`) threaded down to
``context_parallel_attention``, which keeps every query inside its own document.
``cu_seqlens=None`` (default) is the plain ``[b, S]`` path.

Gradients are partial over DP x CP (each rank sees its own tokens) and, with SP, the
norms' gradients are partial over TP too (``param.sequence_parallel``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.checks import check_group
from mp_bridge.comm import (
    PaddedLayout,
    gather_keep_grad,
    group_size,
    normalize_cu_seqlens,
    seq_len_divisor,
)
from mp_bridge.layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    context_parallel_attention,
    fused_linear_cross_entropy,
    rotary_positions,
    vocab_parallel_cross_entropy,
)
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.parallel.block_options import BlockOptions
from mp_bridge.models.parallel.sharding import FullStateMixin
from mp_bridge.models.parallel.tp_blocks import make_blocks, make_norm, parallel_config

__all__ = ["TPLLM"]


class _CausalCPAttention:
    """``(q, k, v, position_ids[, cu_seqlens])`` -> causal attention over the whole CP
    group's keys (packed: only keys of the query's own document)."""

    def __init__(self, cp_group: dist.ProcessGroup | None, comm: str = "all_gather"):
        self.cp_group, self.comm = cp_group, comm

    def __call__(self, q, k, v, *, position_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        return context_parallel_attention(
            q, k, v, cp_group=self.cp_group, position_ids=position_ids, causal=True,
            cu_seqlens=cu_seqlens, comm=self.comm,
        )  # fmt: skip


class TPLLM(FullStateMixin, nn.Module):
    """The reference LLM sharded over ``tp_group`` (weights) and ``cp_group`` (sequence).

    ``fused_loss=True`` computes the loss with ``fused_linear_cross_entropy`` from the
    final hidden states and the head's weight shard (no materialized logits).
    Parameter names equal :class:`ReferenceLLM`'s (``embed``, ``blocks``, ``norm``, ``head``).
    """

    def __init__(
        self,
        cfg: MimoConfig,
        *,
        tp_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        fused_loss: bool = False,
        cp_comm: str = "all_gather",
        device: torch.device | None = None,
    ):
        super().__init__()
        check_group("tp_group", tp_group)
        check_group("cp_group", cp_group)
        cfg.check_tp(llm_tp=group_size(tp_group))
        cfg.check_cp_comm(cp_comm, llm_tp=group_size(tp_group), llm_cp=group_size(cp_group))
        self.cfg, self.tp_group, self.cp_group = cfg, tp_group, cp_group
        config = parallel_config(tp_group, sequence_parallel=sequence_parallel)
        self.sequence_parallel = config.sequence_parallel  # False when TP = 1
        self.fused_loss = fused_loss
        # The vocab layers declare their weights' shards themselves (``mark_sharded``).
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.llm_hidden, tp_group=tp_group)
        self.blocks = make_blocks(
            cfg.llm_layers, cfg.llm_hidden, cfg.llm_heads, cfg.llm_ffn, eps=cfg.norm_eps,
            tp_group=tp_group, config=config, core=_CausalCPAttention(cp_group, cp_comm),
            device=device, options=BlockOptions.llm(cfg),
        )  # fmt: skip
        self.norm = make_norm(
            cfg.llm_hidden, cfg.norm_eps, device=device, sequence_parallel=self.sequence_parallel,
            kind=cfg.llm_norm,
        )  # fmt: skip
        self.head = VocabParallelLMHead(
            cfg.llm_hidden, cfg.vocab_size, tp_group=tp_group,
            sequence_parallel=self.sequence_parallel, seq_dim=1,
            tie_to=self.embed if cfg.tie_embeddings else None,
        )  # fmt: skip

    # ------------------------------------------------------------------ forward
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[b, S]`` ids -> ``[b, S, h]`` embeddings, TP-replicated (one TP all-reduce)."""
        return self.embed(input_ids)

    def final_hidden(
        self, embeddings: torch.Tensor, position_ids: torch.Tensor, *, cu_seqlens=None
    ) -> torch.Tensor:
        """Partitioned ``[b, s_local, h]`` -> normed hidden states of the same shape.

        ``cu_seqlens``: packed, ``b = 1``: ``ShardedBatch.layout`` (used as is), or the
        adapter's padded global bounds, parsed here once for every layer."""
        rotary = rotary_positions(position_ids, cu_seqlens)
        if cu_seqlens is not None and not isinstance(cu_seqlens, PaddedLayout):
            cp = group_size(self.cp_group)
            bounds = normalize_cu_seqlens(cu_seqlens, seq_len_divisor(cp))
            cu_seqlens = PaddedLayout.of_documents(bounds, cp)
        x = embeddings.transpose(0, 1)  # [s_local, b, h]: megatron's SP splits dim 0
        for block in self.blocks:
            x = block(x, position_ids=position_ids, cu_seqlens=cu_seqlens, rotary_positions=rotary)
        return self.norm(x).transpose(0, 1)

    def token_loss(
        self,
        embeddings: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        cu_seqlens=None,
    ) -> torch.Tensor:
        """fp32 per-token cross-entropy ``[b, S/c]`` for CP-sharded ``labels [b, S/c]``
        (packed: ``b = 1`` and ``cu_seqlens`` as in :meth:`final_hidden`)."""
        hidden = self.final_hidden(embeddings, position_ids, cu_seqlens=cu_seqlens)
        if not self.fused_loss:
            logits = self.head(hidden)  # [b, S/c, V/t]
            return vocab_parallel_cross_entropy(
                logits, labels, tp_group=self.tp_group, vocab_size=self.cfg.vocab_size
            )
        if self.sequence_parallel:
            # SP slices -> the full CP-local sequence. The fused op all-reduces d hidden
            # over TP itself, so every rank's gradient is already complete: keep our slice.
            hidden = gather_keep_grad(hidden, self.tp_group, dim=1)
        b, s, h = hidden.shape
        loss = fused_linear_cross_entropy(
            hidden.reshape(b * s, h), self.head.weight, labels.reshape(b * s),
            tp_group=self.tp_group, vocab_size=self.cfg.vocab_size, reduction="none",
        )  # fmt: skip
        return loss.view(b, s)
