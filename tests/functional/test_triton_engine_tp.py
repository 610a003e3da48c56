"""The ``"triton"`` loss engine over gloo ranks: TP 1 / 2 / 4 against the fp64 oracle on
the full weight, and the invariant mode's bits across TP sizes (1, 2, 3, 4, 8) and batch
composition;
per-class weights (``ce_weight``) against torch's ``F.cross_entropy(weight=)`` and in bits.

Kernels run under ``TRITON_INTERPRET=1`` without CUDA (``tests.triton_engine``, imported
before the world forks its ranks). Every rank builds the same full tensors from one seed;
vocab 1000 is padded at TP 4 in both layouts (250-row shards by default, 256-row blocks
with ``invariant=True``); ``N = 37`` tokens fit no tile. Tolerance 2e-5: fp32 sums of 16
products and over <= 1000 columns, merged across ranks (``tests/unit/test_triton_engine``).
"""

from __future__ import annotations

import functools

import torch

from mp_bridge.layers import vocab_shard_ranges
from mp_bridge.testing import DistributedWorld
from tests.loss_refs import Checks, weighted_cross_entropy
from tests.oracles import tp_member
from tests.triton_engine import oracle, run, triton_loss

world = DistributedWorld(4, timeout_s=240)  # interpreted kernels on 4 ranks, 2 cores
N, H, VOCAB = 37, 16, 1000
TOL = dict(rtol=2e-5, atol=2e-5)
CASES = (
    ("ce", dict(reduction="none", label_smoothing=0.1, z_loss_weight=1e-2, softcap=4.0)),
    ("logprob", dict(reduction="mean", temperature=0.8, return_entropy=True,
                     return_sum_pi_squared=True)),
)  # fmt: skip


def _data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(1024, H, generator=g) * 0.4  # rows past VOCAB: garbage padding
    target = torch.randint(0, VOCAB, (n,), generator=g)
    target[[2, 11]] = -100
    return hidden, weight, target


def _local(weight, tp, rank, invariant):
    start, stop = vocab_shard_ranges(VOCAB, tp, multiple=256 if invariant else 1)[rank]
    weight = torch.cat([weight, weight])  # TP 3, 8: shards past row 1024 (all padding)
    return weight[start:stop], start


def _ours(kind, kw, tp, invariant, hidden, target, temp=None, up=None):
    inside, group, rank = tp_member(tp)
    if not inside:
        return None
    _, weight, _ = _data()
    w_local, start = _local(weight, tp, rank, invariant)
    kw = dict(dict(chunk_size=32), **kw, tp_group=group, vocab_size=VOCAB, invariant=invariant)
    if temp is not None:
        kw["temperature"] = temp
    return run(functools.partial(triton_loss, kind, **kw), hidden, w_local, target, up=up), start


@world.case
def test_triton_engine_matches_fp64_at_tp_2_and_4():
    hidden, weight, target = _data()
    checks = Checks()
    for (kind, kw), tp in zip(CASES, (2, 4)):  # TP 1: tests/unit/test_triton_engine.py
        want = run(oracle(kind, VOCAB, **kw), hidden, weight, target, device="cpu")
        for invariant in (False, True):
            (outs, gh, gw), start = _ours(kind, kw, tp, invariant, hidden, target)
            what = f"{kind} tp={tp} invariant={invariant}"
            for a, b in zip(outs, want[0]):
                checks.close(a, b, f"{what} value", **TOL)
            checks.close(gh, want[1], f"{what} d hidden", **TOL)
            rows = max(0, min(gw.shape[0], VOCAB - start))
            checks.close(gw[:rows], want[2][start : start + rows], f"{what} d weight", **TOL)
            if not torch.all(gw[rows:] == 0):
                checks.failures.append(f"{what}: padding rows got a gradient")
    checks.done()


@world.case
def test_invariant_bits_equal_across_tp_and_batches():
    # TP 3 with tokens in front: ranks 0 and 1 hold real blocks, rank 2 none (the raw
    # statistics all-gather pads it); rank 3 sits out
    _bits_equal_tp_1(((2, None), (4, True), (3, True), (2, False)))


