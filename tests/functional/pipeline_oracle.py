"""Oracle harness: the pipelined LLM (``TPLLMStage`` + ``LLMPipeline``) against the same
``ReferenceLLM`` trained in one process on the whole global batch.

Both sides see the same global batch (``synthetic_batch``: plain ``[B, S]`` rows or
packed documents) and a leaf of "image rows" ``[n_image_tokens, h]`` placed at the
image-token positions of the token embeddings (what the colocated model's gather flow
feeds the LLM). The distributed side splits the batch over LLM DP, each DP shard into
``M`` microbatches, and runs 3 Adam steps; it compares, worst over every rank: the loss,
the leaf gradient (stage 0, summed over CP as the bridge's backward does), every
parameter's synced gradient at step 1 and every weight after the last step (each stage
its own parameters, gathered over TP).

Device: both models, the batch and the image rows live on ``current_device()`` (the rows
are drawn on the CPU from a seeded generator first, so every device sees the same values).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_bridge.comm.sequence import PartitionAdapter
from mp_bridge.grid import GridLayout, destroy_grid, make_grid
from mp_bridge.models import MimoConfig, ReferenceLLM, synthetic_batch
from mp_bridge.models.parallel import (
    LLMPipeline,
    TPLLMStage,
    agree_capacity,
    gather_full_state,
    packed_length,
    pad_packed_to,
)
from mp_bridge.models.reference.model import packed_causal_mask, reference_masked_mean
from mp_bridge.testing import current_device

DOC_LENGTHS = (9, 13, 8, 11, 6, 21, 15, 12)


def _batch(cfg: MimoConfig, packed: bool, seed: int):
    if packed:
        return synthetic_batch(cfg, 8, seed=seed, uneven_mask=True, doc_lengths=DOC_LENGTHS)
    return synthetic_batch(cfg, 8, seed=seed, uneven_mask=True)


def _place(emb: torch.Tensor, image: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Image rows at the image positions of ``emb`` (sample-major, as the bridge delivers)."""
    return emb.masked_scatter(image.unsqueeze(-1), rows.to(emb.dtype))


def _reference(ref: ReferenceLLM, batch, rows: torch.Tensor, image: torch.Tensor):
    emb = _place(ref.embed(batch.input_ids), image, rows)
    if batch.packed:
        mask = packed_causal_mask(batch.cu_seqlens, emb.device)
        logits = ref(emb.unsqueeze(0), mask).squeeze(0)
    else:
        logits = ref(emb)
    per_token = F.cross_entropy(
        logits.flatten(0, -2).float(), batch.labels.flatten(), reduction="none"
    ).view_as(batch.labels)
    return reference_masked_mean(per_token, batch.loss_mask)


