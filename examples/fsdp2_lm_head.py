"""FSDP2 with the fused LM-head loss: ``fully_shard`` on every block, the loss inside the
output module's ``forward``.

    torchrun --nproc-per-node 4 examples/fsdp2_lm_head.py            # CPU (gloo) or GPUs
    torchrun --nproc-per-node 4 examples/fsdp2_lm_head.py --backend gloo

Backend: NCCL with one GPU per rank when CUDA has enough devices, else gloo on CPU
(``--backend`` overrides). Any world size that divides the global batch (8 sequences);
each rank trains on its rows, FSDP2 averages the gradients. Rank 0 prints the mean loss
over the global batch at every step.

The pattern: ``fused_linear_cross_entropy`` runs inside ``OutputLayer.forward``, where FSDP2
has already all-gathered ``weight`` into a plain tensor, so the loss's vocab chunks reuse
that one gather (one all-gather in forward, one in backward, at any ``chunk_size``). Called
outside that ``forward``, the weight is FSDP2's ``DTensor`` shard: do not pass it there.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mp_bridge.layers import VocabParallelEmbedding, fused_linear_cross_entropy

B, S, H, HEADS, LAYERS, V, CHUNK = 8, 16, 32, 4, 2, 97, 16  # global batch; V: odd on purpose


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, residual (``[b, s, H] -> [b, s, H]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H, bias=False)
        self.up, self.down = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (H,))).view(b, s, 3, HEADS, H // HEADS).unbind(2)
        attn = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, H))
        return x + self.down(F.gelu(self.up(F.rms_norm(x, (H,)))))


class OutputLayer(nn.Module):
    """Final norm and the LM head's loss: ``h [b, s, H], labels [b, s] -> mean CE``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(V, H))

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Under FSDP2 self.weight is the gathered [V, H] tensor here, not the DTensor shard.
        return fused_linear_cross_entropy(
            F.rms_norm(h, (H,)), self.weight, labels, chunk_size=CHUNK
        )


class TinyDecoder(nn.Module):
    """Embedding (``VocabParallelEmbedding`` at TP 1), ``LAYERS`` blocks, output layer.
    Weights drawn from ``seed``, so every world size trains the same model."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = VocabParallelEmbedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = OutputLayer()
        nn.init.normal_(self.out.weight, std=0.02)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(ids), labels)


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """ids ``[B, S]`` and labels ``[B, S]`` (the next token; fixed seed)."""
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def train(args, device: torch.device) -> None:
    """Shard ``TinyDecoder`` with FSDP2 over every rank and train it ``args.steps`` steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyDecoder().to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.out, mesh=mesh)  # the head's weight: gathered inside out.forward
    fully_shard(model, mesh=mesh)  # the root: the embedding
    opt = optimizer(model, args.lr)
    ids, labels = (t.to(device) for t in global_batch())
    rows = slice(rank * B // world, (rank + 1) * B // world)
    for step in range(1, args.steps + 1):
        loss = model(ids[rows], labels[rows])  # mean over this rank's tokens
        opt.zero_grad()
        loss.backward()  # FSDP2 reduce-scatters the mean of the ranks' gradients
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # equal tokens per rank: the mean is the global mean
        if rank == 0:
            print(f"step {step}/{args.steps}  loss {logged.item() / world:.6f}", flush=True)


def main() -> None:
    from torchrun_setup import parse_args, start  # beside this file (see its docstring)

    args = parse_args(__doc__.splitlines()[0], steps=5, lr=1e-2)
    device = start(args.backend)
    if B % dist.get_world_size():
        raise SystemExit(
            f"world size {dist.get_world_size()}: use one that divides the batch of {B}"
        )
    train(args, device)
    # The FSDP2 modules, their mesh and the optimizer are gone (train returned; collect the
    # cycles FSDP2's hooks make) before the group is torn down. Left alive until interpreter
    # exit, one gloo rank in ten aborted there ("terminate called without an active
    # exception": 3 of 22 runs of this file, 0 of 50 with this order).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
