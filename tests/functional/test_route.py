"""``ColocatedBridgeCommunicator.route`` on 8 and 6 ranks against ``route_oracle``.

FAN_IN, FAN_OUT and EQUAL × dest CP 1/2/3 × SP off/on, plain (``S = 11``, odd) and
packed (odd document lengths), text-only samples included: the rows equal the oracle's
local image rows and ``partition.shard(full).embeddings[mask]``, ``x.grad`` equals the
single-process gradient on every encoder rank, collective counts and bytes are exact.
Also: a sample whose image count differs from its token count raises on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter
from mp_bridge.testing import CollectiveCounter, DistributedWorld
from tests.functional.route_oracle import H, check_route, grids

world = DistributedWorld(8)

# id, src, dest, direction
LAYOUTS_8 = [
    ("fan_in_cp2", dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), "FAN_IN"),
    ("fan_in_cp1", dict(tp=1, dp=8), dict(tp=4, dp=2), "FAN_IN"),
    ("fan_in_tp1_cp2", dict(tp=1, dp=8), dict(cp=2, dp=4), "FAN_IN"),  # route group = CP's
    ("fan_out_cp2", dict(tp=8, dp=1), dict(tp=2, cp=2, dp=2), "FAN_OUT"),
    ("fan_out_cp1", dict(tp=4, dp=2), dict(tp=2, dp=4), "FAN_OUT"),
    ("equal_cp2", dict(tp=4, dp=2), dict(tp=2, cp=2, dp=2), "EQUAL"),
    ("equal_cp1", dict(tp=2, dp=4), dict(tp=2, dp=4), "EQUAL"),
]
LAYOUTS_6 = [
    ("fan_in_cp3", dict(tp=1, dp=6), dict(tp=2, cp=3), "FAN_IN"),
    ("fan_in_cp2", dict(tp=1, dp=6), dict(tp=3, cp=2), "FAN_IN"),
    ("fan_out_cp3", dict(tp=6, dp=1), dict(cp=3, dp=2), "FAN_OUT"),
    ("fan_out_cp1", dict(tp=6, dp=1), dict(tp=2, dp=3), "FAN_OUT"),
    ("equal_cp3", dict(tp=6, dp=1), dict(tp=2, cp=3), "EQUAL"),
]


def _cases(layouts):
    for name, src, dest, direction in layouts:
        for sp in (False, True):
            for packed in (False, True):
                tag = f"{name}-{'sp' if sp else 'nosp'}-{'packed' if packed else 'plain'}"
                yield tag, (dict(tp=1, dp=1) | src, dest, direction, sp, packed)


CASES_8, CASES_6 = list(_cases(LAYOUTS_8)), list(_cases(LAYOUTS_6))


@world.parametrize(
    "src, dest, direction, sp, packed", [c for _, c in CASES_8], ids=[i for i, _ in CASES_8]
)
def test_route_on_eight_ranks(src, dest, direction, sp, packed):
    check_route(src, dest, 8, direction=direction, sp=sp, packed=packed)


@world.parametrize(
    "src, dest, direction, sp, packed",
    [c for _, c in CASES_6],
    ids=[i for i, _ in CASES_6],
    world_size=6,
)
def test_route_on_six_ranks(src, dest, direction, sp, packed):
    check_route(src, dest, 12, direction=direction, sp=sp, packed=packed)


@world.parametrize(
    "src, dest, raising, sample, replica",
    [
        # FAN_IN k=2: encoder replica 1 is slot 1 of LLM replica 0 (ranks 0-3).
        (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), range(0, 4), 2, 0),
        # FAN_OUT k=2: encoder replica 1 (ranks 4-7) feeds LLM replicas 2 and 3.
        (dict(tp=4, dp=2), dict(cp=2, dp=4), range(4, 8), 0, 2),
    ],
    ids=["fan_in", "fan_out"],
)
def test_count_mismatch_raises_on_every_rank_of_the_route_group(
    src, dest, raising, sample, replica
):
    # Every sample has 2 image positions; encoder replica 1 claims 3 tokens for its first.
    src_grid, dest_grid = grids(src, dest)
    rank = dist.get_rank()
    n_src, n_dest = 8 // src["dp"], 8 // dest["dp"]
    counts = [2] * n_src
    if rank in _ranks_of_src_replica_one(src):
        counts[0] = 3
    x = torch.randn(sum(counts), H)
    mask = torch.zeros(n_dest, 6, dtype=torch.bool)
    mask[:, [1, 4]] = True
    part = PartitionAdapter(cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"))
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        if rank in raising:
            match = rf"sample {sample} of LLM DP replica {replica} has 2 True entries .* but 3"
            with pytest.raises(ValueError, match=match):
                bridge.route(x, tokens_per_sample=counts, image_mask=mask, partition=part)
        else:
            y = bridge.route(x, tokens_per_sample=counts, image_mask=mask, partition=part)
            assert y.shape[1] == H
        dist.barrier()


def _ranks_of_src_replica_one(src: dict) -> range:
    # tp fastest: encoder replica 1 is ranks [tp, 2·tp).
    return range(src["tp"], 2 * src["tp"])


@world.case
def test_route_validation_raises_before_any_collective():
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    cp_g, tp_g = dest_grid.get_pg("cp"), dest_grid.get_pg("tp")
    part = PartitionAdapter(cp_group=cp_g, tp_group=tp_g)
    x, mask = torch.randn(4, H), torch.zeros(4, 6, dtype=torch.bool)
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        with CollectiveCounter() as counter:
            with pytest.raises(TypeError, match=r"image_mask must be a bool tensor"):
                bridge.route(x, tokens_per_sample=[2, 2], image_mask=mask.long(), partition=part)
            with pytest.raises(ValueError, match=r"expected \[T\] for packed input"):
                bridge.route(
                    x, tokens_per_sample=[2, 2], image_mask=mask, partition=part, cu_seqlens=[0, 6]
                )
            with pytest.raises(ValueError, match=r"sums to 3 but x has 4 tokens"):
                bridge.route(x, tokens_per_sample=[2, 1], image_mask=mask, partition=part)
            with pytest.raises(ValueError, match=r"does not match rank .* LLM coords"):
                bridge.route(
                    x, tokens_per_sample=[2, 2], image_mask=mask, partition=PartitionAdapter()
                )
            with pytest.raises(ValueError, match=r"FAN_IN with scale 2 joins 2 equal"):
                bridge.route(x, tokens_per_sample=[2, 2], image_mask=mask[:3], partition=part)
        assert counter.calls == []
    with pytest.raises(RuntimeError, match=r"after destroy\(\)"):
        bridge.route(x, tokens_per_sample=[4], image_mask=mask, partition=part)


@world.case
def test_double_backward_is_refused_on_every_rank():
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    part = PartitionAdapter(cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"))
    x = torch.randn(4, H, requires_grad=True)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, [0, 5]] = True
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        y = bridge.route(x, tokens_per_sample=[2, 2], image_mask=mask, partition=part)
        with pytest.raises(RuntimeError, match=r"route cannot differentiate twice"):
            torch.autograd.grad(y.sum(), x, create_graph=True)
        dist.barrier()
