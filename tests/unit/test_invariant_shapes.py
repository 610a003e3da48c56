"""Every matmul of invariant mode has one of a few fixed shapes.

GEMM libraries pick their kernel, hence the summation order, from the shapes and the batch
count, so invariant mode must issue the same matmul calls for every TP size, chunk size
and batch composition. A ``TorchDispatchMode`` records every matmul-like aten op (with the
shapes, strides and dtypes of its operands) while the fused invariant runner runs the
forward, the eager gradient and the backward recompute; TP ranks are simulated in one
process (each rank's engine on its own shard; the all-gather of the fold is replaced by a
stand-in, which issues no matmul). Checked: the set of calls is identical across TP 1, 2,
4, 8, chunk sizes and batches; per token tile the multiset is identical across chunk
sizes and batches at one TP (a rank makes one call of each kind per group of blocks it
holds, so the counts scale with its blocks, never the shapes); a planted TP-dependent
call is detected. Also: the kernels are row-position invariant at the padded widths
(the premise of ``HIDDEN_ALIGN``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mp_bridge.layers.loss.engines.torch_ops.invariant as engines
from mp_bridge.layers.loss.blocks import (
    BLOCK_GROUP,
    HIDDEN_ALIGN,
    TOKEN_TILE,
    WEIGHT_GRAD_ROWS,
    BlockLayout,
    block_groups,
)
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.vocab_shards import VocabShard, vocab_shard_size

aten = torch.ops.aten
MATMULS = {  # in-place and out= variants included (``out=`` is an overload of the packet)
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.addmm_,
    aten.baddbmm,
    aten.baddbmm_,
    aten.addbmm,
    aten.addbmm_,
    aten.matmul,
    aten.linear,
    aten.mv,
    aten.addmv,
    aten.addmv_,
    aten.dot,
}


class MatmulRecorder(TorchDispatchMode):
    """Records ``(op, ((shape, stride, dtype) of each tensor operand, out included))``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in MATMULS:
            operands = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            sig = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in operands)
            self.calls[(func.overloadpacket.__name__, sig)] += 1
        return func(*args, **kwargs)


def _fake_gather_fold(pieces, layout, tp_group, combine, shape, device):
    return torch.ones(shape, device=device)  # the fold's collectives and adds: no matmul


