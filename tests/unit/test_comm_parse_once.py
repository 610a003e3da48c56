"""Parse once: the layout ``shard`` builds is what route, attention and the mask take;
one per-sample count; one membership check; bad inputs named before any collective."""

from __future__ import annotations

import warnings

import pytest
import torch

from mp_bridge.comm import (
    PaddedLayout,
    PartitionAdapter,
    packed_sequence_mask,
    pad_layout,
    plan_bridge,
    sample_sums,
)
from mp_bridge.comm.bridge.execution.names import bridge_names
from mp_bridge.comm.bridge.execution.route import parse_route
from mp_bridge.grid import GridLayout
from mp_bridge.layers import context_parallel_attention


def _plan():
    return plan_bridge(GridLayout([2, 2], ["tp", "dp"]), GridLayout([2, 2], ["tp", "dp"]))


# ------------------------------------------------------------ one per-sample count
def test_sample_sums_counts_rows_and_documents():
    values = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    # Expected values counted by hand from the literal above.
    assert sample_sums(values, [0, 5, 8]).tolist() == [2, 1]
    assert sample_sums(values, torch.tensor([0, 0, 5, 8])).tolist() == [0, 2, 1]
    layout = pad_layout(8, 2, cu_seqlens=[0, 5, 8])  # padded, but counts use the original
    assert sample_sums(values, layout).tolist() == [2, 1]
    assert sample_sums(values.reshape(2, 4)).tolist() == [2, 1]
    assert sample_sums(values.reshape(2, 4)).dtype == torch.int64


def test_placeholder_counts_is_sample_sums():
    from mp_bridge.models.data import placeholder_counts

    ids = torch.tensor([5, 9, 9, 5, 5, 9, 5, 5])
    assert placeholder_counts(ids, 9, torch.tensor([0, 5, 8])).tolist() == [2, 1]
    assert placeholder_counts(ids.reshape(2, 4), 9).tolist() == [2, 1]


# ------------------------------------------------------------ the layout travels
def test_shard_carries_the_layout_it_cut_with():
    adapter = PartitionAdapter()
    ids = torch.arange(7)
    batch = adapter.shard(None, input_ids=ids, cu_seqlens=[0, 3, 7])
    assert batch.layout == adapter.layout(7, cu_seqlens=[0, 3, 7])
    assert batch.layout.packed and batch.layout.bounds == (0, 3, 7)
    plain = adapter.shard(None, input_ids=ids.reshape(1, 7))
    assert plain.layout == adapter.layout(7) and not plain.layout.packed


def test_packed_mask_from_a_layout_equals_the_mask_from_its_bounds_and_is_cached():
    layout = pad_layout(11, 2, cu_seqlens=[0, 3, 11])  # padded to (0, 4, 12)
    for rank in (0, 1):
        want = packed_sequence_mask([0, 4, 12], 2, rank)
        got = packed_sequence_mask(layout, 2, rank, seq_len=12)
        assert torch.equal(got, want)
        assert packed_sequence_mask(layout, 2, rank) is got  # built once per layout
    with pytest.raises(ValueError, match=r"not a packed layout cut for cp_size=4"):
        packed_sequence_mask(layout, 4, 0)


def test_attention_takes_the_layout_and_matches_raw_cu_seqlens():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64) for _ in range(3))
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])
    layout = pad_layout(8, 1, cu_seqlens=[0, 3, 8])
    raw = context_parallel_attention(q, k, v, position_ids=pos, cu_seqlens=[0, 3, 8])
    parsed = context_parallel_attention(q, k, v, position_ids=pos, cu_seqlens=layout)
    # Same inputs, same ops: bitwise equal.
    assert torch.equal(raw, parsed)
    # A plain layout means no packing: visibility from the layout's own positions 0..7
    # (the user's positions are for RoPE), equal to passing those positions.
    plain = context_parallel_attention(q, k, v, position_ids=pos, cu_seqlens=pad_layout(8, 1))
    assert torch.equal(plain, context_parallel_attention(q, k, v, position_ids=torch.arange(8)))


