"""The README's wiring example, runnable: a colocated encoder -> bridge -> LLM, trained.

    torchrun --nproc-per-node 8 examples/colocated_mimo.py  # enc TP2xDP4 -> LLM TP2xCP2xDP2
    torchrun --nproc-per-node 4 examples/colocated_mimo.py  # enc TP2xDP2 -> LLM TP2xCP2

Backend: NCCL with one GPU per rank when CUDA has enough devices, else gloo on CPU
(``--backend`` overrides). World sizes: any multiple of 4 (encoder TP2 x DP w/2, LLM TP2 x
CP2 x DP w/4). Rank 0 prints the loss of every step.

Model: a column-parallel linear encoder (4 image tokens per sample), a vocab-parallel
embedding for 12 text tokens, one parameter-free causal self-attention over the CP-sharded
sequence, a vocab-parallel LM head and cross-entropy. Weights are cut from full tensors
drawn from one seed, so every layout trains the same model on the same global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter, gather_keep_grad
from mp_bridge.grid import destroy_grid, make_grid
from mp_bridge.layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    context_parallel_attention,
    masked_mean,
    vocab_parallel_cross_entropy,
)

B, N_IMG, N_TXT, C, H, HEADS, V = 8, 4, 12, 32, 64, 4, 1000  # global batch, sizes, vocab
S = N_IMG + N_TXT


class TPLinearEncoder(torch.nn.Module):
    """Column-parallel linear ``pixels [b, n, C] -> [b, n, H]``, output replicated over TP
    (all-gather of the hidden dim; backward keeps this rank's slice of the replicated grad)."""

    def __init__(self, full_weight: torch.Tensor, tp_group: dist.ProcessGroup):
        super().__init__()
        tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.weight = torch.nn.Parameter(full_weight.chunk(tp)[rank].clone())
        self.tp_group = tp_group

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return gather_keep_grad(pixels @ self.weight.t(), self.tp_group, dim=-1)


def full_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "encoder": torch.randn(H, C, generator=gen) / C**0.5,
        "embedding": torch.randn(V, H, generator=gen) * 0.02,
        "head": torch.randn(V, H, generator=gen) * 0.02,
    }


def global_batch() -> dict[str, torch.Tensor]:
    """Pixels [B, 4, C]; ids [B, 12]; labels [B, 16] = the next text token (image positions
    and the last position unsupervised)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, N_TXT), generator=gen)
    labels = torch.zeros(B, S, dtype=torch.long)
    labels[:, N_IMG : S - 1] = ids[:, 1:]
    mask = torch.zeros(B, S)
    mask[:, N_IMG : S - 1] = 1.0
    return {"pixels": torch.randn(B, N_IMG, C, generator=gen), "ids": ids, "labels": labels,
            "mask": mask}  # fmt: skip


def rows(grid, batch: int) -> slice:
    """This rank's DP block of the global batch (contiguous blocks by DP index)."""
    dp_groups = grid.get_rank_enum(["dp"])
    dp = next(g.index(dist.get_rank()) for g in dp_groups if dist.get_rank() in g)
    per = batch // len(dp_groups[0])
    return slice(dp * per, (dp + 1) * per)


def main() -> None:
    from torchrun_setup import parse_args, start  # beside this file (see its docstring)

    args = parse_args(__doc__.splitlines()[0], steps=5, lr=0.5)
    device = start(args.backend)
    world = dist.get_world_size()
    if world % 4:
        raise SystemExit(f"world size {world}: use a multiple of 4 (TP2 x CP2 LLM)")

    # ---- the README's wiring example starts here ------------------------------------
    enc_grid = make_grid(tp=2, dp=world // 2, create=("tp", "dp"))  # encoder TP2 x DP w/2
    llm_grid = make_grid(tp=2, cp=2, dp=world // 4, create=("tp", "cp", "dp", ("dp", "cp")))
    tp, cp, dp_cp = llm_grid.get_pg("tp"), llm_grid.get_pg("cp"), llm_grid.get_pg(["dp", "cp"])
    w = full_weights()
    encoder = TPLinearEncoder(w["encoder"], enc_grid.get_pg("tp")).to(device)
    bridge = ColocatedBridgeCommunicator(enc_grid, llm_grid)  # encoder DP shard -> LLM DP shard
    partition = PartitionAdapter(cp_group=cp, tp_group=tp)  # load-balanced CP chunks
    embed = VocabParallelEmbedding.from_full(w["embedding"], tp_group=tp).to(device)
    head = VocabParallelLMHead.from_full(w["head"], tp_group=tp).to(device)

    def loss_fn(pixels, ids, labels, mask):
        image = bridge.communicate(encoder(pixels))  # [B/(w/2), 4, H] -> [B/(w/4), 4, H]
        x = torch.cat([image, embed(ids)], dim=1)  # [b, 16, H]
        shard = partition.shard(x, labels=labels, loss_mask=mask)  # [b, 16/cp, H]
        b, s_local = shard.embeddings.shape[:2]
        q = shard.embeddings.view(b, s_local, HEADS, H // HEADS)  # (your TP blocks go here)
        h = context_parallel_attention(q, q, q, cp_group=cp, position_ids=shard.position_ids)
        logits = head(h.reshape(b, s_local, H))  # [b, s_local, V/tp]
        per_token = vocab_parallel_cross_entropy(logits, shard.labels, tp_group=tp, vocab_size=V)
        return masked_mean(per_token, shard.loss_mask, group=dp_cp)  # global mean

    # ---- the README's wiring example ends here --------------------------------------

    data = {k: t.to(device) for k, t in global_batch().items()}
    enc_rows, llm_rows = rows(enc_grid, B), rows(llm_grid, B)
    # Gradients of replicated parameters are partial sums: add them over the data replicas.
    buckets = [(enc_grid.get_pg("dp"), list(encoder.parameters())),
               (dp_cp, list(embed.parameters()) + list(head.parameters()))]  # fmt: skip
    for step in range(1, args.steps + 1):
        loss = loss_fn(data["pixels"][enc_rows], data["ids"][llm_rows],
                       data["labels"][llm_rows], data["mask"][llm_rows])  # fmt: skip
        loss.backward()
        with torch.no_grad():
            for group, params in buckets:
                for p in params:
                    dist.all_reduce(p.grad, group=group)
                    p -= args.lr * p.grad
                    p.grad = None
        if dist.get_rank() == 0:
            print(f"step {step}/{args.steps}  loss {loss.item():.6f}", flush=True)

    bridge.destroy()
    destroy_grid(enc_grid)
    destroy_grid(llm_grid)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
