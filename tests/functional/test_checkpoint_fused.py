"""Fused projections change TP through a checkpoint (4 ranks, one world).

Every fused projection our TP blocks hold is the attention's ``qkv``: its rows are
``[heads, (q, k, v), head_dim]`` (megatron's interleaved order), so a TP rank's shard is
whole heads, contiguous rows ``[r * 3h/tp, (r + 1) * 3h/tp)`` of the full weight, and it
needs no layout declaration. A fused ``[gate; up]`` weight is not contiguous: rank ``r``
holds ``[gate_r; up_r]``; it declares ``mark_sharded(..., parts=2)``.

A module with a ``TPBlock`` and such a ``gate_up`` is loaded from hand-made full tensors
at TP 4, saved, loaded at TP 2, saved, loaded at TP 1, saved, loaded at TP 4. After each
load, every rank's local shard is checked against the slice of the full tensor written
out here by hand (qkv: its contiguous rows; gate_up: ``cat(gate[rows], up[rows])``), and
the gathered tensors against the full ones, bitwise.

In the same world, errors every rank raises alike (none left waiting): ranks whose
models disagree on a global shape, a bad ``extra`` on one rank only, a save into a file
(seen by the coordinator only); and two asynchronous saves in a row both publish.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.checkpoint import load, save
from mp_bridge.comm import group_rank, group_size
from mp_bridge.layers import mark_sharded
from mp_bridge.models import gather_full_state, load_full_state
from mp_bridge.models.parallel.tp_blocks import TPBlock, parallel_config
from mp_bridge.testing import DistributedWorld

world = DistributedWorld(4)
HIDDEN, HEADS, FFN = 16, 8, 32


class Fused(nn.Module):
    def __init__(self, group):
        super().__init__()
        config = parallel_config(group)
        self.block = TPBlock(HIDDEN, HEADS, FFN, eps=1e-5, tp_group=group, config=config,
                             core=lambda q, k, v: q)  # fmt: skip
        rows = 2 * FFN // group_size(group)
        self.gate_up = nn.Parameter(torch.zeros(rows, HIDDEN))
        mark_sharded(self.gate_up, dim=0, group=group, full_size=2 * FFN, parts=2)


def _shared_path() -> str:
    box = [__import__("tempfile").mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0] + "/ck"


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _tp_group(tp: int):
    mine = None
    for start in range(0, dist.get_world_size(), tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= dist.get_rank() < start + tp:
            mine = group
    return mine


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {n: p.shape for n, p in Fused(None).named_parameters()}  # TP 1: full shapes
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _wrong_shards(model: Fused, full: dict[str, torch.Tensor]) -> list[str]:
    group = model.block.attn.qkv.tp_group if hasattr(model.block.attn.qkv, "tp_group") else None
    tp, r = group_size(group), group_rank(group)
    bad = []
    n = 3 * HIDDEN // tp  # qkv: contiguous whole heads
    if not torch.equal(
        model.block.attn.qkv.weight, full["block.attn.qkv.weight"][r * n : (r + 1) * n]
    ):
        bad.append("qkv")
    m = FFN // tp  # gate_up: [gate_r; up_r]
    gate, up = full["gate_up"][:FFN], full["gate_up"][FFN:]
    if not torch.equal(
        model.gate_up, torch.cat([gate[r * m : (r + 1) * m], up[r * m : (r + 1) * m]])
    ):
        bad.append("gate_up")
    gathered = gather_full_state(model)
    return bad + [k for k, v in full.items() if not torch.equal(gathered[k], v)]


@world.case
def test_fused_projections_change_tp_through_a_checkpoint():
    path = _shared_path()
    full = _full()
    model = Fused(_tp_group(4))
    load_full_state(model, full)
    assert _wrong_shards(model, full) == []
    for tp in (2, 1, 4):
        save(path, model)
        model = Fused(_tp_group(tp))
        info = load(path, model)
        wrong = _wrong_shards(model, full)
        assert not wrong, (tp, wrong)
    assert info.group_sizes["gate_up"] == 1 and info.group_sizes["block.attn.qkv.weight"] == 1


@world.case
def test_every_rank_raises_the_same_error_and_async_saves_queue():
    path, rank, group = _shared_path(), dist.get_rank(), _tp_group(4)
    model = Fused(group)
    first = save(path, model, step=1, async_save=True)
    second = save(path, model, step=2, async_save=True)  # no wait() between
    first.wait()
    second.wait()
    if rank == 0:
        open(path + "/../file", "w").close()
    other = Fused(group)
    if rank == 0:  # rank 0 alone: a model with twice the FFN rows
        other.gate_up = nn.Parameter(torch.zeros(4 * FFN // 4, HIDDEN))
        mark_sharded(other.gate_up, dim=0, group=group, full_size=4 * FFN, parts=2)
    errors = [
        _error(load, path, other),
        _error(save, path + "2", model, extra={"x": (1,)} if rank == 1 else None),
        _error(save, path + "/../file/ck", model),
    ]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    assert all(e == errors for e in gathered), gathered
    assert re.search(r"disagree on model.gate_up: global shape \(128, 16\) on rank 0, "
                     r"\(64, 16\) on rank 1", errors[0]), errors[0]  # fmt: skip
    assert "extra must hold JSON values" in errors[1] and errors[1].endswith("(rank 1)")
    assert re.search(r"/file/ck': '.*file' is a file \(rank 0\)$", errors[2]), errors[2]
    assert load(path, model).step == 2
