"""Bad inputs a new user meets, named before any collective (issue "Structure III"):
``parse_layout_spec(..., world_size=-1)`` and an encoder ``images`` batch that is not
this rank's encoder DP block (the colocated door's local check; the 2-rank model case is
``tests/functional/test_models_bad_images.py``)."""

from __future__ import annotations

import pytest
import torch

from mp_bridge.grid import parse_layout_spec
from mp_bridge.models import RaggedImages
from mp_bridge.models.data.inputs import check_image_batch


@pytest.mark.parametrize(
    "world_size, error, match",
    [
        (-1, ValueError, r"world_size=-1 must be an int >= 1; pass the number of ranks"),
        (0, ValueError, r"world_size=0 must be an int >= 1; .*or world_size=None to skip"),
        (8.0, TypeError, r"world_size must be an int, got 8.0; pass the number of ranks"),
        (True, TypeError, r"world_size must be an int, got True"),
    ],
)
def test_parse_layout_spec_names_a_bad_world_size(world_size, error, match):
    with pytest.raises(error, match=match):
        parse_layout_spec("tp=2,dp=4", world_size=world_size)
    assert parse_layout_spec("tp=2,dp=4", world_size=8).size == 8


def test_images_must_be_this_ranks_encoder_block():
    images = torch.zeros(4, 3, 2)
    check_image_batch(images[:2], 4, 2, 1)  # encoder dp 2, LLM dp 1: 2 of 4 samples
    check_image_batch(images, 2, 1, 2)  # FAN_OUT: the encoder holds both LLM blocks
    with pytest.raises(ValueError, match=r"images has 4 samples \(shape \(4, 3, 2\)\) but "
                       r"this rank's encoder DP batch holds 2: .*encoder dp 2"):  # fmt: skip
        check_image_batch(images, 4, 2, 1)
    with pytest.raises(ValueError, match=r"global batch of 3 samples .* does not split over "
                       r"encoder dp 2; pass a global batch divisible by 2"):  # fmt: skip
        check_image_batch(images[:1], 3, 2, 1)
    ragged = RaggedImages(torch.zeros(3, 2), torch.tensor([1, 2]), torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match=r"images holds 3 documents \(images.tokens_per_sample"):
        check_image_batch(ragged, 4, 2, 1, packed=True)
