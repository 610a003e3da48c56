"""Seeded synthetic image + text batches and their DP shards (identical on every rank).

Uniform (default): sample ``i`` holds one image of ``num_patches`` patches and ``seq_len``
tokens; an image sample has ``num_patches`` consecutive ``image_token_id`` placeholders at
a random offset. Ragged (``images_per_sample=(lo, hi)``): sample ``i`` draws ``lo..hi``
images of ``1..num_patches`` tokens each (:class:`RaggedImages`, flat tokens in sample
order), each image a run of placeholders, the runs in order at random text gaps.
``loss_mask`` is 1 on text tokens and 0 on placeholders; ``uneven_mask`` additionally
drops a different random fraction of tokens per sample, so ranks hold different counts.

Packed (``doc_lengths=[l0, l1, ...]``, one length per sample, any lengths): sample ``i``
is one document of ``l_i`` tokens, drawn like a uniform or ragged sample of that length;
the documents are concatenated into 1-D ``[T]`` ids/labels/mask with
``cu_seqlens = [0, l0, l0+l1, ...]`` (:mod:`.packed`). :meth:`MimoBatch.llm_shard` cuts
either layout into a DP rank's text (packed: its contiguous documents, ``cu_seqlens``
rebased to 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mp_bridge.checks import check_choice, check_int, check_ints, is_int
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.long_tail import long_tail_images
from mp_bridge.models.data.packed import check_cu_seqlens

__all__ = ["MimoBatch", "TextShard", "dp_shard", "synthetic_batch"]


@dataclass(frozen=True)
class TextShard:
    """One LLM DP rank's text: ``model(input_ids, labels, loss_mask, images,
    cu_seqlens=cu_seqlens)``. Plain: ``[b, S]`` rows and ``cu_seqlens=None``; packed: 1-D
    ``[T_r]`` tokens of the rank's documents and their ``cu_seqlens`` ``[b + 1]`` from 0."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None = None


