"""The TP/CP(/SP) language model cut into pipeline stages by layer ranges.

Stage ``p`` of ``n`` holds the blocks :func:`stage_layers` gives it, keyed by their
*global* index (``blocks.<i>``), so every parameter keeps :class:`ReferenceLLM`'s name
and a stage loads its part of a full state dict directly. Stage 0 also holds ``embed``;
the last stage ``norm`` and ``head``. Same math as :class:`TPLLM`, split at block
boundaries.

A tied head (``cfg.tie_embeddings``) with ``n_stages > 1`` is Megatron's: the last stage
holds its own copy of the embedding, registered as ``embed`` too (so its name is
``embed.weight`` on both stages, :class:`ReferenceLLM`'s one name), and the head is tied
to that copy. Both copies load the same values; after backward the owner of the model
sums their gradients over the embedding group (the first and last stage of one
``(tp, cp, dp)`` coordinate; :meth:`TPLLMStage.tied_parameters`), so they take the same
optimizer step and stay equal.

- stage 0: (the caller embeds with :meth:`TPLLMStage.embed_tokens` and places image rows,
  then partitions) ``[b, s_local(/tp with SP), h]`` -> its blocks;
- every stage: :meth:`TPLLMStage.run_blocks` on sequence-first ``[s_local(/tp), b, h]``
  (the activation a stage sends to the next one);
- last stage: :meth:`TPLLMStage.token_loss` -> final norm -> vocab-parallel head ->
  fp32 per-token cross-entropy ``[b, s_local]``.

Attention in every block all-gathers K/V over ``cp_group`` with the causal mask on the
original ``position_ids`` (and packed ``cu_seqlens``), so every stage needs each
microbatch's position ids; only stage 0 needs ids, only the last labels.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.checks import check_bool, check_group, check_int
from mp_bridge.comm import group_size
from mp_bridge.layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    context_parallel_attention,
    rotary_positions,
    vocab_parallel_cross_entropy,
)
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.parallel.block_options import BlockOptions
from mp_bridge.models.parallel.sharding import FullStateMixin, build_from_full
from mp_bridge.models.parallel.tp_blocks import TPBlock, make_norm, parallel_config

__all__ = ["TPLLMStage", "stage_layers"]


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The global block indices of ``stage``: contiguous, as even as possible, the first
    ``n_layers mod n_stages`` stages one block longer. E.g. 5 layers, 2 stages: stage 0
    ``range(0, 3)``, stage 1 ``range(3, 5)``. Every stage gets at least one block."""
    n_layers = check_int("n_layers", n_layers, low=1)
    n_stages = check_int("n_stages", n_stages, low=1)
    stage = check_int("stage", stage, low=0, high=n_stages - 1)
    if n_layers < n_stages:
        raise ValueError(
            f"n_layers={n_layers} < n_stages={n_stages}: a pipeline stage would hold no "
            f"block; use at most {n_layers} stages or a model with >= {n_stages} layers"
        )
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class TPLLMStage(FullStateMixin, nn.Module):
    """Stage ``stage`` of ``n_stages`` of the reference LLM, sharded over ``tp_group``
    (weights) and ``cp_group`` (sequence); see the module docstring for what it holds.

    Gradients are partial over DP x CP (each rank sees its own tokens) and, with SP, the
    norms' gradients are partial over TP (``param.sequence_parallel``), as in TPLLM.
    """

    def __init__(
        self,
        cfg: MimoConfig,
        *,
        stage: int,
        n_stages: int,
        tp_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        cp_comm: str = "all_gather",
        device: torch.device | None = None,
    ):
        super().__init__()
        check_group("tp_group", tp_group)
        check_group("cp_group", cp_group)
        check_bool("sequence_parallel", sequence_parallel)
        cfg.check_tp(llm_tp=group_size(tp_group))
        cfg.check_cp_comm(cp_comm, llm_tp=group_size(tp_group), llm_cp=group_size(cp_group))
        self.layers = stage_layers(cfg.llm_layers, n_stages, stage)
        self.stage, self.n_stages = stage, n_stages
        self.cfg, self.tp_group, self.cp_group = cfg, tp_group, cp_group
        config = parallel_config(tp_group, sequence_parallel=sequence_parallel)
        self.sequence_parallel = config.sequence_parallel  # False when TP = 1
        core = functools.partial(
            context_parallel_attention, cp_group=cp_group, causal=True, comm=cp_comm
        )
        if self.is_first or (self.is_last and cfg.tie_embeddings):  # the last: the head's copy
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.llm_hidden, tp_group=tp_group)
        self.blocks = nn.ModuleDict(
            {
                str(i): TPBlock(
                    cfg.llm_hidden,
                    cfg.llm_heads,
                    cfg.llm_ffn,
                    eps=cfg.norm_eps,
                    tp_group=tp_group,
                    config=config,
                    core=core,
                    device=device,
                    options=BlockOptions.llm(cfg),
                )  # fmt: skip
                for i in self.layers
            }
        )
        if self.is_last:
            self.norm = make_norm(
                cfg.llm_hidden, cfg.norm_eps, device=device,
                sequence_parallel=self.sequence_parallel, kind=cfg.llm_norm,
            )  # fmt: skip
            self.head = VocabParallelLMHead(
                cfg.llm_hidden, cfg.vocab_size, tp_group=tp_group,
                sequence_parallel=self.sequence_parallel, seq_dim=1,
                tie_to=self.embed if cfg.tie_embeddings else None,
            )  # fmt: skip

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def tied_parameters(self) -> list[nn.Parameter]:
        """The embedding copy whose gradient the embedding group sums: ``[embed.weight]``
        on the first and the last stage of a tied pipeline (``n_stages > 1``), else
        ``[]``. Its gradient after backward is this stage's use only (the embedding's on
        the first stage, the head's on the last)."""
        tied = self.cfg.tie_embeddings and self.n_stages > 1 and (self.is_first or self.is_last)
        return [self.embed.weight] if tied else []

    @classmethod
    def from_full(cls, reference: nn.Module, cfg, *, device: torch.device | None = None, **kwargs):
        """This stage's TP shards of ``reference`` (a :class:`ReferenceLLM` or a state
        with its names): only the names this stage holds are loaded (no collective); draws
        no random numbers, whatever the stage holds (:func:`build_from_full`)."""
        return build_from_full(
            cls, reference, cfg, device=device,
            names=lambda model: dict(model.named_parameters(remove_duplicate=False)).keys(),
            **kwargs,
        )  # fmt: skip

    # ------------------------------------------------------------------ forward
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Stage 0: ``[b, s]`` ids -> ``[b, s, h]`` TP-replicated (one TP all-reduce)."""
        if not self.is_first:
            raise RuntimeError(f"stage {self.stage} has no embedding; only stage 0 embeds ids")
        return self.embed(input_ids)

    def run_blocks(
        self, x: torch.Tensor, position_ids: torch.Tensor, *, cu_seqlens=None
    ) -> torch.Tensor:
        """This stage's blocks on sequence-first ``[s_local(/tp with SP), b, h]``.

        ``position_ids``: the original positions ``[b, s_local]`` (CP-local, not SP-split);
        ``cu_seqlens``: packed, ``b = 1``, ``ShardedBatch.layout`` (rotary positions then
        restart per document) or the partition's padded global bounds."""
        rotary = rotary_positions(position_ids, cu_seqlens)
        for block in self.blocks.values():
            x = block(x, position_ids=position_ids, cu_seqlens=cu_seqlens, rotary_positions=rotary)
        return x

    def token_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Last stage: sequence-first hidden ``[s_local(/tp), b, h]`` after its blocks ->
        fp32 per-token cross-entropy ``[b, s_local]`` for CP-local ``labels [b, s_local]``
        (TP max / sum-exp all-reduces inside; the SP head all-gathers the sequence)."""
        if not self.is_last:
            raise RuntimeError(f"stage {self.stage} has no head; only the last stage does")
        hidden = self.norm(x).transpose(0, 1)  # [b, s_local(/tp), h]
        logits = self.head(hidden)  # [b, s_local, V/t]
        return vocab_parallel_cross_entropy(
            logits, labels, tp_group=self.tp_group, vocab_size=self.cfg.vocab_size
        )