def _microbatches(batch, image, dp_rank: int, dp: int, m: int):
    """This DP shard's ``m`` microbatches: ``(ids, labels, mask, image, cu, rows)``, where
    ``rows`` is the microbatch's ``(start, stop)`` in the global image rows."""
    per_mb = 8 // dp // m
    cu = batch.cu_seqlens
    out, start = [], 0
    for i in range(0, 8, per_mb):
        if batch.packed:
            sl, mb_cu = slice(int(cu[i]), int(cu[i + per_mb])), cu[i : i + per_mb + 1] - cu[i]
        else:
            sl, mb_cu = slice(i, i + per_mb), None
        stop = start + int(image[sl].sum())
        if i // (8 // dp) == dp_rank:
            mb = (batch.input_ids[sl], batch.labels[sl], batch.loss_mask[sl], image[sl])
            out.append((*mb, mb_cu, (start, stop)))
        start = stop
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def run_pipeline_parity(
    cfg: MimoConfig,
    *,
    tp: int = 1,
    cp: int = 1,
    pp: int = 2,
    dp: int = 1,
    microbatches: int = 2,
    sequence_parallel: bool = False,
    packed: bool = False,
    steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    drop_microbatch: bool = False,
) -> dict[str, float]:
    """Worst relative differences over every rank: ``loss``, ``leaf_grad``, ``param_grad``,
    ``weight`` (each ``max |got − ref| / max |ref|`` per tensor), and ``trained`` (the
    reference's last loss below its first). ``drop_microbatch`` (teeth): stage 0 feeds
    microbatch ``M − 2`` again in place of ``M − 1``."""
    torch.manual_seed(seed)
    device = current_device()
    ref = ReferenceLLM(cfg).to(device)  # initialized on the CPU (seeded), then moved
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    batch = _batch(cfg, packed, seed + 1).to(device)  # cu_seqlens stays on the CPU
    image = batch.input_ids == cfg.image_token_id
    gen = torch.Generator().manual_seed(seed + 2)
    rows = torch.randn(int(image.sum()), cfg.llm_hidden, generator=gen).to(device)

    grid = make_grid(tp=tp, cp=cp, pp=pp, dp=dp, create=("tp", "cp", "pp", ("dp", "cp")))
    rank = dist.get_rank()
    c = GridLayout.from_grid(grid).coords(rank)
    tp_g = grid.get_pg("tp") if tp > 1 else None
    cp_g = grid.get_pg("cp") if cp > 1 else None
    dpcp = grid.get_pg(["dp", "cp"])
    # No try/finally: a failed case ends the world (DistributedWorld), and destroying the
    # groups would wait in a barrier for the ranks still inside the pipeline.
    if True:
        stage = TPLLMStage.from_full(
            ref, cfg, stage=c["pp"], n_stages=pp, tp_group=tp_g, cp_group=cp_g,
            sequence_parallel=sequence_parallel, device=device,
        )  # fmt: skip
        pipe = LLMPipeline(stage, pp_group=grid.get_pg("pp"), loss_group=dpcp)
        adapter = PartitionAdapter(
            cp_group=cp_g, tp_group=tp_g, sequence_parallel=sequence_parallel
        )
        mbs = _microbatches(batch, image, c["dp"], dp, microbatches)
        if packed:  # one capacity for every microbatch of every rank
            local = max(packed_length(mb[4], cp) for mb in mbs)
            cap = agree_capacity(local, cp=cp, tp=tp, sequence_parallel=sequence_parallel,
                                 group=dist.group.WORLD)  # fmt: skip
            padded = []
            for ids, lab, mask, img, cu, span in mbs:
                cu2, ids2, lab2, mask2 = pad_packed_to(cap, cp=cp, cu_seqlens=cu, input_ids=ids,
                                                       labels=lab, loss_mask=mask)  # fmt: skip
                img2 = torch.cat([img, img.new_zeros(len(ids2) - len(ids))])
                padded.append((ids2, lab2, mask2, img2, cu2, span))
            mbs = padded
        shards = [
            adapter.shard(None, input_ids=ids, labels=lab, loss_mask=mask, cu_seqlens=cu)
            for ids, lab, mask, _, cu, _ in mbs
        ]
        lo, hi = mbs[0][5][0], mbs[-1][5][1]
        leaf = rows[lo:hi].clone().requires_grad_(True)

        def inputs(m: int) -> torch.Tensor:
            if drop_microbatch and m == microbatches - 1:
                m -= 1
            ids, _, _, img, cu, (a, b) = mbs[m]
            emb = stage.embed_tokens(ids.unsqueeze(0) if packed else ids)
            emb = _place(emb, img.unsqueeze(0) if packed else img, leaf[a - lo : b - lo])
            return adapter.shard(emb, cu_seqlens=cu).embeddings

        optim = torch.optim.Adam(stage.parameters(), lr=lr)
        losses, leaf_grads = [], []
        for step in range(steps):
            optim.zero_grad(set_to_none=True)
            leaf.grad = None
            loss = pipe.step(
                microbatches,
                position_ids=[s.position_ids for s in shards],
                cu_seqlens=[s.cu_seqlens for s in shards] if packed else None,
                inputs=inputs if stage.is_first else None,
                labels=[s.labels for s in shards] if stage.is_last else None,
                loss_mask=[s.loss_mask for s in shards] if stage.is_last else None,
            )
            _sync(stage, dpcp, tp_g)
            if step == 0:
                first_grads = gather_full_state(stage, grads=True)
            if stage.is_first:
                g = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad.clone()
                if cp_g is not None:  # each CP shard's gradient covers its own chunks only
                    dist.all_reduce(g, group=cp_g)
                leaf_grads.append(g)
            optim.step()
            losses.append(float(loss))
        full = gather_full_state(stage)
    destroy_grid(grid)

    ref.load_state_dict(init)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=lr)
    ref_rows = rows.clone().requires_grad_(True)
    worst = {"loss": 0.0, "leaf_grad": 0.0, "param_grad": 0.0, "weight": 0.0}
    ref_losses = []
    for step in range(steps):
        ref_optim.zero_grad(set_to_none=True)
        ref_rows.grad = None
        loss = _reference(ref, batch, ref_rows, image)
        loss.backward()
        if step == 0:
            for name, g in first_grads.items():
                p = dict(ref.named_parameters())[name]
                worst["param_grad"] = max(worst["param_grad"], _rel(g, p.grad))
        if leaf_grads:
            worst["leaf_grad"] = max(
                worst["leaf_grad"], _rel(leaf_grads[step], ref_rows.grad[lo:hi])
            )
        ref_optim.step()
        ref_losses.append(float(loss))
        worst["loss"] = max(worst["loss"], abs(losses[step] - ref_losses[-1]) / abs(ref_losses[-1]))
    state = ref.state_dict()
    for name, w in full.items():
        worst["weight"] = max(worst["weight"], _rel(w, state[name]))
    out = torch.tensor(list(worst.values()), dtype=torch.float64, device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    result = dict(zip(worst, out.tolist()))
    result["trained"] = float(ref_losses[-1] < ref_losses[0])
    return result


def _sync(stage: TPLLMStage, dpcp, tp_g) -> None:
    """Sum partial gradients over DP x CP (and TP for SP norms), as the colocated model."""
    for p in stage.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=dpcp)
        if tp_g is not None and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=tp_g)
