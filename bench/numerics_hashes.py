"""Print SHA-256 hashes of loss values and gradients for fixed inputs (refactor guard).

Run before and after a change that must not move a single bit; the two outputs must be
identical (same machine, build and thread count). Covers the materialized and fused
paths, default and invariant, fp32 and bf16, at TP 1/2/4 (gloo ranks on CPU), and the fused
paths at a multi-tile shape, and the triton engine's fused doors under Triton's CPU
interpreter (``_triton_hashes``: default and invariant, fp32 and bf16, TP 1/2; skipped,
with a line saying so, where ``triton`` does not import); then one colocated MIMO training
step of each kind (:func:`mimo_step_lines`) and one bridge call of each kind on 8 gloo ranks
(:func:`bridge_lines`; ``--bridge`` runs and checks that section alone).
``--check`` compares with the recorded reference ``bench/numerics_hashes.txt`` (torch
2.13 CPU on the project's build machine) and exits 1 naming the lines that differ; a
change that is allowed to move bits records the new lines there.

    .venv/bin/python bench/numerics_hashes.py > before.txt   # ... change ... then diff
    .venv/bin/python bench/numerics_hashes.py --check
    .venv/bin/python bench/numerics_hashes.py --bridge --check   # the bridge lines only
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


def _gathered(grad: torch.Tensor, tp: int) -> torch.Tensor:
    """The TP ranks' ``grad`` shards all-gathered and concatenated along dim 0."""
    parts = [torch.empty_like(grad) for _ in range(tp)]
    dist.all_gather(parts, grad.contiguous())
    return torch.cat(parts)


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
                out.append(f"{tag} fused_{what:<9}{_digest(val, h.grad, _gathered(w.grad, tp))}")
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
            tag = f"float32 inv={int(invariant)} n={n} chunk={chunk}"
            out.append(f"{tag} fused  {_digest(loss, lp, h.grad, _gathered(w.grad, tp))}")
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
            tag = f"{str(dtype)[6:]} inv={int(invariant)} triton"
            out.append(f"{tag} {_digest(loss, z, lp, ent, sq, h.grad, _gathered(w.grad, tp))}")
    return out


