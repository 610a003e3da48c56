"""The pipelined LLM (``TPLLMStage`` stages run by ``LLMPipeline`` under
``torch.distributed.pipelining``) on 8 ranks against the same ``ReferenceLLM`` in one
process: loss, leaf (image-row) gradients, parameter gradients, weights after 3 Adam steps
(``tests/functional/pipeline_oracle.py``).

Tolerances are those of ``test_models_oracle`` (see its docstring), for the same reason:
the pipelined run computes the same fp32 math in another summation order (TP-split
matmuls, K/V gathered over CP, per-microbatch partial sums added in schedule order and
all-reduced over DP x CP), which moves O(1) values by a few ulps; splitting the layers
over stages adds no arithmetic at all (activations cross a stage boundary bit for bit).
loss and gradients ``rel <= 1e-5`` (measured below 1e-6), weights after 3 Adam steps
``rel <= 1e-4`` (Adam's division by sqrt(v) turns a ~1e-7 gradient error into the same
relative update error). A dropped or repeated microbatch moves every metric by far more
than its tolerance (the teeth case checks that it does).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mp_bridge.checks import AgreementError
from mp_bridge.models import MimoConfig
from mp_bridge.models.parallel import LLMPipeline, TPLLMStage
from mp_bridge.testing import DistributedWorld, current_device
from tests.functional.pipeline_oracle import run_pipeline_parity

world = DistributedWorld(8, timeout_s=900)
CFG = MimoConfig(llm_layers=4)  # one block per stage at pp = 4
LOSS_RTOL = GRAD_RTOL = 1e-5
WEIGHT_RTOL = 1e-4

TP2_PP2_DP2 = dict(tp=2, pp=2, dp=2)
TP1_CP2_PP2_DP2 = dict(tp=1, cp=2, pp=2, dp=2)
TP2_PP4_DP1 = dict(tp=2, pp=4, dp=1)

CASES = {
    "tp2pp2dp2-M1": dict(TP2_PP2_DP2, microbatches=1),
    "tp2pp2dp2-M2": dict(TP2_PP2_DP2, microbatches=2),
    "tp2pp2dp2-M4": dict(TP2_PP2_DP2, microbatches=4),
    "tp2pp2dp2-M4-sp": dict(TP2_PP2_DP2, microbatches=4, sequence_parallel=True),
    "tp1cp2pp2dp2-M1": dict(TP1_CP2_PP2_DP2, microbatches=1),
    "tp1cp2pp2dp2-M2": dict(TP1_CP2_PP2_DP2, microbatches=2),
    "tp1cp2pp2dp2-M4": dict(TP1_CP2_PP2_DP2, microbatches=4),
    "tp2pp4dp1-M1": dict(TP2_PP4_DP1, microbatches=1),
    "tp2pp4dp1-M2-sp": dict(TP2_PP4_DP1, microbatches=2, sequence_parallel=True),
    "tp2pp4dp1-M4": dict(TP2_PP4_DP1, microbatches=4),
    "packed-tp1cp2pp2dp2-M2": dict(TP1_CP2_PP2_DP2, microbatches=2, packed=True),
    "packed-tp2pp2dp2-M4-sp": dict(
        TP2_PP2_DP2, microbatches=4, sequence_parallel=True, packed=True
    ),  # fmt: skip
}


@world.parametrize("case", list(CASES), ids=list(CASES))
def test_pipelined_llm_matches_one_process(case):
    r = run_pipeline_parity(CFG, **CASES[case])
    summary = f"{case}: {r}"
    assert r["trained"], summary  # equal weights of a model that did not train prove nothing
    assert r["loss"] <= LOSS_RTOL, summary
    assert r["leaf_grad"] <= GRAD_RTOL, summary
    assert r["param_grad"] <= GRAD_RTOL, summary
    assert r["weight"] <= WEIGHT_RTOL, summary
    return r


@world.case
def test_teeth_a_dropped_microbatch_fails_every_metric():
    r = run_pipeline_parity(CFG, **TP2_PP2_DP2, microbatches=4, drop_microbatch=True)
    summary = str(r)
    assert r["loss"] > LOSS_RTOL, summary
    assert r["leaf_grad"] > GRAD_RTOL, summary
    assert r["param_grad"] > GRAD_RTOL, summary
    assert r["weight"] > WEIGHT_RTOL, summary


@world.case(world_size=2)
def test_a_bad_input_on_one_stage_is_the_same_error_on_every_stage():
    os.environ["MP_BRIDGE_CHECK"] = "1"
    try:
        rank = dist.get_rank()
        pp = dist.new_group([0, 1])
        dev = current_device()
        stage = TPLLMStage(CFG, stage=rank, n_stages=2, device=dev).to(dev)
        pos = torch.arange(8, device=dev).expand(1, 8)
        bad = pos[:, :6]  # the last stage's labels do not match its positions
        with pytest.raises(
            AgreementError, match=r"rank 1 rejected its input: ValueError: labels\[0\] has shape"
        ):
            LLMPipeline(stage, pp_group=pp).step(
                1, position_ids=[pos], inputs=(lambda m: None) if rank == 0 else None,
                labels=[bad] if rank == 1 else None, loss_mask=[pos] if rank == 1 else None,
            )  # fmt: skip
        dist.destroy_process_group(pp)
    finally:
        del os.environ["MP_BRIDGE_CHECK"]
