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

from collections.abc import Callable

import torch

from mp_bridge.models.data.inputs import StepInputs, check_placeholders
from mp_bridge.models.data.packed import rows_per_document

__all__ = ["place_image_embeddings", "place_image_tokens", "place_images"]


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


def place_image_tokens(
    text: torch.Tensor,
    tokens: torch.Tensor,
    input_ids: torch.Tensor,
    image_token_id: int,
) -> torch.Tensor:
    """``text`` [b, s, h] with its image-token rows replaced by ``tokens`` [T, h] in order.

    ``T`` must equal the number of placeholders in ``input_ids`` (checked per sample by
    :func:`~mp_bridge.models.data.inputs.check_placeholders`); row-major order over
    ``[b, s]`` is sample order, so the ``j``-th placeholder of the batch takes ``tokens[j]``.
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


def place_images(
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    inputs: StepInputs,
    image: torch.Tensor | None,
    counts: torch.Tensor | None,
) -> torch.Tensor:
    """The place stage of a step: text embeddings with the image rows at the placeholders.

    ``embed_tokens``: ids ``[b, S]`` -> ``[b, S, h]``. ``image``: this batch's image
    embeddings, uniform ``[b, p, h]`` or ragged ``[T_img, h]`` with ``counts`` ``[b]`` (its
    tokens per sample), or ``None`` (text only). Returns ``[b, S, h]``, or packed
    ``[1, T, h]`` (one row; document ``i`` takes sample ``i``'s rows, uniform images its
    first ``n_i`` patch rows). Ragged counts must equal ``inputs.placeholders``.
    """
    ids = inputs.input_ids.unsqueeze(0) if inputs.packed else inputs.input_ids
    text = embed_tokens(ids)
    token = inputs.image_token_id
    if image is None:
        return text
    if counts is not None:
        check_placeholders(inputs.placeholders, counts, token)
        return place_image_tokens(text, image, ids, token)
    if not inputs.packed:
        return place_image_embeddings(text, image, ids, token)
    n = inputs.placeholders
    if image.shape[0] != n.shape[0]:
        raise ValueError(
            f"{image.shape[0]} samples of image embeddings for {n.shape[0]} packed "
            "documents; document i is sample i of this LLM DP batch"
        )
    return place_image_tokens(text, rows_per_document(image, n.to(image.device)), ids, token)