def _record(monkeypatch, *, vocab, h_dim, tp, batches, chunk, dtype=torch.float32):
    """Matmul calls of every rank of a simulated TP ``tp`` run, and the token tiles (each
    pass over one tile counts once, whatever the number of ranks).

    ``batches``: token counts of the successive calls; each call runs forward with eager
    ``d hidden``/``d weight``, then the backward recompute, chunk by chunk (``chunk`` rows,
    a multiple of ``TOKEN_TILE`` as the driver rounds it).
    """
    monkeypatch.setattr(engines, "gather_fold", _fake_gather_fold)
    v_local = vocab_shard_size(vocab, tp, multiple=256)
    gen = torch.Generator().manual_seed(0)
    spec = LossSpec.cross_entropy(vocab, -100, 0.0)
    rec, tiles = MatmulRecorder(), 0
    for rank in range(tp):
        shard = VocabShard.of_rank(tp, v_local, rank=rank, vocab_size=vocab)
        layout = BlockLayout.of_shard(shard)
        weight = torch.randn(layout.v_local, h_dim, generator=gen).to(dtype)
        runner = engines.TorchInvariantRunner(weight, None, layout, spec)
        gw = torch.zeros(weight.shape)
        for n in batches:
            hidden = torch.randn(n, h_dim, generator=gen).to(dtype)
            target = torch.randint(0, vocab, (n,), generator=gen)
            w = torch.ones(n)
            for s in range(0, n, chunk):
                h, t = hidden[s : s + chunk], target[s : s + chunk]
                tiles += 2 * -(-h.shape[0] // TOKEN_TILE) if rank == 0 else 0  # fwd, recompute
                with rec:
                    state, out = runner.forward_chunk(h, t)
                    runner.grad_chunk(state, h, t, out.lse, w[: h.shape[0]], gw)
                    state = runner.recompute(h)
                    runner.grad_chunk(state, h, t, out.lse, w[: h.shape[0]], gw)
    return rec.calls, tiles


def _per_tile(calls: Counter, tiles: int) -> dict:
    assert all(c % tiles == 0 for c in calls.values()), (calls, tiles)
    return {sig: c // tiles for sig, c in calls.items()}


def _differences(runs: dict) -> list[str]:
    """Calls that some runs make and others do not (empty: one set of calls)."""
    sets = {name: set(calls) for name, (calls, _) in runs.items()}
    union = set().union(*sets.values())
    return [f"{name}: missing {sorted(union - s)}" for name, s in sets.items() if s != union]


VOCAB = 4096 * 2 + 300  # 33 blocks: groups of 8 leave windows and padded groups at every TP
CONFIGS = {
    "tp1 chunk64": dict(tp=1, batches=[150], chunk=64),
    "tp1 chunk192": dict(tp=1, batches=[150], chunk=192),
    "tp1 batches 7+143": dict(tp=1, batches=[7, 143], chunk=128),
    "tp2 chunk64": dict(tp=2, batches=[150], chunk=64),
    "tp2 batches 90+3+57": dict(tp=2, batches=[90, 3, 57], chunk=64),
    "tp4 chunk128": dict(tp=4, batches=[150], chunk=128),
    "tp8 chunk64": dict(tp=8, batches=[150], chunk=64),
    "tp8 batches 1+149": dict(tp=8, batches=[1, 149], chunk=256),
}


@pytest.mark.parametrize("h_dim", [7, 48])
def test_one_set_of_matmul_shapes_for_every_tp_chunk_and_batch(monkeypatch, h_dim):
    runs = {
        name: _record(monkeypatch, vocab=VOCAB, h_dim=h_dim, **cfg) for name, cfg in CONFIGS.items()
    }
    assert _differences(runs) == []
    hp = -(-h_dim // HIDDEN_ALIGN) * HIDDEN_ALIGN
    g, tile, b, r = BLOCK_GROUP, TOKEN_TILE, 256, WEIGHT_GRAD_ROWS
    calls = next(iter(runs.values()))[0]
    assert {op for op, _ in calls} == {"bmm", "baddbmm_"}
    shapes = {tuple(shape for shape, _, _ in sig) for _, sig in calls}
    assert shapes == {
        ((g, tile, hp), (g, hp, b), (g, tile, b)),  # logits (into the call's buffer)
        ((g, b, hp), (g, b, r), (g, r, hp)),  # d weight, accumulated in place
        ((g, tile, b), (g, b, hp), (g, tile, hp)),  # d hidden (into one reused buffer)
    }
    # Per token tile, one multiset at each TP whatever the chunk size and the batches.
    for tp in (1, 2, 8):
        same_tp = [_per_tile(*r) for name, r in runs.items() if name.startswith(f"tp{tp} ")]
        assert len(same_tp) >= 2 and all(p == same_tp[0] for p in same_tp)
        # ... with one logits and one d-hidden call per group of blocks a rank holds, and
        # TOKEN_TILE / WEIGHT_GRAD_ROWS d-weight calls.
        v_local = vocab_shard_size(VOCAB, tp, multiple=256)
        groups = sum(
            len(
                block_groups(
                    BlockLayout.of_shard(
                        VocabShard.of_rank(tp, v_local, rank=r, vocab_size=VOCAB)
                    ).num_local
                )
            )
            for r in range(tp)
        )
        assert sum(same_tp[0].values()) == (2 + TOKEN_TILE // WEIGHT_GRAD_ROWS) * groups


def test_a_planted_tp_dependent_matmul_is_detected(monkeypatch):
    clean = _logits = engines.TorchInvariantRunner._logits

    def planted(self, hb, temp=None):  # one extra product over the whole shard: K varies with TP
        torch.mm(hb[0], self._wb.flatten(0, 1).t())
        return _logits(self, hb, temp)

    runs = {name: _record(monkeypatch, vocab=VOCAB, h_dim=48, **CONFIGS[name]) for name in CONFIGS}
    assert _differences(runs) == []
    monkeypatch.setattr(engines.TorchInvariantRunner, "_logits", planted)
    runs = {name: _record(monkeypatch, vocab=VOCAB, h_dim=48, **CONFIGS[name]) for name in CONFIGS}
    found = _differences(runs)
    assert found and any("'mm'" in line for line in found), found
    assert engines.TorchInvariantRunner._logits is planted and clean is not planted


@pytest.mark.parametrize("h_dim", [*range(HIDDEN_ALIGN, 161, HIDDEN_ALIGN), 1024, 4096])
@pytest.mark.parametrize("kind", ["logits", "d hidden"])
def test_kernels_round_a_row_the_same_wherever_it_sits_in_the_tile(h_dim, kind):
    gen = torch.Generator().manual_seed(h_dim)
    g, tile, b = BLOCK_GROUP, TOKEN_TILE, 256
    a = torch.randn(g, tile, h_dim if kind == "logits" else b, generator=gen)
    w = torch.randn(
        g, h_dim if kind == "logits" else b, b if kind == "logits" else h_dim, generator=gen
    )
    perm = torch.randperm(tile, generator=gen)
    assert torch.equal(torch.bmm(a[:, perm], w), torch.bmm(a, w)[:, perm])
