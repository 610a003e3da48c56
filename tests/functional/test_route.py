"""``ColocatedBridgeCommunicator.route`` on 8 and 6 ranks against ``route_oracle``.

FAN_IN, FAN_OUT and EQUAL × dest CP 1/2/3 × SP off/on, plain (``S = 11``, odd) and
packed (odd document lengths), text-only samples included: the rows equal the oracle's
local image rows and ``partition.shard(full).embeddings[mask]``, ``x.grad`` equals the
single-process gradient on every encoder rank, collective counts and bytes are exact.
Also: a sample whose image count differs from its token count (in one replica), or one
rank passing another number of samples, raises the same error on every rank; a repeated
layout reuses the communicator's cached plan.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mp_bridge.comm.bridge.execution.route as route_module
from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter
from mp_bridge.grid import GridLayout
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.functional.route_oracle import H, RouteBatch, check_route, grids, ref_local_tokens

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


def _route_expecting_error(src, dest, counts, mask, match):
    """``route`` on this rank must raise ``ValueError`` matching ``match``, with the same
    message on every rank; then a world barrier (no rank is stranded in a collective)."""
    src_grid, dest_grid = grids(src, dest)
    x = torch.randn(sum(counts), H).to(current_device())
    mask = mask.to(current_device())
    part = PartitionAdapter(cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"))
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        with pytest.raises(ValueError, match=match) as info:
            bridge.route(x, tokens_per_sample=counts, image_mask=mask, partition=part)
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, str(info.value))
        assert len(set(messages)) == 1, messages
        dist.barrier()


@world.parametrize(
    "src, dest, sample, replica, first",
    [
        # 8 samples, 2 image positions each; encoder replica 1 claims 3 tokens for its
        # first sample (global sample `first`), which sits in one LLM replica only.
        # FAN_IN k=2: encoder replica 1 (samples 2-3) is slot 1 of LLM replica 0.
        (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), 2, 0, 2),
        # FAN_OUT k=2: encoder replica 1 (samples 4-7) feeds LLM replicas 2 and 3.
        (dict(tp=4, dp=2), dict(cp=2, dp=4), 0, 2, 4),
        # EQUAL: encoder replica 1 (samples 2-3) is LLM replica 1.
        (dict(tp=2, dp=4), dict(tp=2, dp=4), 0, 1, 2),
    ],
    ids=["fan_in", "fan_out", "equal"],
)
def test_count_mismatch_raises_the_same_error_on_every_rank(src, dest, sample, replica, first):
    rank = dist.get_rank()
    n_src, n_dest = 8 // src["dp"], 8 // dest["dp"]
    counts = [2] * n_src
    if rank in range(src["tp"], 2 * src["tp"]):  # tp fastest: encoder replica 1
        counts[0] = 3
    mask = torch.zeros(n_dest, 6, dtype=torch.bool)
    mask[:, [1, 4]] = True
    match = (
        rf"disagree on 1 sample\(s\): sample {sample} of LLM DP replica {replica} has 2 True "
        rf"entries in image_mask but 3 image tokens in tokens_per_sample \(global sample "
        rf"{first}; sample 0 of encoder DP replica 1\)"
    )
    _route_expecting_error(src, dest, counts, mask, match)


@world.parametrize(
    "src, dest, odd_rank, counts, n_dest, match",
    [
        # Encoder tp=2: rank 3 passes 3 samples, its TP peer rank 2 passes 2.
        (
            dict(tp=2, dp=4),
            dict(tp=2, cp=2, dp=2),
            3,
            [2, 2, 0],
            4,
            r"the ranks \[2, 3\] of encoder DP replica 1 disagree on tokens_per_sample: rank 2 "
            r"passes 2 samples, rank 3 3",
        ),
        # Encoder tp=1: rank 5 alone is encoder replica 5 and passes 2 samples, not 1.
        (
            dict(tp=1, dp=8),
            dict(tp=4, dp=2),
            5,
            [2, 0],
            4,
            r"do not fit FAN_IN with scale 4: .*replica 5 \(ranks \[5\]\) 2, .* samples in "
            r"tokens_per_sample",
        ),
        # EQUAL: rank 1's image_mask holds 1 sample, its LLM replica peer rank 0's 2.
        (
            dict(tp=2, dp=4),
            dict(tp=2, dp=4),
            1,
            [2, 2],
            1,
            r"the ranks \[0, 1\] of LLM DP replica 0 disagree on image_mask: rank 0 passes 2 "
            r"samples, rank 1 1",
        ),
    ],
    ids=["encoder_tp_peers", "encoder_replica", "llm_tp_peers"],
)
def test_one_rank_with_another_number_of_samples_raises_on_every_rank(
    src, dest, odd_rank, counts, n_dest, match
):
    rank = dist.get_rank()
    n_src = 8 // src["dp"]
    mine = counts if rank == odd_rank else [2] * n_src
    rows = n_dest if rank == odd_rank else 8 // dest["dp"]
    mask = torch.zeros(rows, 6, dtype=torch.bool)
    mask[:, [1, 4]] = True
    _route_expecting_error(src, dest, mine, mask, match)


@world.case
def test_route_validation_raises_before_any_collective():
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    cp_g, tp_g = dest_grid.get_pg("cp"), dest_grid.get_pg("tp")
    part = PartitionAdapter(cp_group=cp_g, tp_group=tp_g)
    dev = current_device()
    x, mask = torch.randn(4, H).to(dev), torch.zeros(4, 6, dtype=torch.bool, device=dev)
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        # The route groups are made on every rank before validation (a rank raising first
        # would leave the others in new_group); made here, the calls below need nothing.
        bridge.prepare_route()
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
    dev = current_device()
    x = torch.randn(4, H).to(dev).requires_grad_()
    mask = torch.zeros(4, 6, dtype=torch.bool, device=dev)
    mask[:, [0, 5]] = True
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        y = bridge.route(x, tokens_per_sample=[2, 2], image_mask=mask, partition=part)
        with pytest.raises(RuntimeError, match=r"route cannot differentiate twice"):
            torch.autograd.grad(y.sum(), x, create_graph=True)
        dist.barrier()


@world.case
def test_a_repeated_layout_reuses_the_cached_plan():
    # Batches of seeds 7, 8, 7, 8 through one bridge: each output is the oracle's local
    # image rows, and each rank plans twice (its route group's layout differs by seed).
    rank = dist.get_rank()
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    s_lay, d_lay = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    dc = d_lay.coords(rank)
    part = PartitionAdapter(
        cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"), sequence_parallel=True
    )
    calls, original = [], route_module.plan_route

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    route_module.plan_route = counting
    try:
        with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
            for seed in (7, 8, 7, 8):
                batch = RouteBatch(8, packed=False, seed=seed)
                s_samples, d_samples = batch.samples(s_lay, rank), batch.samples(d_lay, rank)
                mask, _ = batch.image_mask(d_samples)
                y = bridge.route(
                    batch.X[batch.token_rows(s_samples)],
                    tokens_per_sample=[batch.counts[s] for s in s_samples],
                    image_mask=mask,
                    partition=part,
                )
                lengths = [batch.lengths[s] for s in d_samples]
                local = ref_local_tokens(lengths, False, 2, dc["cp"], 2, dc["tp"])
                rows = [batch.global_row(d_samples[i], p) for i, p in (t for t in local if t)]
                assert torch.equal(y, batch.X[[r for r in rows if r is not None]]), seed
    finally:
        route_module.plan_route = original
    assert len(calls) == 2, len(calls)


@world.case
def test_fan_out_without_image_tokens_sends_no_shard_ids():
    # Text-only batches everywhere: FAN_OUT's shard-id gather has nothing to carry (every
    # rank knows it from the count rows), so the count row is the only collective.
    src_grid, dest_grid = grids(dict(tp=4, dp=2), dict(cp=2, dp=4))
    part = PartitionAdapter(cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"))
    dev = current_device()
    x = torch.zeros(0, H, device=dev, requires_grad=True)
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        bridge.prepare_route()  # group creation is not part of a call's budget
        with CollectiveCounter() as fwd:
            y = bridge.route(
                x,
                tokens_per_sample=[0] * 4,
                image_mask=torch.zeros(2, 6, dtype=torch.bool, device=dev),
                partition=part,
            )
        assert y.shape == (0, H)
        assert fwd.counts() == {"all_gather": 1}, fwd.calls
        assert fwd.bytes_received() == 7 * 8 * 7  # 7 other ranks' 7-int64 count rows
        y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(0, H, device=dev))
