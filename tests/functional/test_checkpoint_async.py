"""Asynchronous saves in a loop that never calls ``wait()`` (2 gloo ranks, one world).

30 saves in a row of a vocab-parallel embedding (TP 2 over both ranks, vocab 1001: rank
1 holds padding rows) with Adam state, each followed at once by an in-place change of
every parameter and state tensor while the previous save may still be writing:

- the live process groups (``dist.distributed_c10d._world.pg_map``) after save 1 equal
  those after save 30 (one writer group, made once), and ``close()`` frees it;
- this process's RSS grows by less than one staging copy (the bytes of this rank's
  parameters and optimizer state) from save 5 to save 30: the staging buffers are reused;
- the last checkpoint holds the values at the moment of its save (not the changes made
  after ``save`` returned), exactly: checked against the full tensors written out here
  by hand (every value is ``seed + i`` for save ``i``, exact in fp32).
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.checkpoint import close, load, save
from mp_bridge.layers import VocabParallelEmbedding
from mp_bridge.testing import DistributedWorld

world = DistributedWorld(2)
V, H, SAVES = 1001, 2048, 30


class _Vocab(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.embed = VocabParallelEmbedding(V, H, tp_group=group)
        self.norm = nn.LayerNorm(H)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _set(model: _Vocab, optimizer, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
            for t in optimizer.state[p].values():
                t.fill_(value)


@world.case
def test_thirty_async_saves_without_wait_keep_one_group_and_one_staging_copy():
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = box[0] + "/ck"
    model = _Vocab(dist.group.WORLD)
    optimizer = torch.optim.Adam(model.parameters())
    model.norm(model.embed(torch.tensor([[1, 1000]]))).sum().backward()
    optimizer.step()  # Adam state: step, exp_avg, exp_avg_sq
    staged_bytes = sum(p.numel() * 3 * 4 for p in model.parameters())  # fp32 p, m, v
    before = _live_groups()
    groups, rss = {}, {}
    for i in range(1, SAVES + 1):
        _set(model, optimizer, float(i))
        save(path, model, optimizer, step=i, async_save=True)
        _set(model, optimizer, -1.0)  # training goes on while the save writes
        groups[i], rss[i] = _live_groups(), _rss_bytes()
    assert groups[1] == groups[SAVES] == before + 1, (before, groups)
    assert rss[SAVES] - rss[5] < staged_bytes, ([rss[i] >> 20 for i in rss], staged_bytes)
    close()
    assert _live_groups() == before
    fresh = _Vocab(dist.group.WORLD)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    assert load(path, fresh, fresh_opt).step == SAVES
    rows = fresh.embed.weight.shape[0]
    real = min(V - dist.get_rank() * rows, rows)  # rank 1's last rows are padding (zero)
    want = torch.zeros(rows, H)
    want[:real] = SAVES
    assert torch.equal(fresh.embed.weight, want)
    assert torch.equal(fresh.norm.weight, torch.full((H,), float(SAVES)))
    state = fresh_opt.state[fresh.embed.weight]
    assert torch.equal(state["exp_avg"], want) and float(state["step"]) == SAVES
