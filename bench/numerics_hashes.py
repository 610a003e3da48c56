"""Print SHA-256 hashes of loss values and gradients for fixed inputs (refactor guard).

Run before and after a change that must not move a single bit; the two outputs must be
identical (same machine, build and thread count). Covers the materialized and fused
paths, default and invariant, fp32 and bf16, at TP 1/2/4 (gloo ranks on CPU), and the fused
paths at a multi-tile shape, and the triton engine's fused doors under Triton's CPU
interpreter (``_triton_hashes``: default and invariant, fp32 and bf16, TP 1/2; skipped,
with a line saying so, where ``triton`` does not import).
``--check`` compares with the recorded reference ``bench/numerics_hashes.txt`` (torch
2.13 CPU on the project's build machine) and exits 1 naming the lines that differ; a
change that is allowed to move bits records the new lines there.

    .venv/bin/python bench/numerics_hashes.py > before.txt   # ... change ... then diff
    .venv/bin/python bench/numerics_hashes.py --check
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys

# Before torch / triton: the kernels of the triton engine then run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.distributed as dist

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from mp_bridge.testing import run_distributed

N, H, V = 37, 48, 1024  # V = 4 whole 256-row blocks: every TP in (1, 2, 4) is invariant-ok


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    target[::5] = -100
    return hidden, weight, target


def _rank_hashes() -> list[str]:
    tp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    rows = slice(rank * V // tp, (rank + 1) * V // tp)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, target = _inputs(dtype)
        valid = target.clamp(min=0)
        for invariant in (False, True):
            tag = f"{str(dtype)[6:]} inv={int(invariant)}"
            # materialized: logits shard from the full matmul, sliced by rank
            logits = (hidden.float() @ weight.float().T)[:, rows].to(dtype).requires_grad_()
            ce = vocab_parallel_cross_entropy(logits, target, tp_group=group, invariant=invariant)
            ce.sum().backward()
            out.append(f"{tag} ce          {_digest(ce, logits.grad)}")
            logits.grad = None
            lp = vocab_parallel_logprobs(
                logits, valid, tp_group=group, temperature=0.7, invariant=invariant
            )
            lp.sum().backward()
            out.append(f"{tag} logprobs    {_digest(lp, logits.grad)}")
            if not invariant:
                logits.grad = None
                ent = vocab_parallel_entropy(logits, tp_group=group)
                ent.sum().backward()
                out.append(f"{tag} entropy     {_digest(ent, logits.grad)}")
            # fused: local weight rows
            for what in ("ce", "logprobs"):
                h = hidden.clone().requires_grad_()
                w = weight[rows].clone().requires_grad_()
                if what == "ce":
                    val = fused_linear_cross_entropy(
                        h, w, target, tp_group=group, chunk_size=16, invariant=invariant
                    )
                else:
                    val = fused_linear_logprobs(
                        h, w, valid, tp_group=group, chunk_size=16, invariant=invariant
                    )
                val.sum().backward()
                gw = [torch.empty_like(w.grad) for _ in range(tp)]
                dist.all_gather(gw, w.grad.contiguous())
                out.append(f"{tag} fused_{what:<9}{_digest(val, h.grad, torch.cat(gw))}")
    out += _fused_multi_tile(tp, rank, group)
    return out


def _fused_multi_tile(tp: int, rank: int, group) -> list[str]:
    """Fused paths at a shape that spans several token tiles, d-weight products and weight
    slabs (N = 300, V = 4096: 3 tiles of 128, 5 products of 64 tokens, 2 slabs at TP 1),
    fp32, default chunking and 160-row chunks."""
    g = torch.Generator().manual_seed(4321)
    n, h_dim, vocab = 300, 48, 4096
    hidden = torch.randn(n, h_dim, generator=g)
    weight = torch.randn(vocab, h_dim, generator=g) / h_dim**0.5
    target = torch.randint(0, vocab, (n,), generator=g)
    rows = slice(rank * vocab // tp, (rank + 1) * vocab // tp)
    out = []
    for invariant in (False, True):
        for chunk in (None, 160):
            h = hidden.clone().requires_grad_()
            w = weight[rows].clone().requires_grad_()
            loss = fused_linear_cross_entropy(
                h, w, target, tp_group=group, chunk_size=chunk, invariant=invariant
            )
            lp = fused_linear_logprobs(
                h, w, target, tp_group=group, chunk_size=chunk, invariant=invariant
            )
            (loss + lp.sum()).backward()
            gw = [torch.empty_like(w.grad) for _ in range(tp)]
            dist.all_gather(gw, w.grad.contiguous())
            tag = f"float32 inv={int(invariant)} n={n} chunk={chunk}"
            out.append(f"{tag} fused  {_digest(loss, lp, h.grad, torch.cat(gw))}")
    return out


def _triton_hashes() -> list[str]:
    """The fused doors on ``engine="triton"`` under the interpreter: cross-entropy
    (z-loss, label smoothing) and log-probs (entropy, ``sum_pi_squared``, per-token
    temperature, soft-cap), default and invariant, fp32 and bf16, at a small shape (N =
    19, H = 32, V = 512: two 256-row blocks, so TP 1 and 2 are invariant-ok); values,
    d hidden and the gathered d weight."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(2468)
    n, h_dim, vocab = 19, 32, 512
    hidden0 = torch.randn(n, h_dim, generator=g)
    weight0 = torch.randn(vocab, h_dim, generator=g) / h_dim**0.5
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::4] = -100
    temp = torch.rand(n, generator=g) + 0.5
    rows = slice(rank * vocab // tp, (rank + 1) * vocab // tp)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for invariant in (False, True):
            h = hidden0.to(dtype, copy=True).requires_grad_()
            w = weight0[rows].to(dtype, copy=True).requires_grad_()
            kw = dict(tp_group=group, invariant=invariant, engine="triton")
            loss, z = fused_linear_cross_entropy(
                h, w, target, label_smoothing=0.1, z_loss_weight=1e-3, return_z_loss=True, **kw
            )
            lp, ent, sq = fused_linear_logprobs(
                h, w, target.clamp(min=0), temperature=temp, softcap=7.0, return_entropy=True,
                return_sum_pi_squared=True, **kw,
            )  # fmt: skip
            (loss + (lp * 0.5).sum() + ent.sum()).backward()
            gw = [torch.empty_like(w.grad) for _ in range(tp)]
            dist.all_gather(gw, w.grad.contiguous())
            tag = f"{str(dtype)[6:]} inv={int(invariant)} triton"
            out.append(f"{tag} {_digest(loss, z, lp, ent, sq, h.grad, torch.cat(gw))}")
    return out


def _triton_lines() -> list[str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return ["triton: not installed, not hashed"]
    return [f"tp={tp} {line}" for tp in (1, 2) for line in run_distributed(_triton_hashes, tp)[0]]


REFERENCE = pathlib.Path(__file__).with_name("numerics_hashes.txt")


def main() -> None:
    lines = [f"tp={tp} {line}" for tp in (1, 2, 4) for line in run_distributed(_rank_hashes, tp)[0]]
    lines += _triton_lines()
    print("\n".join(lines))
    if "--check" in sys.argv[1:]:
        want = REFERENCE.read_text().splitlines()
        moved = [f"  now {a}\n  was {b}" for a, b in zip(lines, want) if a != b]
        if moved or len(lines) != len(want):
            print(f"differs from {REFERENCE.name}:\n" + "\n".join(moved))
            sys.exit(1)
        print(f"identical to {REFERENCE.name}")


if __name__ == "__main__":
    main()
