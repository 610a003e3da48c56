"""Ranks that disagree get the same clear error on every rank.

Each case runs on 2 gloo ranks with ``MP_BRIDGE_CHECK=1`` (``mp_bridge.testing`` sets it)
and makes rank 1 differ from rank 0 in one argument. Every rank must raise
``AgreementError`` (a ``ValueError``) naming the argument and both ranks' values, within
the world's bounded time (no SIGABRT, no hang: a rank stuck in a collective would stop
the world after ``abort_grace_s`` and fail the case). Without the check these inputs
abort inside gloo, hang, or return a wrong result.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import AgreementError, ColocatedBridgeCommunicator, check_agreement
from mp_bridge.grid import make_grid
from mp_bridge.layers import (
    VocabParallelEmbedding,
    context_parallel_attention,
    fused_linear_cross_entropy,
    masked_mean,
    vocab_parallel_cross_entropy,
)
from mp_bridge.testing import (
    CollectiveCall,
    CollectiveCounter,
    DistributedWorld,
    current_device,
    run_distributed,
)

world = DistributedWorld(2, timeout_s=180, abort_grace_s=15)


def _odd() -> bool:
    return dist.get_rank() == 1


def _world_group():
    return dist.new_group([0, 1])


def _raises(match: str):
    return pytest.raises(AgreementError, match=match)


# ------------------------------------------------------------------------------ bridge
def _fan_in_bridge():
    # 2 src DP replicas -> 1 dest replica of TP 2: FAN_IN, one gather group of both ranks.
    src, dest = make_grid(tp=1, dp=2, create=()), make_grid(tp=2, dp=1, create=())
    return ColocatedBridgeCommunicator(src, dest)


@world.parametrize(
    "odd_shape, odd_dtype, field",
    [((2, 8, 4), torch.float32, "x.shape"), ((3, 4, 8), torch.float32, "x.shape")]
    + [((2, 4, 8), torch.float64, "x.dtype")],
    ids=["transposed", "batch3", "fp64"],
)
def test_bridge_fan_in_disagreement(odd_shape, odd_dtype, field):
    with _fan_in_bridge() as bridge:
        shape, dtype = (odd_shape, odd_dtype) if _odd() else ((2, 4, 8), torch.float32)
        with _raises(rf"ranks disagree on {field}(.|\n)*ranks \[0\] have .*ranks \[1\] have"):
            bridge.communicate(torch.randn(shape, dtype=dtype).to(current_device()))
        # the group still works afterwards
        y = bridge.communicate(torch.randn(2, 4, 8).to(current_device()))
        assert y.shape == (4, 4, 8)


# ------------------------------------------------------------------------ losses
@world.case
def test_cross_entropy_token_counts_differ():
    group = _world_group()
    n, dev = (5 if _odd() else 4), current_device()
    logits, target = torch.randn(n, 8).to(dev), torch.zeros(n, dtype=torch.long, device=dev)
    with _raises(r"ranks disagree on logits.shape(.|\n)*\(4, 8\)(.|\n)*\(5, 8\)"):
        vocab_parallel_cross_entropy(logits, target, tp_group=group)


@world.case
def test_cross_entropy_v_local_differs():
    group = _world_group()
    v_local, dev = (9 if _odd() else 8), current_device()
    with _raises(r"logits.shape(.|\n)*\(4, 8\)(.|\n)*\(4, 9\)"):
        vocab_parallel_cross_entropy(
            torch.randn(4, v_local).to(dev),
            torch.zeros(4, dtype=torch.long, device=dev),
            tp_group=group,
        )


@world.case
def test_cross_entropy_target_differs_across_tp():
    group = _world_group()
    dev = current_device()
    target = torch.tensor([1, 2, 3, 4 if _odd() else 5], device=dev)
    with _raises(r"ranks disagree on target \(fingerprint\)"):
        vocab_parallel_cross_entropy(torch.randn(4, 8).to(dev), target, tp_group=group)
    # A permutation of the same ids is a different target too.
    target = torch.tensor([2, 1, 3, 5] if _odd() else [1, 2, 3, 5], device=dev)
    with _raises(r"target \(fingerprint\)"):
        vocab_parallel_cross_entropy(torch.randn(4, 8).to(dev), target, tp_group=group)


def _fused(n: int, *, chunk_size: int | None = None, hidden=None, group=None):
    torch.manual_seed(0)  # the same hidden and target on both ranks unless given
    dev = current_device()  # drawn on the CPU (same values on every device), then moved
    hidden = torch.randn(n, 6).to(dev) if hidden is None else hidden
    weight = torch.randn(8, 6).to(dev)
    target = torch.randint(0, 16, (n,)).to(dev)
    return fused_linear_cross_entropy(hidden, weight, target, tp_group=group, chunk_size=chunk_size)


@world.case
def test_fused_chunk_sizes_differ():
    group = _world_group()
    with _raises(r"ranks disagree on chunk (.|\n)*chunk: ranks \[0\] have 8; ranks \[1\] have 3"):
        _fused(16, chunk_size=3 if _odd() else 8, group=group)


@world.case
def test_fused_zero_tokens_on_one_rank():
    group = _world_group()
    with _raises(r"hidden.shape(.|\n)*\(0, 6\)"):
        _fused(0 if _odd() else 4, group=group)


@world.case
def test_fused_hidden_not_identical_across_tp():
    group = _world_group()
    torch.manual_seed(0)
    hidden = torch.randn(4, 6).to(current_device())
    if _odd():
        hidden[2, 3] += 1e-3
    with _raises(r"ranks disagree on hidden \(fingerprint\)"):
        _fused(4, hidden=hidden, group=group)
    assert torch.isfinite(_fused(4, group=group))  # identical inputs pass


# ------------------------------------------------------------------ attention, vocab
@world.case
def test_attention_local_lengths_differ():
    group = _world_group()
    s, dev = (6 if _odd() else 4), current_device()
    q = torch.randn(1, s, 2, 4).to(dev)
    pos = torch.arange(s, device=dev) + dist.get_rank() * 4
    with _raises(r"q.shape(.|\n)*\(1, 4, 2, 4\)(.|\n)*\(1, 6, 2, 4\)"):
        context_parallel_attention(q, q, q, cp_group=group, position_ids=pos)


@world.case
def test_embedding_ids_differ_across_tp():
    group = _world_group()
    emb = VocabParallelEmbedding(16, 4, tp_group=group, device=current_device())
    ids = torch.tensor([[1, 2, 3]], device=current_device()) + int(_odd())
    with _raises(r"ids \(fingerprint\)"):
        emb(ids)


# ------------------------------------------------------------------ reductions, grid
@world.case
def test_reductions_with_different_ops():
    group = _world_group()
    dev = current_device()
    values, mask = torch.ones(3, device=dev), torch.ones(3, dtype=torch.bool, device=dev)
    with _raises(r"different collective calls(.|\n)*rank 0 is in masked_mean(.|\n)*masked_sum"):
        if _odd():
            from mp_bridge.layers import masked_sum

            masked_sum(values, mask, group=group)
        else:
            masked_mean(values, mask, group=group)


@world.case
def test_make_grid_sizes_differ():
    sizes = dict(tp=2, dp=1) if _odd() else dict(tp=1, dp=2)
    with _raises(r"make_grid: ranks disagree on sizes(.|\n)*\('tp', 1\)(.|\n)*\('tp', 2\)"):
        make_grid(**sizes)


@world.case
def test_a_local_error_on_one_rank_is_raised_on_every_rank():
    group = _world_group()
    error = ValueError("labels hold 99 on this rank") if _odd() else None
    with _raises(r"where: rank 1 rejected its input: ValueError: labels hold 99"):
        check_agreement("where", group, {"n": 1}, error=error)


def _mean_with_group_on_rank_0_only():
    os.environ["MP_BRIDGE_CHECK_TIMEOUT"] = "3"
    group = dist.new_group([0, 1])
    start = time.monotonic()
    try:
        ones = torch.ones(2, device=current_device())
        masked_mean(ones, ones, group=group if dist.get_rank() == 0 else None)
    except TimeoutError as exc:
        return "timeout", str(exc), time.monotonic() - start
    return "returned", "", time.monotonic() - start


@pytest.mark.skipif(
    os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL",
    reason="DETAIL's ProcessGroupWrapper blocks inside the collective call (its own shape "
    "check, 30 min monitored barrier) before the check's timed wait can start",
)
def test_masked_mean_given_the_group_on_one_rank_only():
    # Rank 1 makes no collective (group=None is one process), so it cannot know; rank 0
    # waits in the agreement exchange for MP_BRIDGE_CHECK_TIMEOUT (3 s) and then names the
    # call and its group instead of hanging.
    (kind0, text0, t0), (kind1, _, _) = run_distributed(
        _mean_with_group_on_rank_0_only, 2, timeout_s=120
    )
    assert kind1 == "returned"
    assert kind0 == "timeout" and t0 < 30, (kind0, t0)
    assert "masked_mean: the ranks [0, 1] of its group did not all join" in text0


# ------------------------------------------------------------------------- model step
def _model_rows():
    """A 2-rank model (encoder DP 2 -> LLM DP 2) and this rank's rows of one batch."""
    from mp_bridge.models import MimoConfig, ReferenceMimo, build_colocated_mimo, synthetic_batch

    cfg = MimoConfig()
    torch.manual_seed(0)
    enc = make_grid(tp=1, dp=2, create=("tp", "dp"))
    llm = make_grid(tp=1, cp=1, dp=2, create=("tp", "cp", "dp", ("dp", "cp")))
    dev = current_device()
    model = build_colocated_mimo(ReferenceMimo(cfg).to(dev), enc, llm, device=dev)
    batch = synthetic_batch(cfg, 4, seed=5).to(dev)
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    parts = [t[rows].clone() for t in (batch.input_ids, batch.labels, batch.loss_mask)]
    return cfg, (enc, llm), model, parts, batch.images[rows]


