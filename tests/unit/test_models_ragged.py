"""Ragged MIMO pieces without a process group: ``RaggedImages``, the ragged synthetic batch,
ragged placement, and the reference encoder on flat tokens (literal expectations)."""

from __future__ import annotations

import pytest
import torch

from mp_bridge.models import (
    MimoConfig,
    RaggedImages,
    ReferenceMimo,
    place_image_tokens,
    synthetic_batch,
)

CFG = MimoConfig()
I = CFG.image_token_id  # noqa: E741


def _images() -> RaggedImages:
    # Samples hold 2, 0, 1, 1 images of 3+1, -, 2, 1 tokens: T = 7.
    tokens = torch.arange(7.0).unsqueeze(1).expand(7, 2).contiguous()
    return RaggedImages(tokens, torch.tensor([3, 1, 2, 1]), torch.tensor([2, 0, 1, 1]))


def test_counts_shards_and_mask_by_hand():
    images = _images()
    assert images.tokens_per_sample.tolist() == [4, 0, 2, 1]
    assert images.image_index().tolist() == [0, 0, 0, 1, 2, 2, 3]
    assert images.token_slice(1, 2) == slice(4, 7)
    shard = images.shard(1, 2)  # samples 2 and 3
    assert shard.tokens[:, 0].tolist() == [4.0, 5.0, 6.0]
    assert shard.tokens_per_image.tolist() == [2, 1]
    assert shard.images_per_sample.tolist() == [1, 1]
    empty = images.shard(1, 4)  # sample 1 alone: no image token
    assert empty.tokens.shape == (0, 2) and empty.tokens_per_sample.tolist() == [0]
    assert images.lengths() == (3, 1, 2, 1)


@pytest.mark.parametrize(
    ("sizes", "per_sample", "message"),
    [
        ([3, 0], [1, 1], "must be >= 1"),
        ([3, 1], [1, 2], "sums to 3 images"),
        ([3, 2], [1, 1], "holds 4 rows"),
        ([[3, 1]], [2], "1-D integer tensor"),
    ],
)
def test_bad_counts_name_the_fix(sizes, per_sample, message):
    with pytest.raises(ValueError, match=message):
        RaggedImages(torch.zeros(4, 2), torch.tensor(sizes), torch.tensor(per_sample))


def test_ragged_batch_places_one_run_per_image():
    batch = synthetic_batch(CFG, 16, seed=7, images_per_sample=(0, 3), text_only=[5])
    images = batch.images
    assert batch.ragged and images.num_samples == 16 and images.images_per_sample[5] == 0
    assert int(images.images_per_sample.max()) <= 3
    assert int(images.tokens_per_image.min()) >= 1
    assert int(images.tokens_per_image.max()) <= CFG.num_patches
    is_image = batch.input_ids == I
    assert is_image.sum(dim=1).tolist() == images.tokens_per_sample.tolist()
    assert not bool((batch.loss_mask.bool() & is_image).any())  # no loss on placeholders
    assert len(set(images.tokens_per_sample.tolist())) > 2  # really ragged
    again = synthetic_batch(CFG, 16, seed=7, images_per_sample=(0, 3), text_only=[5])
    assert torch.equal(again.images.tokens, images.tokens)  # seeded


def test_uniform_batch_is_the_default():
    batch = synthetic_batch(CFG, 2, seed=0)
    assert not batch.ragged and batch.images.shape == (2, CFG.num_patches, CFG.patch_dim)
    assert batch.tokens_per_sample.tolist() == [CFG.num_patches] * 2


@pytest.mark.parametrize(
    ("value", "message"),
    [((2, 1), r"0 <= lo <= hi"), ((0, 5), r"use hi <= 4"), ("03", "pair of ints")],
)
def test_bad_images_per_sample(value, message):
    with pytest.raises(ValueError, match=message):
        synthetic_batch(CFG, 2, images_per_sample=value)


def test_place_image_tokens_by_hand():
    text = torch.zeros(2, 4, 1)
    ids = torch.tensor([[5, I, I, 7], [I, 3, 3, 3]])
    tokens = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    out = place_image_tokens(text, tokens, ids, I)
    assert out[..., 0].tolist() == [[0.0, 1.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
    out.mul(torch.arange(8.0).view(2, 4, 1)).sum().backward()
    assert tokens.grad[:, 0].tolist() == [1.0, 2.0, 4.0]  # the weights of their positions
    with pytest.raises(ValueError, match="3 image positions"):
        place_image_tokens(text, tokens[:2], ids, I)


def test_reference_ragged_encoder_equals_one_pass_per_image():
    torch.manual_seed(0)
    reference = ReferenceMimo(CFG)
    images = synthetic_batch(CFG, 4, seed=2, images_per_sample=(1, 3)).images
    flat = reference.encoder(images)
    ends = torch.cumsum(images.tokens_per_image, 0).tolist()
    per_image = [
        reference.encoder(images.tokens[end - n : end].unsqueeze(0)).squeeze(0)
        for n, end in zip(images.tokens_per_image.tolist(), ends)
    ]
    # Same math per image, different batching: fp32 rounding only.
    torch.testing.assert_close(flat, torch.cat(per_image), rtol=1e-5, atol=1e-6)


def test_reference_refuses_placeholders_that_do_not_match_the_counts():
    batch = synthetic_batch(CFG, 2, seed=1, images_per_sample=(1, 2))
    ids = batch.input_ids.clone()
    ids[0, (ids[0] == I).nonzero()[0, 0]] = 3  # one placeholder fewer in sample 0
    with pytest.raises(
        ValueError,
        match=r"hold \[\d+, \d+\] image tokens .* but images.tokens_per_sample=\[\d+, \d+\]",
    ):
        ReferenceMimo(CFG)(ids, batch.labels, batch.loss_mask, batch.images)