def _triton_lines() -> list[str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return ["triton: not installed, not hashed"]
    return [f"tp={tp} {line}" for tp in (1, 2) for line in run_distributed(_triton_hashes, tp)[0]]


REFERENCE = pathlib.Path(__file__).with_name("numerics_hashes.txt")


def main() -> None:
    only_bridge = "--bridge" in sys.argv[1:]  # the bridge section alone (bridge_lines)
    lines = [] if only_bridge else [
        f"tp={tp} {line}" for tp in (1, 2, 4) for line in run_distributed(_rank_hashes, tp)[0]
    ]  # fmt: skip
    if not only_bridge:
        lines += _triton_lines()
        lines += mimo_step_lines()
    lines += bridge_lines()
    print("\n".join(lines))
    if "--check" in sys.argv[1:]:
        want = REFERENCE.read_text().splitlines()
        if only_bridge:
            want = [line for line in want if line.startswith("bridge ")]
        moved = [f"  now {a}\n  was {b}" for a, b in zip(lines, want) if a != b]
        if moved or len(lines) != len(want):
            print(f"differs from {REFERENCE.name}:\n" + "\n".join(moved))
            sys.exit(1)
        print(f"identical to {REFERENCE.name}")


# ---------------------------------------------------------------- colocated MIMO step
#: ``(name, world, encoder sizes, LLM sizes, build options, batch)`` of each hashed MIMO
#: step: the gather and routed flows on a FAN_IN bridge with CP and SP, balanced encoders,
#: the pipelined LLM (PP 2, two microbatches) in both flows, packed text, uniform images,
#: and one process (``LocalBridge``). ``batch``: ``synthetic_batch`` keywords (4 samples).
RAGGED = dict(images_per_sample=(0, 3))
PACKED = dict(images_per_sample=(0, 2), doc_lengths=(14, 9, 16, 11))
UNIFORM: dict = {}
ENC_TP2 = dict(tp=2, dp=2)  # encoder layouts
ENC_DP4 = dict(tp=1, dp=4)
TP_CP = dict(tp=2, cp=2)  # LLM layouts
CP_DP = dict(cp=2, dp=2)
TP_PP = dict(tp=2, pp=2)
CP_PP = dict(cp=2, pp=2)
GATHER, ROUTED = dict(flow="gather"), dict(flow="routed")
GATHER_M2, ROUTED_M2 = dict(flow="gather", microbatches=2), dict(flow="routed", microbatches=2)
MIMO_CASES = (
    ("gather", 4, ENC_TP2, TP_CP, GATHER, RAGGED),
    ("routed sp", 4, ENC_TP2, TP_CP, dict(ROUTED, sequence_parallel=True), RAGGED),
    ("routed uniform", 4, ENC_TP2, TP_CP, ROUTED, UNIFORM),
    ("gather packed", 4, ENC_TP2, TP_CP, GATHER, PACKED),
    ("routed balance", 4, ENC_DP4, CP_DP, dict(ROUTED, balance=True), RAGGED),
    ("gather balance", 4, ENC_DP4, CP_DP, dict(GATHER, balance=True), RAGGED),
    ("gather pp", 4, ENC_TP2, TP_PP, GATHER_M2, RAGGED),
    ("routed pp", 4, ENC_TP2, CP_PP, ROUTED_M2, RAGGED),
    ("routed pp uniform", 4, ENC_TP2, CP_PP, ROUTED_M2, UNIFORM),
    ("gather pp packed", 4, ENC_TP2, TP_PP, GATHER_M2, PACKED),
    ("routed pp packed", 4, ENC_TP2, CP_PP, ROUTED_M2, PACKED),
    ("local gather", 1, None, None, GATHER, RAGGED),
    ("local routed", 1, None, None, ROUTED, RAGGED),
    ("local routed uniform", 1, None, None, ROUTED, UNIFORM),
)


def _mimo_step_digest(case: str) -> str:
    """One colocated MIMO training step on this rank: ``train_step`` (ragged images, the
    encoder input a leaf), ``sync_gradients``, one Adam step; the digest of the loss, the
    encoder input gradient, every synced parameter gradient and every weight after the
    step (this rank's shards, sorted by name)."""
    from mp_bridge.grid import GridLayout, make_grid
    from mp_bridge.models import (
        ColocatedMimoModel,
        MimoConfig,
        MimoGroups,
        ReferenceMimo,
        build_colocated_mimo,
        destroy_colocated_mimo,
        synthetic_batch,
    )
    from mp_bridge.models.data.images import RaggedImages

    _, _, enc, llm, options, kind = next(c for c in MIMO_CASES if c[0] == case)
    cfg = MimoConfig()
    torch.manual_seed(0)
    reference = ReferenceMimo(cfg)
    batch = synthetic_batch(cfg, 4, seed=7, **kind)
    if enc is None:
        model = ColocatedMimoModel.from_groups(reference, MimoGroups.local(), **options)
        images, text, grids = batch.images, batch, ()
    else:
        grids = (
            make_grid(**enc, create=("tp", "dp")),
            make_grid(**llm, create=("tp", "cp", "dp", ("dp", "cp"), *(("pp",) * ("pp" in llm)))),
        )
        model = build_colocated_mimo(reference, *grids, **options)
        rank = dist.get_rank()
        enc_dp, llm_dp = (GridLayout.from_grid(g).coords(rank)["dp"] for g in grids)
        images = batch.encoder_shard(enc_dp, enc.get("dp", 1))
        text = batch.llm_shard(llm_dp, llm.get("dp", 1))
    ragged = isinstance(images, RaggedImages)
    x = (images.tokens if ragged else images).clone().requires_grad_(True)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = model.train_step(
        text.input_ids, text.labels, text.loss_mask, images.with_tokens(x) if ragged else x,
        cu_seqlens=text.cu_seqlens,
    )  # fmt: skip
    model.sync_gradients()
    params = sorted(model.named_parameters())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for _, p in params]
    optim.step()
    digest = _digest(loss, x.grad, *grads, *(p for _, p in params))
    if grids:
        destroy_colocated_mimo(model, *grids)
    return digest


def mimo_step_lines() -> list[str]:
    """``mimo <case> <digest>`` per case of :data:`MIMO_CASES`: every rank's digest, in
    rank order, hashed together."""
    out = []
    for case, world, *_ in MIMO_CASES:
        ranks = run_distributed(_mimo_step_digest, world, case)
        whole = hashlib.sha256("".join(ranks).encode()).hexdigest()[:16]
        out.append(f"mimo {case:<21}{whole}")
    return out


# ------------------------------------------------------------------ bridge calls
# One bridge call of each kind on 8 gloo ranks (issue 33: the bridge's row moves are
# refactored under these hashes): dense ``communicate`` (FAN_IN into CP 2, FAN_OUT),
# ``communicate_ragged`` (FAN_IN into CP 2, FAN_OUT; and a double backward), ``route``
# (FAN_IN into CP 2 with SP, FAN_OUT), the stage delivery (LLM PP 2: dense and ragged), the
# image balancer (and its double backward) and the balanced ``route``. Each line hashes
# every rank's forward values and input gradient, rank order; the loss weights differ per
# rank, so the CP all-reduces and the backward exchanges carry distinct values.
BRIDGE_WORLD = 8
_ORDER = ("tp", "cp", "pp", "dp")
_B, _S, _H = 8, 4, 3  # samples of the global batch, sequence, hidden