@world.case
def test_model_label_out_of_range_on_one_dp_replica():
    from mp_bridge.models import destroy_colocated_mimo

    cfg, grids, model, (ids, labels, mask), images = _model_rows()
    try:
        if _odd():
            labels[1, 3] = cfg.vocab_size + 5
        with _raises(r"forward: rank 1 rejected its input: ValueError: labels holds 66"):
            model(ids, labels, mask, images)
    finally:
        destroy_colocated_mimo(model, *grids)


@world.case
def test_model_too_many_image_tokens_on_one_rank():
    from mp_bridge.models import destroy_colocated_mimo

    cfg, grids, model, (ids, labels, mask), images = _model_rows()
    try:
        bad = ids.clone()
        if not _odd():
            bad[0, : cfg.num_patches + 1] = cfg.image_token_id
        with _raises(r"rank 0 rejected its input: ValueError: sample 0 has .* image tokens"):
            model(bad, labels, mask, images)
        assert torch.isfinite(model(ids, labels, mask, images))  # a good batch still runs
    finally:
        destroy_colocated_mimo(model, *grids)


# ------------------------------------------------------------------------ the exchange
def _one_exchange_per_call() -> str:
    with _fan_in_bridge() as bridge:
        with CollectiveCounter() as counter:
            bridge.communicate(torch.randn(2, 4, 8).to(current_device()))
        # one [n, 4 + 32] int64 row all-gathered over the pair (288 bytes from the peer)
        assert counter.check_calls == [CollectiveCall("all_gather", 2, 288)]
        assert counter.counts() == {"all_gather": 1}  # the bridge's own, counted apart
        with pytest.raises(AgreementError) as info:
            bridge.communicate(torch.randn((3 if _odd() else 2), 4, 8).to(current_device()))
    return str(info.value)


same_message_case = world.case(_one_exchange_per_call)


def test_one_small_exchange_and_the_same_message_on_every_rank():
    messages = world.check("_one_exchange_per_call")
    assert messages[0] == messages[1]
    assert "x.shape: ranks [0] have (2, 4, 8); ranks [1] have (3, 4, 8)" in messages[0]
