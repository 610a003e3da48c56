"""The routed colocated step (``flow="routed"``) on 8 ranks against the single-process model.

Every oracle layout of ``test_models_oracle`` (FAN_IN / FAN_OUT / EQUAL, LLM CP 1/2/4, SP
off/on, fused loss), 3 Adam steps, the same tolerances (see that file's docstring for
the rounding argument behind each bound). The routed step shards ids/labels/masks first,
embeds only the local tokens and ``bridge.route``s each image token straight to its CP
(SP) shard, so a wrong route, a misplaced row or a gradient counted twice over TP or CP
shows in the loss, the encoder input gradient or the first-step parameter gradients.
Batches: the ragged batch of ``test_models_oracle_ragged`` (text-only samples, an encoder
DP shard without image tokens, uneven loss mask), a uniform batch (one all-gather of
placeholder counts picks the used patch rows), and a sequence length that the CP cut
must pad (15 tokens at cp 2, tp 2 with SP: padded to 16).

Packed (THD) text in both flows, at the model level: ``test_models_oracle_packed.py``;
at the communicator level: ``tests/functional/test_route.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import mp_bridge.models.colocated.routed as routed_module
from mp_bridge.grid import make_grid
from mp_bridge.models import (
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
    synthetic_batch,
)
from mp_bridge.testing import DistributedWorld, current_device
from tests.functional.test_models_oracle import (
    CFG,
    FAN_IN_CP2,
    GRAD_RTOL,
    LAYOUTS,
    LOSS_RTOL,
    _check,
    _parity,
    check_text_only_step,
)
from tests.functional.test_models_oracle_ragged import _ragged_batch

world = DistributedWorld(8)


@world.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_routed_ragged_parity_with_one_process(layout):
    return _check(_parity(**layout, batch=_ragged_batch(), flow="routed"))


@world.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_routed_uniform_parity_with_one_process(layout):
    # Samples 2, 3 and 6 have an image but no placeholder: their patch rows go unused.
    batch = synthetic_batch(CFG, 8, seed=11, text_only=[2, 3, 6], uneven_mask=True)
    return _check(_parity(**layout, batch=batch, flow="routed"))


ODD = dataclasses.replace(CFG, seq_len=15)


def test_odd_batch_is_what_the_padded_case_relies_on():
    # Device-independent: the seeded CPU draw, checked in the pytest process (no rank;
    # CUDA here would break ranks forked later). World cases move batches to the device.
    batch = synthetic_batch(ODD, 8, seed=4, images_per_sample=(0, 3))
    assert batch.input_ids.shape == (8, 15)  # 15 % (2 * cp * tp) != 0: the cut pads
    assert int((batch.input_ids == ODD.image_token_id).sum()) > 0


@world.parametrize(
    "layout",
    [FAN_IN_CP2, dict(FAN_IN_CP2, sequence_parallel=True), LAYOUTS["fan_in_8_cp4"]],
    ids=["fan_in_cp2", "fan_in_cp2_sp", "fan_in_8_cp4"],
)
def test_routed_parity_on_a_length_the_cut_pads(layout):
    from mp_bridge.models import run_parity
    from mp_bridge.testing import current_device

    batch = synthetic_batch(ODD, 8, seed=4, images_per_sample=(0, 3), uneven_mask=True)
    report = run_parity(ODD, device=current_device(), batch=batch, flow="routed", **layout)
    return _check(report)


def _routed_model():
    torch.manual_seed(0)
    reference = ReferenceMimo(CFG).to(current_device())
    enc = make_grid(tp=2, dp=4, create=("tp", "dp"))
    llm = make_grid(tp=2, cp=2, dp=2, create=("tp", "cp", "dp", ("dp", "cp")))
    model = build_colocated_mimo(
        reference, enc, llm, sequence_parallel=True, device=current_device(), flow="routed"
    )
    return reference, enc, llm, model


@world.case
def test_routed_text_only_step_matches_reference_and_skips_encoder():
    check_text_only_step(*_routed_model())


@world.parametrize("flow", ["routed", "gather"])
def test_placeholder_count_mismatch_in_one_replica_raises_on_every_rank(flow):
    # Sample 1 of LLM DP replica 0 (global sample 1) one placeholder short; replica 1
    # (ranks 4-7) is fine, yet must raise too: otherwise it would wait in the loss's
    # all-reduce for ranks that already failed. Routed: route's count check; gather: the
    # model's (both one fixed-size all-gather over every rank of the bridge).
    reference, enc, llm, model = _routed_model()
    model.flow = flow
    try:
        batch = _ragged_batch().to(current_device())
        ids = batch.input_ids.clone()
        assert int((ids[1] == CFG.image_token_id).sum()) > 0  # sample 1 has an image
        ids[1, (ids[1] == CFG.image_token_id).nonzero()[0, 0]] = 1
        d, e = dist.get_rank() // 4, dist.get_rank() // 2  # LLM / encoder dp coordinates
        rows = slice(4 * d, 4 * d + 4)
        images = batch.encoder_shard(e, 4)
        with pytest.raises(
            ValueError, match=r"sample 1 of LLM DP replica 0 has .* \(global sample 1;"
        ):
            model(ids[rows], batch.labels[rows], batch.loss_mask[rows], images)
        dist.barrier()  # every rank got here: nobody is stranded
    finally:
        destroy_colocated_mimo(model, enc, llm)


# ------------------------------------------------------------------ teeth
@world.case
def test_routed_oracle_catches_rows_placed_in_the_wrong_order():
    # Local image rows placed in reverse order (a shard-order mix-up in route or place).
    original = routed_module.place_local_rows

    def reversed_rows(text, rows, mask):
        return original(text, rows.flip(0), mask)

    routed_module.place_local_rows = reversed_rows
    try:
        report = _parity(**FAN_IN_CP2, batch=_ragged_batch(), flow="routed")
    finally:
        routed_module.place_local_rows = original
    # Far past the bounds the parity cases apply (see test_models_oracle_ragged's teeth).
    assert report.loss_max_rel > 10 * LOSS_RTOL, report
    assert report.input_grad_max_rel > 1000 * GRAD_RTOL, report
    return {"loss_rel": report.loss_max_rel, "grad_rel": report.input_grad_max_rel}


def test_flow_names_are_parsed_once_into_flow_objects():
    # Device-independent: parses names, builds no tensor (runs in the pytest process).
    from mp_bridge.models import GatherFlow, RoutedFlow, parse_flow

    assert isinstance(parse_flow("routed"), RoutedFlow)
    assert isinstance(parse_flow("gather"), GatherFlow)
    flow = RoutedFlow()
    assert parse_flow(flow) is flow
    with pytest.raises(ValueError, match=r"flow='scatter' must be one of \['gather', 'routed'\]"):
        parse_flow("scatter")
    with pytest.raises(ValueError, match="flow=None must be one of"):
        parse_flow(None)


@world.parametrize("cp_comm", ["ring", "a2a"])
def test_routed_parity_with_each_cp_attention_mode(cp_comm):
    # The LLM's attention moves K/V by a ring of send/recv steps or by Ulysses all-to-all
    # over heads; the same single-process model and tolerances as every layout above.
    layout = dict(FAN_IN_CP2, sequence_parallel=True)
    return _check(_parity(**layout, batch=_ragged_batch(), flow="routed", cp_comm=cp_comm))
