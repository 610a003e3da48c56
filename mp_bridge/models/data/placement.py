"""Put image embeddings at the image-token positions of the text embeddings (pure torch).

Shared by the single-process reference and the distributed model so both do the same math.
Sample ``i`` with ``n_i`` image tokens (``input_ids == image_token_id``) takes the first
``n_i`` rows of its image embeddings, in order; ``n_i`` may be 0 (a text-only sample, whose
image embeddings then get a zero gradient). Example with ``P = 2`` patches and
``input_ids[i] = [5, I, I, 7]``: positions 1 and 2 get ``image[i, 0]`` and ``image[i, 1]``.

Ragged (:func:`place_image_tokens`): flat tokens ``[T, h]`` in sample order with
``tokens_per_sample`` ``[b]``; sample ``i`` must hold exactly its count of placeholders,
filled in order. Example: counts ``[2, 0, 1]``, rows ``t0 t1 t2``: sample 0's two
placeholders get ``t0, t1``, sample 2's one gets ``t2``.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_image_tokens",
    "check_ragged_image_tokens",
    "place_image_embeddings",
    "place_image_tokens",
]


def check_image_tokens(input_ids: torch.Tensor, image_token_id: int, num_patches: int) -> None:
    """Raise ``ValueError`` when a sample holds more image tokens than there are patches."""
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}; "
            "pass one row of token ids per sample"
        )
    counts = (input_ids == image_token_id).sum(dim=1)
    too_many = counts > num_patches
    if bool(too_many.any()):
        sample = int(too_many.nonzero()[0, 0])
        raise ValueError(
            f"sample {sample} has {int(counts[sample])} image tokens "
            f"(image_token_id={image_token_id}) but its image yields only {num_patches} "
            "embeddings; use at most that many placeholders per sample"
        )


def place_image_embeddings(
    text: torch.Tensor,
    image: torch.Tensor | None,
    input_ids: torch.Tensor,
    image_token_id: int,
) -> torch.Tensor:
    """``text`` [b, s, h] with image-token rows replaced by ``image`` [b, p, h] rows.

    Differentiable in both inputs: text rows at image positions get a zero gradient, and
    each image row gets the gradient of the position it landed on (zero if unused).
    ``image=None`` returns ``text`` unchanged. No collectives.
    """
    if image is None:
        return text
    if image.shape[0] != text.shape[0] or image.shape[-1] != text.shape[-1]:
        raise ValueError(
            f"image embeddings {tuple(image.shape)} do not match text embeddings "
            f"{tuple(text.shape)} in batch or hidden size; the bridge output must be the "
            "LLM's DP shard [b, patches, hidden]"
        )
    is_image = input_ids == image_token_id  # [b, s]
    # k-th image token of a sample takes patch k: a running count gives the patch index.
    slot = (is_image.cumsum(dim=1) - 1).clamp(min=0)
    index = slot.unsqueeze(-1).expand(-1, -1, text.shape[-1])
    picked = image.gather(1, index)  # [b, s, h]
    return torch.where(is_image.unsqueeze(-1), picked, text)


def check_ragged_image_tokens(
    input_ids: torch.Tensor, image_token_id: int, tokens_per_sample: torch.Tensor
) -> None:
    """Raise ``ValueError`` unless sample ``i`` holds exactly ``tokens_per_sample[i]``
    placeholders (local check; ``tokens_per_sample`` ``[b]`` on any device)."""
    counts = (input_ids == image_token_id).sum(dim=1).cpu()
    want = torch.as_tensor(tokens_per_sample).cpu()
    if counts.shape != want.shape or not torch.equal(counts, want.to(counts.dtype)):
        raise ValueError(
            f"input_ids hold {counts.tolist()} image tokens (image_token_id={image_token_id}) "
            f"per sample but the images give {want.tolist()}; put one placeholder per "
            "image token, in the samples of this batch"
        )


def place_image_tokens(
    text: torch.Tensor,
    tokens: torch.Tensor,
    input_ids: torch.Tensor,
    image_token_id: int,
) -> torch.Tensor:
    """``text`` [b, s, h] with its image-token rows replaced by ``tokens`` [T, h] in order.

    ``T`` must equal the number of placeholders in ``input_ids`` (checked by
    :func:`check_ragged_image_tokens` per sample); row-major order over ``[b, s]`` is
    sample order, so the ``j``-th placeholder of the batch takes ``tokens[j]``.
    Differentiable in both inputs (``index_copy``); no collectives.
    """
    rows = (input_ids == image_token_id).reshape(-1).nonzero().squeeze(1)
    if rows.numel() != tokens.shape[0] or tokens.shape[-1] != text.shape[-1]:
        raise ValueError(
            f"{rows.numel()} image positions of hidden {text.shape[-1]} but tokens has "
            f"shape {tuple(tokens.shape)}; the bridge output must be this LLM DP batch's "
            "image tokens [T, hidden]"
        )
    flat = text.reshape(-1, text.shape[-1]).index_copy(0, rows, tokens.to(text.dtype))
    return flat.view_as(text)
