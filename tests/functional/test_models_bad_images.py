"""A colocated step whose ``images`` batch is wrong on every rank fails at the door, before
the step's collectives, with a message naming ``images`` (2 ranks).

Encoder ``dp=2`` -> LLM ``tp=2`` (FAN_IN k = 2): each rank's text is the whole global
batch of 4 samples and its images the encoder DP block of 2. A new user passing all 4
images on both ranks gets, on every rank, the agreement error carrying each rank's own
``ValueError`` (no bridge or loss collective runs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import AgreementError
from mp_bridge.grid import make_grid
from mp_bridge.models import (
    MimoConfig,
    RaggedImages,
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
    synthetic_batch,
)
from mp_bridge.testing import CollectiveCounter, DistributedWorld

world = DistributedWorld(2, timeout_s=180, abort_grace_s=15)


@world.case
def test_the_whole_images_batch_on_every_rank_is_named():
    cfg = MimoConfig()
    torch.manual_seed(0)
    enc = make_grid(tp=1, dp=2, create=("tp", "dp"))
    llm = make_grid(tp=2, cp=1, dp=1, create=("tp", "cp", "dp", ("dp", "cp")))
    model = build_colocated_mimo(ReferenceMimo(cfg), enc, llm)
    try:
        batch = synthetic_batch(cfg, 4, seed=5)
        text = (batch.input_ids, batch.labels, batch.loss_mask)
        match = (
            r"rank 0 rejected its input: ValueError: images has 4 samples \(shape \(4, .*\) "
            r"but this rank's encoder DP batch holds 2: the global batch of 4 samples \(4 in "
            r"input_ids x llm dp 1\) splits over encoder dp 2 .*pass this rank's encoder DP "
            r"block of images, 2 samples"
        )
        with CollectiveCounter() as counter, pytest.raises(AgreementError, match=match):
            model(*text, batch.images)  # every image on every rank: wrong everywhere
        assert counter.calls == []  # only the door's agreement exchange ran
        p = cfg.num_patches
        ragged = RaggedImages(
            batch.images[:3].reshape(3 * p, -1), torch.tensor([p] * 3), torch.tensor([1] * 3)
        )
        with pytest.raises(AgreementError, match=r"images holds 3 samples \(images.tokens_per"):
            model(*text, ragged)
        rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
        assert torch.isfinite(model(*text, batch.images[rows]))  # the right block runs
    finally:
        destroy_colocated_mimo(model, enc, llm)
