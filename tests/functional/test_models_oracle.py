"""The colocated MIMO model on 8 ranks against the same model trained in one process.

Each case seeds one ``ReferenceMimo``, shards it onto an encoder grid and an LLM grid,
runs 3 Adam steps on the same global batch in both, and compares (``run_parity``):
the global loss at every step, the encoder input gradient (every rank's DP shard), and
every parameter after the last step gathered to full. All fp32.

Tolerances (``rel`` = max abs difference / max abs reference value, per tensor):

- loss ``rel <= 1e-5``: the distributed run sums the same fp32 products in another order
  (TP-split matmuls, K/V gathered over CP, DP x CP all-reduced token sums), which moves
  an O(1) loss by a few ulps (measured ~1e-7); 1e-5 leaves ~100x headroom while a wrong
  denominator or a missing gradient path shifts it by >1e-3 (see the teeth cases).
- encoder input gradient ``rel <= 1e-5``: one backward, the same rounding argument
  (measured < 1e-6).
- every parameter's synced gradient at step 1, gathered to full, ``rel <= 1e-5``: the
  same rounding argument (measured ~1e-6). Adam's update hardly depends on a gradient's
  scale, so this is the check that sees a gradient summed over one group too many.
- weights ``rel <= 1e-4``: after 3 Adam steps (lr 1e-3). Adam divides by sqrt(v), so an
  element whose gradient is small but far above eps turns a ~1e-7 relative gradient error
  into the same relative *update* error, and elements with gradients near eps amplify
  it further; measured 1e-5..3e-5 with weights of O(0.3). A real bug moves weights by
  about lr = 1e-3 (rel > 1e-3).

Runs on gloo here; on 8 GPUs: ``MP_BRIDGE_BACKEND=nccl torchrun --nproc-per-node 8 -m
pytest tests/functional/test_models_oracle.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mp_bridge.comm.bridge.execution.dense as bridge_module
import mp_bridge.models.colocated.parts as parts_module
from mp_bridge.grid import make_grid
from mp_bridge.models import (
    ColocatedMimoModel,
    MimoConfig,
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
    run_parity,
    synthetic_batch,
)
from mp_bridge.testing import DistributedWorld, current_device

world = DistributedWorld(8)
CFG = MimoConfig()  # seq 16 (divisible by 2*cp*tp = 8), 8 heads, vocab 61 (pads at TP 2/8)
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
WEIGHT_RTOL = 1e-4


def _check(report) -> dict:
    summary = (
        f"{report.encoder} -> {report.llm}: loss rel {report.loss_max_rel:.1e}, input grad "
        f"rel {report.input_grad_max_rel:.1e}, param grad rel {report.param_grad_max_rel:.1e} "
        f"({report.worst_param_grad}), weight rel {report.weight_max_rel:.1e} "
        f"({report.worst_weight}); losses {report.dist_losses} vs {report.ref_losses}"
    )
    assert report.loss_max_rel <= LOSS_RTOL, summary
    assert report.input_grad_max_rel <= GRAD_RTOL, summary
    assert report.param_grad_max_rel <= GRAD_RTOL, summary
    assert report.weight_max_rel <= WEIGHT_RTOL, summary
    # The model must actually train, or equal weights would prove nothing.
    assert report.ref_losses[-1] < report.ref_losses[0], summary
    return {"loss_rel": report.loss_max_rel, "weight_rel": report.weight_max_rel}


def _parity(**kwargs):
    return run_parity(CFG, device=current_device(), **kwargs)


FAN_IN_CP2 = dict(encoder_tp=2, encoder_dp=4, llm_tp=2, llm_cp=2, llm_dp=2)
#: The bridged layouts (encoder -> LLM); one parametrized case each.
LAYOUTS = {
    "fan_in_cp2": FAN_IN_CP2,
    "fan_out_cp2": dict(encoder_tp=4, encoder_dp=2, llm_tp=1, llm_cp=2, llm_dp=4),
    "equal_dp": dict(encoder_tp=2, encoder_dp=4, llm_tp=2, llm_cp=1, llm_dp=4),
    "fan_in_8_cp4": dict(encoder_tp=1, encoder_dp=8, llm_tp=2, llm_cp=4, llm_dp=1),
    "fan_out_8": dict(encoder_tp=8, encoder_dp=1, llm_tp=1, llm_cp=1, llm_dp=8),
    "fan_in_cp2_sequence_parallel": dict(FAN_IN_CP2, sequence_parallel=True),
    "fan_in_cp2_sequence_parallel_fused_loss": dict(
        FAN_IN_CP2, sequence_parallel=True, fused_loss=True
    ),
}


@world.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_parity_with_one_process(layout):
    return _check(_parity(**layout))


def _uneven_batch():
    # Samples 2 and 3 (= all of encoder DP rank 1's shard) and 6 have no image tokens;
    # the loss mask keeps 10%..90% of tokens per sample, so ranks hold unequal counts.
    return synthetic_batch(CFG, 8, seed=11, text_only=[2, 3, 6], uneven_mask=True)


@world.case
def test_text_only_samples_and_uneven_loss_mask():
    batch = _uneven_batch()
    counts = batch.loss_mask.view(4, 2, -1).sum(dim=(1, 2))
    assert len(set(counts.tolist())) > 1  # the unevenness the case relies on
    return _check(_parity(**FAN_IN_CP2, batch=batch))


# ------------------------------------------------------------------ teeth
@world.case
def test_oracle_catches_a_local_loss_denominator():
    # Normalize by this rank's token count instead of the global one.
    original = parts_module.masked_mean
    parts_module.masked_mean = lambda values, mask, *, group=None: original(values, mask)
    try:
        report = _parity(**FAN_IN_CP2, batch=_uneven_batch())
    finally:
        parts_module.masked_mean = original
    # Far past the bounds the parity cases apply (100x LOSS_RTOL, 10x WEIGHT_RTOL).
    assert report.loss_max_rel > 100 * LOSS_RTOL, report
    assert report.weight_max_rel > 10 * WEIGHT_RTOL, report


@world.case
def test_oracle_catches_a_skipped_bridge_cp_all_reduce():
    # The bridge's backward must sum the CP ranks' zero-padded gradients; skip that sum.
    original = bridge_module._cp_all_reduce
    bridge_module._cp_all_reduce = lambda grad, cp_group: grad
    try:
        report = _parity(**FAN_IN_CP2)
    finally:
        bridge_module._cp_all_reduce = original
    # The forward is untouched (step-0 loss agrees); gradients and weights do not.
    assert abs(report.dist_losses[0] - report.ref_losses[0]) <= LOSS_RTOL * report.ref_losses[0]
    # Far past the bounds the parity cases apply (1000x GRAD_RTOL, 10x WEIGHT_RTOL).
    assert report.input_grad_max_rel > 1000 * GRAD_RTOL, report
    assert report.weight_max_rel > 10 * WEIGHT_RTOL, report


def _parity_with_buckets(edit):
    """``FAN_IN_CP2`` parity with ``gradient_buckets`` replaced by ``edit(model, buckets)``."""
    original = ColocatedMimoModel.gradient_buckets
    ColocatedMimoModel.gradient_buckets = lambda self: edit(self, original(self))
    try:
        return _parity(**FAN_IN_CP2)
    finally:
        ColocatedMimoModel.gradient_buckets = original


@world.case
def test_oracle_catches_a_skipped_encoder_dp_gradient_sync():
    # Drop the encoder/projection bucket from the gradient sync: each encoder DP replica
    # then steps with its own shard's gradient only. Loss and input grad of step 1 agree.
    report = _parity_with_buckets(
        lambda model, buckets: [(g, ps) for g, ps in buckets if g is not model.encoder_dp_group]
    )
    assert report.worst_param_grad.startswith(("encoder.", "projection.")), report
    step1 = abs(report.dist_losses[0] - report.ref_losses[0])
    assert step1 <= LOSS_RTOL * report.ref_losses[0], report  # the first forward is untouched
    # Far past the bounds the parity cases apply (1000x GRAD_RTOL, 10x WEIGHT_RTOL).
    assert report.param_grad_max_rel > 1000 * GRAD_RTOL, report
    assert report.weight_max_rel > 10 * WEIGHT_RTOL, report


@world.case
def test_oracle_catches_a_gradient_summed_over_one_group_too_many():
    # Also sum the LLM's norm gradients over TP (as if they were sequence-parallel):
    # they are TP-replicated without SP, so they come out tp = 2 times too large.
    report = _parity_with_buckets(
        lambda model, buckets: [
            *buckets,
            (model.llm.tp_group, [p for p in model.llm.parameters() if p.dim() == 1]),
        ]
    )
    # Adam's update barely changes under a 2x gradient; the first-step gradient check does.
    assert report.worst_param_grad.startswith("llm."), report
    assert report.param_grad_max_rel > 0.5, report  # a 2x gradient: rel 1, >> GRAD_RTOL


# ------------------------------------------------------------- image agreement
def _built():
    torch.manual_seed(0)
    reference = ReferenceMimo(CFG).to(current_device())
    enc = make_grid(tp=2, dp=4, create=("tp", "dp"))
    llm = make_grid(tp=2, cp=2, dp=2, create=("tp", "cp", "dp", ("dp", "cp")))
    return reference, enc, llm, build_colocated_mimo(reference, enc, llm, device=current_device())


@world.case
def test_text_only_step_matches_reference_and_skips_encoder():
    check_text_only_step(*_built())


def check_text_only_step(reference, enc, llm, model) -> None:
    """A text-only step on the fan_in_cp2 layout equals the reference and leaves the
    encoder without gradients (shared by the gather and routed flows); destroys the model."""
    try:
        batch = synthetic_batch(CFG, 8, seed=5, text_only=range(8)).to(current_device())
        d = dist.get_rank() // 4  # LLM dp coordinate: rank = tp + 2 * (cp + 2 * dp)
        rows = slice(4 * d, 4 * d + 4)
        loss = model(batch.input_ids[rows], batch.labels[rows], batch.loss_mask[rows], None)
        loss.backward()
        model.sync_gradients()
        expected = reference(batch.input_ids, batch.labels, batch.loss_mask, None)
        # Same rounding argument as the parity cases.
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=LOSS_RTOL, atol=0)
        assert all(p.grad is None for p in model.encoder.parameters())
    finally:
        destroy_colocated_mimo(model, enc, llm)


@world.case
def test_ranks_disagreeing_on_images_all_raise():
    reference, enc, llm, model = _built()
    try:
        batch = synthetic_batch(CFG, 8, seed=5).to(current_device())
        images = batch.images[:2] if dist.get_rank() != 3 else None
        rows = slice(0, 4)
        with pytest.raises(ValueError, match="ranks disagree on whether images are present"):
            model(batch.input_ids[rows], batch.labels[rows], batch.loss_mask[rows], images)
    finally:
        destroy_colocated_mimo(model, enc, llm)
