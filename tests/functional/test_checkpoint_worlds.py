"""Checkpoints across world sizes, and saves that die.

World-size change (one chain, each world its own ``run_distributed``): 8 ranks train the
colocated MIMO model 2 steps and save *asynchronously* while they train a third step
(so the checkpoint must hold the state at the save, not the one the step wrote); 4 ranks
(LLM pipelined over 2 stages, encoder TP 4) load it, then save; one process loads that
into the single-process ``ReferenceMimo`` with its Adam and saves; 8 ranks at a third
layout load that. Every load is checked bitwise against the weights and Adam state the
8 ranks held at the first save (gathered over TP; a pipeline stage checks its own names).
On the 4 ranks, three bad loads raise the same ``ValueError`` on every rank: a checkpoint
of a 2-layer LLM into the 4-layer model (the key check runs over the union of the stages'
keys), a checkpoint with a truncated data file, and a bad ``prefix`` passed on rank 1 only.

Killed save: 4 ranks save a vocab-parallel model (step 1), then save again and one rank
(or every rank) dies after writing its data file: the launcher reports the death, the
step-1 checkpoint still loads whole in one process, the leftovers are ignored, and the
next save removes them.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from mp_bridge.checkpoint import load, save
from mp_bridge.layers import VocabParallelEmbedding
from mp_bridge.models import MimoConfig, ReferenceMimo
from mp_bridge.testing import DistributedError, run_distributed, under_torchrun
from tests.functional.checkpoint_runs import CFG, EPS, LR, build, seed_all, unequal

# Under torchrun every launched process would start its own worlds here: these tests run
# their worlds themselves (8, 4, 1 ranks), so they run without torchrun only.
pytestmark = pytest.mark.skipif(
    under_torchrun(), reason="starts its own worlds of 8, 4 and 1 ranks; run without torchrun"
)

LAYOUT_8 = dict(encoder_tp=2, encoder_dp=4, llm_tp=2, llm_cp=2, llm_dp=2)
LAYOUT_4 = dict(encoder_tp=4, encoder_dp=1, llm_tp=2, llm_pp=2, microbatches=2)
LAYOUT_8_BACK = dict(encoder_tp=1, encoder_dp=8, llm_tp=4, llm_dp=2)


def _save_8(path: str) -> dict:
    seed_all(0)
    run = build(LAYOUT_8, seed=0)
    run.step(0)
    run.step(1)
    at_save = run.full()
    handle = save(path, run.model, run.optimizer, step=2, async_save=True)
    run.step(2)  # trains on while the checkpoint is written
    handle.wait()
    run.destroy()
    return at_save


def _error(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def _load_4(path: str, bad: str, damaged: str, out: str, want: dict):
    run = build(LAYOUT_4, seed=7)
    errors = (
        _error(load, bad, run.model),  # other layer count: keys of every stage checked
        _error(load, damaged, run.model),  # a truncated data file
        # A bad argument on rank 1 only: every rank raises, none waits for rank 1.
        _error(load, path, run.model, prefix="llm" if dist.get_rank() == 1 else None),
    )
    info = load(path, run.model, run.optimizer)
    got = run.full()
    save(out, run.model, run.optimizer, step=info.step, extra={"via": "4 ranks"})
    run.destroy()
    return errors, unequal(got, want), len(set(got) & set(want)), info


def _load_8(path: str, want: dict):
    run = build(LAYOUT_8_BACK, seed=9)
    info = load(path, run.model, run.optimizer)
    got = run.full()
    run.destroy()
    return unequal(got, want), len(set(got) & set(want)), info.world_size


def test_world_size_changes_8_to_4_to_1_and_back(tmp_path):
    bad = str(tmp_path / "two_layers")
    save(bad, ReferenceMimo(MimoConfig(llm_layers=2)))
    want = run_distributed(_save_8, 8, str(tmp_path / "w8"))[0]
    damaged = str(tmp_path / "damaged")
    shutil.copytree(str(tmp_path / "w8"), damaged)
    with open(glob.glob(f"{damaged}/*.distcp")[0], "r+b") as f:
        f.truncate(10)
    results = run_distributed(
        _load_4, 4, str(tmp_path / "w8"), bad, damaged, str(tmp_path / "w4"), want
    )
    errors = {r[0] for r in results}
    assert len(errors) == 1, errors  # the same three errors on every rank
    layers, damage, prefix = errors.pop()
    assert "model.llm.blocks.2.attn.qkv.weight: saved nothing, expected (48, 16)" in layers
    assert re.search(rf"damaged checkpoint at '{damaged}': __\d_0.distcp is 10 bytes", damage)
    assert re.search(r"prefix='llm': pass the name .* \(rank 1\)$", prefix), prefix
    for _, moved, shared, info in results:
        assert shared > 0 and not moved, moved
        assert info.world_size == 8 and info.grids["llm"]["shape"] == [2, 2, 1, 2]

    reference = ReferenceMimo(CFG)
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR, eps=EPS)
    info = load(str(tmp_path / "w4"), reference, optimizer)
    assert (info.world_size, info.extra, info.grids["llm"]["shape"]) == (4, {"via": "4 ranks"},
                                                                          [2, 1, 2, 1])  # fmt: skip
    got = dict(reference.state_dict())
    for name, p in reference.named_parameters():
        got.update({f"{name}:{k}": v for k, v in optimizer.state[p].items()})
    assert set(got) == set(want) and not unequal(got, want)
    save(str(tmp_path / "w1"), reference, optimizer, step=2)

    for moved, shared, world in run_distributed(_load_8, 8, str(tmp_path / "w1"), want):
        assert world == 1 and shared == len(want) and not moved, moved


class _Vocab(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.embed = VocabParallelEmbedding(1001, 8, tp_group=group)
        self.norm = nn.LayerNorm(8)


def _die_mid_save(path: str, who: str) -> None:
    model = _Vocab(dist.group.WORLD)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    save(path, model, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    if who == "all" or dist.get_rank() == 1:
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            os._exit(17)

        FileSystemWriter.write_data = write_then_die
    save(path, model, step=2)


@pytest.mark.parametrize("who", ["one", "all"])
def test_a_save_that_dies_leaves_the_previous_checkpoint_whole(tmp_path, who):
    path = str(tmp_path / "ck")
    with pytest.raises(DistributedError, match=r"rank \d"):
        run_distributed(_die_mid_save, 4, path, who, timeout_s=120)
    leftovers = glob.glob(str(tmp_path / ".ck.partial-*"))
    assert len(leftovers) == 1 and os.listdir(leftovers[0])  # data was written
    model = _Vocab(None)
    assert load(path, model).step == 1
    assert bool((model.embed.weight[:1001] == 1).all()) and not model.embed.weight[1001:].any()
    save(path, model, step=3)
    assert not glob.glob(str(tmp_path / ".ck.*")) and load(path, model).step == 3