def test_route_takes_the_layout_and_checks_it():
    plan, part = _plan(), PartitionAdapter()
    x, mask = torch.randn(2, 4), torch.zeros(2, 6, dtype=torch.bool)
    mask[:, 1] = True
    call = parse_route(x, [1, 1], mask, part, layout=part.layout(6), plan=plan, rank=0)
    assert call.layout == part.layout(6) and call.counts == (1, 1)
    with pytest.raises(ValueError, match=r"pass cu_seqlens or layout"):
        parse_route(
            x, [1, 1], mask.reshape(-1), part, cu_seqlens=[0, 6, 12],
            layout=part.layout(12, cu_seqlens=[0, 6, 12]), plan=plan, rank=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"layout was cut for cp=2"):
        parse_route(x, [1, 1], mask, part, layout=pad_layout(6, 2), plan=plan, rank=0)
    with pytest.raises(ValueError, match=r"layout describes 8 tokens"):
        parse_route(x, [1, 1], mask, part, layout=part.layout(8), plan=plan, rank=0)
    with pytest.raises(TypeError, match=r"layout must be a PaddedLayout"):
        parse_route(x, [1, 1], mask, part, layout=[0, 6], plan=plan, rank=0)


# ------------------------------------------------------------ one membership check
def test_membership_is_one_check():
    plan = _plan()
    plan.check_member(3, "route()")
    with pytest.raises(ValueError, match=r"rank 4 is outside the bridged grids .* call route\(\)"):
        plan.check_member(4, "route()")
    part, x = PartitionAdapter(), torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"rank 9 is outside the bridged grids"):
        parse_route(x, [1, 1], torch.zeros(2, 6, dtype=torch.bool), part, plan=plan, rank=9)


# ------------------------------------------------------------ bad inputs
@pytest.mark.parametrize(
    "shape_q, shape_kv",
    [((1, 4, 0, 8), (1, 4, 0, 8)), ((1, 4, 2, 0), (1, 4, 2, 0)), ((1, 4, 2, 8), (1, 4, 0, 8))],
)
def test_attention_rejects_zero_heads_or_head_dim(shape_q, shape_kv):
    q, k = torch.randn(shape_q), torch.randn(shape_kv)
    with pytest.raises(ValueError, match=r"must have at least one head and a head dim >= 1"):
        context_parallel_attention(q, k, k.clone(), causal=False)


@pytest.mark.parametrize(
    "cu, error, text",
    [
        (torch.tensor([0, 1], dtype=torch.bool), TypeError, r"cu_seqlens must be a 1-D integer"),
        (True, TypeError, r"cu_seqlens must be a 1-D integer tensor or a list of ints, got bool"),
        ([0, None, 8], TypeError, r"cu_seqlens must hold ints, got \[0, None, 8\]"),
        ([0, True, 8], TypeError, r"cu_seqlens must hold ints"),
    ],
)
def test_bad_cu_seqlens_are_named_everywhere(cu, error, text):
    part, ids = PartitionAdapter(), torch.arange(8)
    with pytest.raises(error, match=text):
        part.shard(None, input_ids=ids, cu_seqlens=cu)
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(error, match=text):
        context_parallel_attention(q, q, q, causal=False, cu_seqlens=cu)
    x = torch.randn(2, 4)
    with pytest.raises(error, match=text):
        mask = torch.zeros(8, dtype=torch.bool)
        parse_route(x, [1, 1], mask, part, cu_seqlens=cu, plan=_plan(), rank=0)


def test_float_position_ids_are_named():
    part = PartitionAdapter()
    with pytest.raises(TypeError, match=r"position_ids has dtype torch.float32, expected an int"):
        part.shard(torch.randn(1, 8, 4), position_ids=torch.arange(8.0))
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(TypeError, match=r"position_ids has dtype torch.float32"):
        context_parallel_attention(q, q, q, position_ids=torch.arange(8.0))


def test_partition_adapter_arguments_use_the_validators():
    with pytest.raises(TypeError, match=r"sequence_parallel must be True or False, got 1"):
        PartitionAdapter(sequence_parallel=1)
    with pytest.raises(TypeError, match=r"seq_dim must be an int, got 1.0"):
        PartitionAdapter(seq_dim=1.0)
    with pytest.raises(TypeError, match=r"cp_group=2 must be a torch.distributed ProcessGroup"):
        PartitionAdapter(cp_group=2)


# ------------------------------------------------------------ one name per concept
def test_module_names_megatron_spelling_and_deprecated_alias():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bridge_names("vision", "lm") == ("vision", "lm")
        assert bridge_names(None, None) == ("encoder", "llm")
    with pytest.warns(DeprecationWarning, match=r"dest_name=...\) is deprecated"):
        assert bridge_names(None, None, None, "lm") == ("encoder", "lm")


def test_padded_layout_is_still_a_value():
    a, b = pad_layout(8, 2, cu_seqlens=[0, 3, 8]), pad_layout(8, 2, cu_seqlens=[0, 3, 8])
    packed_sequence_mask(a, 2, 0)  # fills a's cache only
    assert a == b and hash(a) == hash(b) and isinstance(a, PaddedLayout)