@world.case(world_size=8)
def test_invariant_bits_equal_at_tp_3_and_8():
    """Uneven hidden-column owners (``H = 16``: 6 / 5 / 5 at TP 3) and ranks without a real
    block (vocab 1000 in 256-row shards: TP 3's rank 2, TP 8's ranks 4-7)."""
    _bits_equal_tp_1(((3, False), (8, True)))


def _bits_equal_tp_1(cases):
    """TP 1's bits at each ``(tp, front)`` of ``cases``: 29 unrelated tokens with zero
    upstream prepended (``front``), appended (``not front``) or none (``None``)."""
    hidden, _, target = _data()
    extra_h, _, extra_t = _data(n=29, seed=4)
    temp = torch.rand(N, generator=torch.Generator().manual_seed(1)) + 0.5
    up = torch.linspace(0.5, 1.5, N)
    kind, kw = CASES[0]
    checks = Checks()
    (ref, ref_gh, ref_gw), _ = _ours(kind, kw, 1, True, hidden, target, temp, up)
    for tp, front in cases:
        h, t, tt, u, base = hidden, target, temp, up, slice(0, N)
        if front is not None:  # 29 unrelated tokens before or after, zero upstream
            parts = [(extra_h, extra_t, torch.ones(29), torch.zeros(29)), (h, t, tt, u)]
            parts = parts if front else parts[::-1]
            h, t, tt, u = (torch.cat([p[i] for p in parts]) for i in range(4))
            base = slice(29, 29 + N) if front else base
        got = _ours(kind, kw, tp, True, h, t, tt, u)
        if got is None:  # TP 3 on 8 ranks: ranks 6, 7 sit out
            continue
        (outs, gh, gw), start = got
        what = f"tp={tp} front={front}"
        checks.equal(outs[0][base], ref[0], f"{what} value")
        checks.equal(gh[base], ref_gh, f"{what} d hidden")
        if not front:
            rows = max(0, min(gw.shape[0], ref_gw.shape[0] - start))  # past it: padding
            checks.equal(gw[:rows], ref_gw[start : start + rows], f"{what} d weight")
            checks.equal(gw[rows:], torch.zeros_like(gw[rows:]), f"{what} d weight padding")
    checks.done()


@world.case
def test_ce_weight_matches_fp64_at_tp_2_and_invariant_bits_equal_tp_1():
    """Smoothed, soft-capped, z-loss cross-entropy with class weights (three at 0, one a
    target's): "mean" at TP 2 in both modes against the fp64 oracle; "none" in invariant
    mode: TP 2 at chunk 16 gives TP 1 at chunk 32's bits."""
    hidden, weight, target = _data()
    cw = torch.rand(VOCAB, generator=torch.Generator().manual_seed(3)) * 2 + 0.2
    cw[[5, 600, int(target[0])]] = 0.0
    opts = dict(label_smoothing=0.1, z_loss_weight=1e-2, softcap=4.0)
    kw = dict(opts, ce_weight=cw)

    def want_fn(h, w, t):
        z = h.double() @ w.double()[:VOCAB].t()
        return weighted_cross_entropy(z, t, cw, reduction="mean", **opts)

    want = run(want_fn, hidden, weight, target, device="cpu")
    checks = Checks()
    for invariant in (False, True):
        (outs, gh, gw), start = _ours(
            "ce", dict(kw, reduction="mean"), 2, invariant, hidden, target
        )
        what = f"ce_weight tp=2 invariant={invariant}"
        checks.close(outs[0], want[0][0], f"{what} value", **TOL)
        checks.close(gh, want[1], f"{what} d hidden", **TOL)
        rows = max(0, min(gw.shape[0], VOCAB - start))
        checks.close(gw[:rows], want[2][start : start + rows], f"{what} d weight", **TOL)
    none = dict(kw, reduction="none")
    (ref, ref_gh, ref_gw), _ = _ours("ce", none, 1, True, hidden, target)
    (outs, gh, gw), start = _ours("ce", dict(none, chunk_size=16), 2, True, hidden, target)
    checks.equal(outs[0], ref[0], "ce_weight tp=2 value bits")
    checks.equal(gh, ref_gh, "ce_weight tp=2 d hidden bits")
    checks.equal(gw, ref_gw[start : start + gw.shape[0]], "ce_weight tp=2 d weight bits")
    checks.done()
