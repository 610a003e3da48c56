"""A MIMO step's inputs, parsed once at the model's door into a frozen :class:`StepInputs`.

Both models (the single-process reference and the colocated one) call
:func:`parse_step_inputs` first and pass the result inward; no stage re-validates it.
It holds the per-token tensors, the images, ``cu_seqlens`` as a CPU int64 tensor (packed
text) and the placeholder count of every sample, computed once (every later stage that
needs counts reads them from here).

Layouts: plain text ``[b, S]`` rows; packed text 1-D ``[T]`` (``[1, T]`` accepted) with
``cu_seqlens = [0, l0, l0+l1, ..., T]`` (document ``i`` is sample ``i``). Images uniform
``[b_img, p, patch_dim]``, :class:`RaggedImages` or ``None``. ``b_img`` is the text's
``b`` in one process; in the colocated model the images are the encoder DP shard, whose
samples differ from the text's (LLM DP shard), so only the single-process door compares
them (``images_of_text=True``).

Pure torch, no collectives; every fault is a ``ValueError``/``TypeError`` naming the
argument, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_bridge.checks import check_int, check_tensor
from mp_bridge.comm import PaddedLayout
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.packed import check_cu_seqlens, placeholder_counts

__all__ = [
    "IGNORE_INDEX",
    "BatchSpec",
    "StepInputs",
    "check_image_batch",
    "check_placeholders",
    "image_output_counts",
    "packed_tokens",
    "parse_step_inputs",
]

#: The LLM's cross-entropy ``ignore_index``: labels may hold it.
IGNORE_INDEX = -100

Images = torch.Tensor | RaggedImages


@dataclass(frozen=True)
class BatchSpec:
    """What a well-formed batch of a model looks like (sizes from its config).

    ``num_patches``: the encoder's input tokens per image; ``image_placeholders``: the
    embeddings it emits per image (``None``: ``num_patches``; see :class:`MimoConfig`);
    ``fixed_image_size``: every ragged image must hold exactly ``num_patches`` tokens."""

    vocab_size: int
    image_token_id: int
    num_patches: int
    patch_dim: int
    image_placeholders: int | None = None
    fixed_image_size: bool = False

    def __post_init__(self) -> None:
        if self.image_placeholders is None:
            object.__setattr__(self, "image_placeholders", self.num_patches)
        for name in ("vocab_size", "num_patches", "patch_dim", "image_placeholders"):
            check_int(f"BatchSpec.{name}", getattr(self, name), low=1)
        check_int(
            "image_token_id", self.image_token_id, low=0, high=self.vocab_size - 1,
            fix="use the id of the image placeholder token, inside the LLM vocab",
        )  # fmt: skip

    @classmethod
    def of(cls, cfg: MimoConfig, image_token_id: int | None = None) -> BatchSpec:
        """The spec of ``cfg`` (``image_token_id`` defaults to the config's)."""
        token = cfg.image_token_id if image_token_id is None else image_token_id
        return cls(
            cfg.vocab_size, token, cfg.num_patches, cfg.patch_dim, cfg.placeholders_per_image,
            cfg.fixed_image_size,
        )  # fmt: skip


@dataclass(frozen=True)
class StepInputs:
    """One step's parsed inputs (see the module docstring).

    - ``input_ids``, ``labels``, ``loss_mask``: ``[b, S]``, or packed ``[T]``;
    - ``images``: as given (``None``: a text-only step);
    - ``cu_seqlens``: CPU int64 ``[b + 1]`` (packed) or ``None``;
    - ``placeholders``: int64 ``[b]`` image placeholders per sample (per row, or per
      packed document), on ``input_ids.device``;
    - ``image_token_id``: the placeholder id they were counted with;
    - ``documents``: packed, the parsed documents (``PaddedLayout.of_documents``), which
      ``PartitionAdapter.shard(cu_seqlens=...)`` pads without parsing again; else ``None``;
    - ``image_counts``: ragged images, the encoder's output tokens per sample of
      ``images`` (:func:`image_output_counts`); else ``None``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    images: Images | None
    cu_seqlens: torch.Tensor | None
    placeholders: torch.Tensor
    image_token_id: int
    documents: PaddedLayout | None = None
    image_counts: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def has_images(self) -> bool:
        return self.images is not None

    @property
    def ragged(self) -> bool:
        return isinstance(self.images, RaggedImages)

    @property
    def image_mask(self) -> torch.Tensor:
        """Bool, the shape of ``input_ids``: True at the image placeholders."""
        return self.input_ids == self.image_token_id


def packed_tokens(t: object) -> object:
    """A packed per-token tensor given as ``[1, T]`` -> ``[T]``; anything else unchanged
    (the parse then judges it)."""
    if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 1:
        return t.reshape(-1)
    return t


def parse_step_inputs(
    input_ids: object,
    labels: object,
    loss_mask: object,
    images: object,
    cu_seqlens: object,
    spec: BatchSpec,
    *,
    images_of_text: bool,
    dp_sizes: tuple[int, int] | None = None,
) -> StepInputs:
    """Validate one step's inputs once and return them parsed (local checks only).

    Checks: tensor types and shapes (plain ``[b, S]``, packed ``[T]``), ``cu_seqlens``
    (1-D ints from 0, non-decreasing, ending at ``T``), ids in ``[0, vocab)`` and labels
    too (or ``IGNORE_INDEX``), images' kind and shape, at most ``num_patches``
    placeholders per sample for uniform images. ``images_of_text``: the images are of
    the text's samples (one process), so ragged counts must equal the placeholders and
    the uniform batch size the text's. ``dp_sizes``: ``(encoder dp, llm dp)`` of a
    colocated model, whose images are this rank's encoder DP block of the global batch
    (``b_text · llm_dp / encoder_dp`` samples, :func:`check_image_batch`).
    """
    if cu_seqlens is not None:
        input_ids, labels, loss_mask = map(packed_tokens, (input_ids, labels, loss_mask))
    for name, t in (("input_ids", input_ids), ("labels", labels), ("loss_mask", loss_mask)):
        check_tensor(name, t)
    packed = cu_seqlens is not None
    if packed and input_ids.dim() != 1:
        raise ValueError(
            f"packed input_ids (cu_seqlens given) must be [T] or [1, T]; got "
            f"{tuple(input_ids.shape)}; concatenate this rank's documents, or pass "
            "cu_seqlens=None for [batch, seq] rows"
        )
    if not packed and input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, seq]; got {tuple(input_ids.shape)}; pass this "
            "rank's LLM DP shard of full sequences (packed [T] documents need cu_seqlens)"
        )
    if isinstance(cu_seqlens, torch.Tensor):  # bool bounds would read as 0/1 lengths
        check_tensor("cu_seqlens", cu_seqlens, dtype="int", fix="e.g. torch.tensor([0, 5, 8])")
    cu = check_cu_seqlens(cu_seqlens, input_ids.shape[0]) if packed else None
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}; give one value per token"
            )
    check_tensor("input_ids", input_ids, dtype="int", fix="pass token ids (torch.long)")
    check_tensor("labels", labels, dtype="int", fix="pass token ids (torch.long)")
    _check_ids(input_ids, labels, spec.vocab_size)
    placeholders = placeholder_counts(input_ids, spec.image_token_id, cu)
    _check_images(images, placeholders, spec, images_of_text, packed)
    if images is not None and dp_sizes is not None and not images_of_text:
        check_image_batch(images, placeholders.shape[0], *dp_sizes, packed=packed)
    docs = None if cu is None else PaddedLayout.of_documents(cu.tolist())  # parsed: no 2nd parse
    counts = image_output_counts(images, spec) if isinstance(images, RaggedImages) else None
    return StepInputs(
        input_ids, labels, loss_mask, images, cu, placeholders, spec.image_token_id, docs, counts
    )


def _check_ids(input_ids: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> None:
    for name, t, extra in (("input_ids", input_ids, None), ("labels", labels, IGNORE_INDEX)):
        bad = (t < 0) | (t >= vocab_size)
        if extra is not None:
            bad &= t != extra
        if bool(bad.any()):  # host sync: a bad id would fail later inside a collective
            allowed = f" or {extra} (ignored)" if extra is not None else ""
            raise ValueError(
                f"{name} holds {int(t[bad].flatten()[0])}, outside [0, {vocab_size}){allowed}; "
                "fix the batch or the vocab size"
            )


def _check_images(
    images: object, placeholders: torch.Tensor, spec: BatchSpec, of_text: bool, packed: bool
) -> None:
    sample = "document" if packed else "sample"
    if isinstance(images, RaggedImages):
        if images.tokens.shape[-1] != spec.patch_dim:
            raise ValueError(
                f"images.tokens has shape {tuple(images.tokens.shape)}; expected [T, "
                f"patch_dim={spec.patch_dim}]"
            )
        if spec.fixed_image_size and bool((images.tokens_per_image != spec.num_patches).any()):
            raise ValueError(
                f"images.tokens_per_image={images.tokens_per_image.tolist()} but this encoder "
                f"(learned positions / class token) takes exactly num_patches="
                f"{spec.num_patches} tokens per image; resize the images"
            )
        if of_text:
            check_placeholders(placeholders, image_output_counts(images, spec), spec.image_token_id)
        return
    if images is None:
        return
    if not isinstance(images, torch.Tensor):
        raise TypeError(
            f"images must be a torch.Tensor, RaggedImages or None, got {type(images).__name__}"
        )
    over = (placeholders > spec.image_placeholders).nonzero()
    if over.numel():
        i = int(over[0, 0])
        where = f"{sample} {i} of the packed batch" if packed else f"sample {i}"
        raise ValueError(
            f"{where} has {int(placeholders[i])} image tokens "
            f"(image_token_id={spec.image_token_id}) but its image yields only "
            f"{spec.image_placeholders} embeddings; use at most that many placeholders per {sample}"
        )
    if images.dim() != 3 or images.shape[1] != spec.num_patches:
        raise ValueError(
            f"images has shape {tuple(images.shape)}; expected [batch, "
            f"num_patches={spec.num_patches}, patch_dim={spec.patch_dim}] or RaggedImages"
        )
    if of_text and images.shape[0] != placeholders.shape[0]:
        raise ValueError(
            f"images has {images.shape[0]} samples but the text has {placeholders.shape[0]} "
            f"{sample}s; give one image per {sample} ({sample} i takes image i)"
        )


def image_output_counts(images: RaggedImages, spec: BatchSpec) -> torch.Tensor:
    """``[b]`` int64: the encoder's output tokens per sample of ragged ``images``, i.e.
    the placeholders each sample must hold. Each image of ``t`` input tokens yields
    ``t + image_placeholders - num_patches`` (the tiny model: ``t``; CLIP with the class
    token kept, ``"full"``: ``t + 1``; SigLIP ``"default"``: ``t - 1``)."""
    extra = spec.image_placeholders - spec.num_patches
    return images.tokens_per_sample + extra * images.images_per_sample


def check_image_batch(
    images: Images, text_samples: int, encoder_dp: int, llm_dp: int, *, packed: bool = False
) -> None:
    """``ValueError`` naming ``images`` unless they hold this rank's encoder DP block.

    The global batch (``text_samples · llm_dp``: the LLM DP blocks) splits over the
    encoder DP ranks in equal contiguous blocks, so the encoder batch holds
    ``text_samples · llm_dp / encoder_dp`` samples (ragged: ``tokens_per_sample`` entries).
    E.g. encoder dp 4, LLM dp 2, 4 text samples: 2 images. Local: no collective.
    """
    sample = "document" if packed else "sample"
    n = len(images.tokens_per_sample) if isinstance(images, RaggedImages) else images.shape[0]
    total = text_samples * llm_dp
    want = total // encoder_dp
    if total % encoder_dp == 0 and n == want:
        return
    head = (
        f"images holds {n} {sample}s (images.tokens_per_sample entries)"
        if isinstance(images, RaggedImages)
        else f"images has {n} {sample}s (shape {tuple(images.shape)})"
    )
    if total % encoder_dp:
        raise ValueError(
            f"{head} but the global batch of {total} {sample}s ({text_samples} in input_ids "
            f"x llm dp {llm_dp}) does not split over encoder dp {encoder_dp}; pass a global "
            f"batch divisible by {encoder_dp} (input_ids and images)"
        )
    raise ValueError(
        f"{head} but this rank's encoder DP batch holds {want}: the global batch of {total} "
        f"{sample}s ({text_samples} in input_ids x llm dp {llm_dp}) splits over encoder dp "
        f"{encoder_dp} in equal blocks; pass this rank's encoder DP block of images, {want} "
        f"{sample}s (one image per {sample})"
    )


def check_placeholders(
    placeholders: torch.Tensor, tokens_per_sample: torch.Tensor, image_token_id: int
) -> None:
    """``ValueError`` naming ``images`` unless sample ``i`` holds exactly
    ``tokens_per_sample[i]`` placeholders (ragged images of the text's samples)."""
    have = placeholders.cpu().to(torch.int64)
    want = torch.as_tensor(tokens_per_sample).cpu().to(torch.int64)
    if have.shape != want.shape or not torch.equal(have, want):
        raise ValueError(
            f"input_ids hold {have.tolist()} image tokens (image_token_id={image_token_id}) "
            f"per sample but images.tokens_per_sample={want.tolist()}; give sample i one "
            "placeholder per token of its images (images: RaggedImages of these samples, "
            "in sample order)"
        )
