"""The colocated MIMO model on ragged batches, 8 ranks, against the single-process model.

Same layouts, steps (3 Adam steps) and tolerances as ``test_models_oracle`` (see its
docstring for the rounding argument behind each bound); only the batch differs: every
sample holds 0..3 images of 1..4 tokens (:class:`RaggedImages`), so the encoder runs on
flat ``[T, patch_dim]`` tokens with attention inside each image, the bridge is
``communicate_ragged`` and each sample's tokens land at its own placeholders. The batch
(literal counts asserted below) has text-only samples, an encoder DP shard with no image
token at all (samples 2 and 3: encoder rank 1 of dp 4, ranks 2 and 3 of dp 8; LLM ranks
2 and 3 of dp 8) and an uneven loss mask. The encoder input gradient is compared per
token. Measured on gloo (max over the 7 layouts): loss rel 2e-7, input grad 7e-7, param
grad 1.1e-6, weights 7e-6 — the same rounding levels as the uniform suite. Run on 8 GPUs:
``MP_BRIDGE_BACKEND=nccl torchrun --nproc-per-node 8 -m pytest
tests/functional/test_models_oracle_ragged.py``.
"""

from __future__ import annotations

from mp_bridge.models import GatherFlow, synthetic_batch
from mp_bridge.testing import DistributedWorld
from tests.functional.test_models_oracle import (
    CFG,
    FAN_IN_CP2,
    GRAD_RTOL,
    LAYOUTS,
    LOSS_RTOL,
    WEIGHT_RTOL,
    _check,
    _parity,
)

world = DistributedWorld(8)


def _ragged_batch():
    return synthetic_batch(
        CFG, 8, seed=4, images_per_sample=(0, 3), text_only=[2, 3], uneven_mask=True
    )


def test_ragged_batch_is_what_the_cases_rely_on():
    # Device-independent: the seeded CPU draw, checked in the pytest process (no rank;
    # CUDA here would break ranks forked later). World cases move batches to the device.
    batch = _ragged_batch()
    # Written out from the seeded draw: 0..3 images per sample, 1..4 tokens per image.
    assert batch.images.images_per_sample.tolist() == [2, 2, 0, 0, 1, 0, 1, 3]
    assert batch.tokens_per_sample.tolist() == [5, 8, 0, 0, 4, 0, 4, 6]
    assert (batch.input_ids == CFG.image_token_id).sum(dim=1).tolist() == [5, 8, 0, 0, 4, 0, 4, 6]


@world.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_ragged_parity_with_one_process(layout):
    return _check(_parity(**layout, batch=_ragged_batch()))


@world.case
def test_ragged_oracle_catches_tokens_placed_in_the_wrong_order():
    # A ragged bridge that delivers the right counts but its tokens in reverse order
    # (the kind of slot/offset mix-up the ragged exchange could make).
    original = GatherFlow.bridge_images

    def reversed_tokens(self, parts, image, images):
        y, counts = original(self, parts, image, images)
        return (y.flip(0), counts) if counts is not None else (y, counts)

    GatherFlow.bridge_images = reversed_tokens
    try:
        report = _parity(**FAN_IN_CP2, batch=_ragged_batch())
    finally:
        GatherFlow.bridge_images = original
    # Far past the bounds the parity cases apply. The image tokens are a small part of
    # this tiny model's input, so the loss moves least (measured 5e-4 = 50x LOSS_RTOL);
    # the encoder gradients see the misplacement fully (measured rel 0.5 and 1.6).
    assert report.loss_max_rel > 10 * LOSS_RTOL, report
    assert report.input_grad_max_rel > 1000 * GRAD_RTOL, report
    assert report.param_grad_max_rel > 1000 * GRAD_RTOL, report
    assert report.weight_max_rel > 10 * WEIGHT_RTOL, report
    return {"loss_rel": report.loss_max_rel, "weight_rel": report.weight_max_rel}