@dataclass(frozen=True)
class MimoBatch:
    """Global batch: ids, labels and ``loss_mask`` ``[B, S]`` (plain) or ``[T]`` with
    ``cu_seqlens`` ``[B + 1]`` (packed: sample ``i`` is document ``i``, CPU int64);
    ``images`` uniform ``[B, p, patch_dim]`` or :class:`RaggedImages` (flat
    ``[T_img, patch_dim]`` in sample order)."""

    images: torch.Tensor | RaggedImages
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.cu_seqlens is not None:
            cu = check_cu_seqlens(self.cu_seqlens, self.input_ids.shape[-1])
            object.__setattr__(self, "cu_seqlens", cu)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def batch_size(self) -> int:
        return len(self.cu_seqlens) - 1 if self.packed else self.input_ids.shape[0]

    @property
    def doc_lengths(self) -> torch.Tensor | None:
        """``[B]`` int64 document lengths of a packed batch (``None`` when plain)."""
        return None if self.cu_seqlens is None else self.cu_seqlens.diff()

    @property
    def ragged(self) -> bool:
        return isinstance(self.images, RaggedImages)

    @property
    def image_tokens(self) -> torch.Tensor:
        """Flat ``[T, patch_dim]`` image tokens in sample order (uniform: ``B * p`` rows)."""
        return self.images.tokens if self.ragged else self.images.flatten(0, 1)

    @property
    def tokens_per_sample(self) -> torch.Tensor:
        """``[B]`` int64 image tokens per sample (uniform: ``p`` each, text-only or not)."""
        if self.ragged:
            return self.images.tokens_per_sample
        return torch.full((self.batch_size,), self.images.shape[1], dtype=torch.int64)

    def encoder_shard(self, dp_rank: int, dp_size: int) -> torch.Tensor | RaggedImages:
        """``images`` of encoder DP block ``dp_rank`` of ``dp_size`` (contiguous samples)."""
        if self.ragged:
            return self.images.shard(dp_rank, dp_size)
        return dp_shard(self.images, dp_rank, dp_size)

    def llm_shard(self, dp_rank: int, dp_size: int) -> TextShard:
        """Text of LLM DP block ``dp_rank`` of ``dp_size`` (contiguous samples; packed: the
        block's documents, ``cu_seqlens`` rebased to start at 0)."""
        if not self.packed:
            rows = (dp_shard(t, dp_rank, dp_size) for t in self.text)
            return TextShard(*rows)
        docs = dp_shard(torch.arange(self.batch_size), dp_rank, dp_size)
        first, last = int(self.cu_seqlens[docs[0]]), int(self.cu_seqlens[docs[-1] + 1])
        cu = self.cu_seqlens[int(docs[0]) : int(docs[-1]) + 2] - first
        return TextShard(*(t[first:last] for t in self.text), cu_seqlens=cu)

    @property
    def text(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.labels, self.loss_mask

    def to(self, device: torch.device) -> MimoBatch:
        """The tensors on ``device`` (``cu_seqlens`` stays on the CPU: it steers slicing)."""
        return MimoBatch(self.images.to(device), *(t.to(device) for t in self.text),
                         cu_seqlens=self.cu_seqlens)  # fmt: skip


def synthetic_batch(
    cfg: MimoConfig,
    batch_size: int,
    *,
    seed: int = 0,
    text_only: Sequence[int] = (),
    uneven_mask: bool = False,
    images_per_sample: tuple[int, int] | None = None,
    doc_lengths: Sequence[int] | None = None,
    images: str | None = None,
) -> MimoBatch:
    """A deterministic global batch; samples listed in ``text_only`` get no image tokens.

    ``images_per_sample=(lo, hi)`` makes it ragged: each sample draws ``lo..hi`` images
    (``text_only`` ones 0) of ``1..num_patches`` tokens; ``hi * num_patches`` must fit in
    ``seq_len``. ``None`` (default) keeps the uniform ``[B, num_patches, patch_dim]`` batch.
    ``doc_lengths`` (``batch_size`` ints >= 0) makes it packed: sample ``i`` is one
    document of ``doc_lengths[i]`` tokens (``seq_len`` unused), which must hold its
    images (``num_patches``; ragged ``hi * num_patches``) unless it is ``text_only``.
    ``images="long-tail"``: ragged with a heavy-tailed number of images per sample (30 %
    text-only, at most ``hi``, default ``seq_len // num_patches``) and of tokens per image
    (``1..num_patches``, :func:`~.long_tail.long_tail_images`): the skew balanced encoders
    fix. ``None`` (default): as ``images_per_sample`` says.
    """
    check_choice("images", images, [None, "long-tail"], fix="None or 'long-tail'")
    if images == "long-tail" and images_per_sample is None:
        images_per_sample = (0, max(1, cfg.seq_len // cfg.num_patches))
    long_tail = images == "long-tail"
    check_int("batch_size", batch_size, low=1)
    bad = [i for i in text_only if not 0 <= i < batch_size]
    if bad:
        raise ValueError(f"text_only={list(text_only)} has ids {bad} outside [0, {batch_size})")
    gen = torch.Generator().manual_seed(seed)
    if doc_lengths is not None:
        lengths = _check_lengths(doc_lengths, batch_size, cfg, set(text_only), images_per_sample)
        return _packed_batch(cfg, lengths, gen, set(text_only), uneven_mask, images_per_sample,
                             long_tail)  # fmt: skip
    if images_per_sample is not None:
        return _ragged_batch(cfg, batch_size, gen, set(text_only), uneven_mask, images_per_sample,
                             long_tail)  # fmt: skip
    b, s, p = batch_size, cfg.seq_len, cfg.num_patches
    images = torch.randn(b, p, cfg.patch_dim, generator=gen)
    # Text ids avoid the placeholder so only placed positions count as image tokens.
    ids, labels = _text(cfg, (b, s), gen)
    loss_mask = torch.ones(b, s)
    offsets = torch.randint(0, s - p + 1, (b,), generator=gen)
    for i in range(b):
        if i in text_only:
            continue
        start = int(offsets[i])
        ids[i, start : start + p] = cfg.image_token_id
        loss_mask[i, start : start + p] = 0.0
    return MimoBatch(images, ids, labels, _thin(loss_mask, uneven_mask, gen))


def _thin(loss_mask: torch.Tensor, uneven: bool, gen: torch.Generator) -> torch.Tensor:
    """With ``uneven``, keep a random 10%..90% of each sample's masked tokens."""
    if not uneven:
        return loss_mask
    keep = torch.rand(loss_mask.shape[0], 1, generator=gen) * 0.8 + 0.1
    return loss_mask * (torch.rand(loss_mask.shape, generator=gen) < keep).float()


def _text(cfg: MimoConfig, shape: tuple[int, ...], gen: torch.Generator):
    """Random text ids (never the placeholder) and labels of ``shape``."""
    ids = torch.randint(0, cfg.vocab_size - 1, shape, generator=gen)
    ids = torch.where(ids >= cfg.image_token_id, ids + 1, ids)
    return ids, torch.randint(0, cfg.vocab_size, shape, generator=gen)


def _draw_images(gen, b: int, lo: int, hi: int, p: int, text_only, long_tail: bool):
    """``(images_per_sample [b], tokens_per_image [N])`` int64: uniform ``lo..hi`` images
    of ``1..p`` tokens, or the long tail (:func:`long_tail_images`, at most ``hi``)."""
    if not long_tail:
        n_images = torch.randint(lo, hi + 1, (b,), generator=gen)
        n_images[sorted(text_only)] = 0
        return n_images, torch.randint(1, p + 1, (int(n_images.sum()),), generator=gen)
    per_sample, sizes = long_tail_images(gen, b, max_images=hi, max_tokens=p, base=max(1, p // 2))
    kept, start = [], 0
    for i, n in enumerate(per_sample):
        kept += [] if i in text_only else sizes[start : start + n]
        start += n
    n_images = torch.tensor([0 if i in text_only else n for i, n in enumerate(per_sample)])
    return n_images.to(torch.int64), torch.tensor(kept, dtype=torch.int64)


def _ragged_batch(cfg, batch_size, gen, text_only, uneven_mask, images_per_sample, long_tail):
    lo, hi = _check_range(images_per_sample, cfg)
    b, s, p = batch_size, cfg.seq_len, cfg.num_patches
    ids, labels = _text(cfg, (b, s), gen)
    loss_mask = torch.ones(b, s)
    n_images, sizes = _draw_images(gen, b, lo, hi, p, text_only, long_tail)
    image = 0
    for i in range(b):
        mine = sizes[image : image + int(n_images[i])].tolist()
        image += len(mine)
        _place_runs(ids[i], loss_mask[i], mine, gen, cfg.image_token_id)
    tokens = torch.randn(int(sizes.sum()), cfg.patch_dim, generator=gen)
    images = RaggedImages(tokens, sizes, n_images)
    return MimoBatch(images, ids, labels, _thin(loss_mask, uneven_mask, gen))


def _place_runs(ids, loss_mask, sizes: list[int], gen, image_token_id: int) -> None:
    """Write one placeholder run per image size into one sample's ``ids``/``loss_mask``
    rows (in place), the runs in order at random text gaps."""
    s = ids.shape[0]
    # Text gaps before each image: sorted cut points split the sample's text tokens.
    cuts = torch.randint(0, s - sum(sizes) + 1, (len(sizes),), generator=gen).sort().values
    start, previous = 0, 0
    for size, cut in zip(sizes, cuts.tolist()):
        start += cut - previous
        previous = cut
        ids[start : start + size] = image_token_id
        loss_mask[start : start + size] = 0.0
        start += size


def _packed_batch(cfg, lengths, gen, text_only, uneven_mask, images_per_sample, long_tail):
    """Sample ``i`` drawn as one document of ``lengths[i]`` tokens; documents concatenated."""
    b, p = len(lengths), cfg.num_patches
    text = [_text(cfg, (n,), gen) for n in lengths]
    ids, labels = [t[0] for t in text], [t[1] for t in text]
    masks = [torch.ones(n) for n in lengths]
    if images_per_sample is None:
        images = torch.randn(b, p, cfg.patch_dim, generator=gen)
        for i, n in enumerate(lengths):
            if i not in text_only:
                start = int(torch.randint(0, n - p + 1, (1,), generator=gen))
                ids[i][start : start + p] = cfg.image_token_id
                masks[i][start : start + p] = 0.0
    else:
        lo, hi = images_per_sample
        n_images, sizes = _draw_images(gen, b, lo, hi, p, text_only, long_tail)
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), n_images.cumsum(0)]).tolist()
        for i in range(b):
            _place_runs(ids[i], masks[i], sizes[bounds[i] : bounds[i + 1]].tolist(), gen,
                        cfg.image_token_id)  # fmt: skip
        tokens = torch.randn(int(sizes.sum()), cfg.patch_dim, generator=gen)
        images = RaggedImages(tokens, sizes, n_images)
    masks = [_thin(m[None], uneven_mask, gen)[0] for m in masks]  # per document
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return MimoBatch(images, *(torch.cat(t) for t in (ids, labels, masks)), cu_seqlens=cu)


def _check_lengths(doc_lengths, batch_size, cfg, text_only, images_per_sample) -> list[int]:
    """``doc_lengths`` as ints if there is one per sample and each holds its images."""
    fix = f"give batch_size={batch_size} document lengths, one per sample"
    lengths = list(check_ints("doc_lengths", doc_lengths, low=0, fix=fix))
    if len(lengths) != batch_size:
        raise ValueError(
            f"doc_lengths={lengths!r} must hold batch_size={batch_size} ints >= 0, one "
            "document length per sample"
        )
    if images_per_sample is not None:
        _check_range(images_per_sample, cfg, packed=True)
    need = cfg.num_patches * (1 if images_per_sample is None else images_per_sample[1])
    short = [i for i, n in enumerate(lengths) if n < need and i not in text_only]
    if short:
        raise ValueError(
            f"documents {short} of doc_lengths={lengths} are shorter than the {need} "
            "placeholders their images may need; lengthen them or list them in text_only"
        )
    return lengths


def _check_range(images_per_sample, cfg: MimoConfig, *, packed: bool = False) -> tuple[int, int]:
    """``(lo, hi)`` if valid; plain batches: ``hi`` images must fit in ``seq_len``."""
    ok = (
        isinstance(images_per_sample, tuple | list)
        and len(images_per_sample) == 2
        and all(is_int(v) for v in images_per_sample)
    )
    if not ok or not 0 <= images_per_sample[0] <= images_per_sample[1]:
        raise ValueError(
            f"images_per_sample={images_per_sample!r} must be a (lo, hi) pair of ints with "
            "0 <= lo <= hi, e.g. (0, 3)"
        )
    lo, hi = images_per_sample
    if not packed and hi * cfg.num_patches > cfg.seq_len:
        raise ValueError(
            f"images_per_sample hi={hi} images of up to num_patches={cfg.num_patches} tokens "
            f"do not fit in seq_len={cfg.seq_len}; use hi <= {cfg.seq_len // cfg.num_patches}"
        )
    return lo, hi


def dp_shard(t: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Contiguous batch block ``dp_rank`` of ``dp_size`` (the bridge's data contract)."""
    check_int("dp_size", dp_size, low=1)
    check_int("dp_rank", dp_rank)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}); pass this rank's DP "
            "coordinate and the DP size"
        )
    if t.shape[0] % dp_size:
        raise ValueError(
            f"batch of {t.shape[0]} samples does not split over dp={dp_size}; use a batch "
            f"size that is a multiple of {dp_size}"
        )
    n = t.shape[0] // dp_size
    return t[dp_rank * n : (dp_rank + 1) * n]