def _bridge_rank_lines() -> list[tuple[str, str]]:
    from mp_bridge.comm import ColocatedBridgeCommunicator, ImageBalancer, PartitionAdapter
    from mp_bridge.grid import GridLayout, make_grid

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(2026)
    dense = torch.randn(_B, _S, _H, generator=g)
    counts = [int(c) for c in torch.randint(0, 5, (_B,), generator=g)]  # some 0
    counts[0], counts[2] = 8, 0  # sample 0 all images (replica 0 heavy: the balancer moves)
    tokens = torch.randn(sum(counts), _H, generator=g)
    starts = [sum(counts[:i]) for i in range(_B + 1)]
    mask = torch.zeros(_B, 2 * _S, dtype=torch.bool)  # route: image positions per sample
    for i, c in enumerate(counts):
        mask[i, torch.randperm(2 * _S, generator=g)[:c]] = True
    weights = torch.Generator().manual_seed(100 + rank)
    out: list[tuple[str, str]] = []

    def grids(src, dest):
        s = make_grid(**src, axis_names=_ORDER, create=("dp",))
        d = make_grid(**dest, axis_names=_ORDER, create=("cp", "tp"))
        return s, d, GridLayout.from_grid(s), GridLayout.from_grid(d)

    def samples(layout: GridLayout) -> range:
        per = _B // layout.axis_size("dp")
        return range(layout.coords(rank)["dp"] * per, (layout.coords(rank)["dp"] + 1) * per)

    def loss(y: torch.Tensor) -> torch.Tensor:
        return (y * torch.randn(y.shape, generator=weights)).sum()

    def token_rows(s: range) -> torch.Tensor:
        return tokens[starts[s.start] : starts[s.stop]].clone().requires_grad_()

    layouts = {
        "fan_in_cp2": (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2)),
        "fan_out": (dict(tp=4, dp=2), dict(tp=2, cp=2, dp=2)),
        "stage_pp2": (dict(tp=2, dp=4), dict(tp=2, pp=2, dp=2)),
    }
    for name, (src, dest) in layouts.items():
        s_grid, d_grid, s_lay, d_lay = grids(src, dest)
        s_samples = samples(s_lay)
        with ColocatedBridgeCommunicator(s_grid, d_grid) as bridge:
            x = dense[s_samples.start : s_samples.stop].clone().requires_grad_()
            y = bridge.communicate(x)
            loss(y).backward()
            out.append((f"dense   {name}", _digest(y, x.grad)))
            x = token_rows(s_samples)
            y, dest_counts = bridge.communicate_ragged(x, counts[s_samples.start : s_samples.stop])
            loss(y).backward()
            out.append((f"ragged  {name}", _digest(y, dest_counts, x.grad)))
            if name != "stage_pp2":  # ragged's adjoints are double-differentiable
                x = token_rows(s_samples)
                y, _ = bridge.communicate_ragged(x, counts[s_samples.start : s_samples.stop])
                (gx,) = torch.autograd.grad(loss(y * y), x, create_graph=True)
                loss(gx).backward()
                out.append((f"ragged  {name} double", _digest(gx, x.grad)))
            for sp in (False, True) if name == "fan_in_cp2" else (False,):
                partition = PartitionAdapter(
                    cp_group=d_grid.get_pg("cp"), tp_group=d_grid.get_pg("tp"),
                    sequence_parallel=sp,
                )  # fmt: skip
                x = token_rows(s_samples)
                d_samples = samples(d_lay)
                y = bridge.route(
                    x, tokens_per_sample=counts[s_samples.start : s_samples.stop],
                    image_mask=mask[d_samples.start : d_samples.stop], partition=partition,
                )  # fmt: skip
                loss(y).backward()
                out.append((f"route   {name} sp={int(sp)}", _digest(y, x.grad)))
            if name != "fan_in_cp2":
                continue
            # the balancer over the encoder DP replicas (replica 0 heavy: images move)
            images = [[3] * (counts[i] // 3) + [counts[i] % 3] * bool(counts[i] % 3)
                      for i in range(_B)]  # fmt: skip
            per_replica = [t for i in s_samples for t in images[i]]
            balancer = ImageBalancer(dp_group=s_grid.get_pg("dp"), count_group=bridge.world_group)
            x = token_rows(s_samples)
            y_enc, plan = balancer.balance(x, per_replica)
            (gx,) = torch.autograd.grad(loss(y_enc * y_enc), x, create_graph=True)
            loss(gx).backward()
            out.append(("balance fan_in_cp2 double", _digest(y_enc, gx, x.grad)))
            x = token_rows(s_samples)
            y_enc, plan = balancer.balance(x, per_replica)
            partition = PartitionAdapter(cp_group=d_grid.get_pg("cp"))
            d_samples = samples(d_lay)
            y = bridge.route(
                y_enc, tokens_per_sample=counts[s_samples.start : s_samples.stop],
                image_mask=mask[d_samples.start : d_samples.stop], partition=partition,
                balance=plan,
            )  # fmt: skip
            loss(y).backward()
            moved = plan.moved_images
            out.append((f"balanced route fan_in_cp2 moved={moved}", _digest(y, x.grad)))
    return out


def bridge_lines() -> list[str]:
    """One line per bridge call: the kind, then a hash over every rank's hashes."""
    per_rank = run_distributed(_bridge_rank_lines, BRIDGE_WORLD)
    lines = []
    for i, (name, _) in enumerate(per_rank[0]):
        h = hashlib.sha256("".join(r[i][1] for r in per_rank).encode()).hexdigest()[:16]
        lines.append(f"bridge w={BRIDGE_WORLD} {name:<40}{h}")
    return lines


if __name__ == "__main__":
    main()
