"""Packed (THD) MIMO pieces without a process group: the packed synthetic batch and its LLM
DP shard (literal lengths and bounds), the step check's packed layout, and the packed
reference against running each document alone through the plain reference."""

from __future__ import annotations

import pytest
import torch

from mp_bridge.models import MimoBatch, MimoConfig, ReferenceMimo, dp_shard, synthetic_batch
from mp_bridge.models.data.inputs import BatchSpec, parse_step_inputs
from mp_bridge.models.data.packed import check_cu_seqlens, placeholder_counts
from mp_bridge.models.reference.model import packed_causal_mask

CFG = MimoConfig()
I = CFG.image_token_id  # noqa: E741
#: Odd and even lengths, none a multiple of 2·cp for cp 2 or 4 except 12; doc 4 is short
#: (text-only), ragged images need up to 2 * 4 = 8 placeholders in the others.
LENGTHS = [9, 13, 8, 11, 3, 21, 15, 12]


def _ragged():
    return synthetic_batch(
        CFG, 8, seed=3, images_per_sample=(0, 2), text_only=[4], uneven_mask=True,
        doc_lengths=LENGTHS,
    )  # fmt: skip


def test_packed_ragged_batch_bounds_and_placeholders_per_document():
    batch = _ragged()
    assert batch.packed and batch.ragged and batch.batch_size == 8
    assert batch.cu_seqlens.tolist() == [0, 9, 22, 30, 41, 44, 65, 80, 92]
    assert batch.doc_lengths.tolist() == LENGTHS
    assert batch.input_ids.shape == batch.labels.shape == batch.loss_mask.shape == (92,)
    # Placeholders of document i (counted by slicing here) = sample i's image tokens.
    cu = batch.cu_seqlens.tolist()
    per_doc = [int((batch.input_ids[a:b] == I).sum()) for a, b in zip(cu[:-1], cu[1:])]
    assert per_doc == batch.tokens_per_sample.tolist()
    assert per_doc[4] == 0 and sum(per_doc) > 0 and len(set(per_doc)) > 2
    assert not bool((batch.loss_mask.bool() & (batch.input_ids == I)).any())
    again = _ragged()
    assert torch.equal(again.input_ids, batch.input_ids)  # seeded
    assert torch.equal(again.images.tokens, batch.images.tokens)


def test_packed_uniform_batch_holds_one_image_run_per_document():
    batch = synthetic_batch(CFG, 4, seed=1, text_only=[2], doc_lengths=[5, 4, 1, 7])
    assert batch.images.shape == (4, CFG.num_patches, CFG.patch_dim)
    cu = batch.cu_seqlens.tolist()
    assert cu == [0, 5, 9, 10, 17]
    per_doc = [int((batch.input_ids[a:b] == I).sum()) for a, b in zip(cu[:-1], cu[1:])]
    assert per_doc == [4, 4, 0, 4]
    assert placeholder_counts(batch.input_ids, I, batch.cu_seqlens).tolist() == per_doc


def test_llm_shard_of_a_packed_batch_is_its_documents_rebased():
    batch = _ragged()
    shard = batch.llm_shard(1, 4)  # documents 2 and 3: tokens 22..41
    assert shard.cu_seqlens.tolist() == [0, 8, 19]
    assert torch.equal(shard.input_ids, batch.input_ids[22:41])
    assert torch.equal(shard.labels, batch.labels[22:41])
    assert torch.equal(shard.loss_mask, batch.loss_mask[22:41])
    last = batch.llm_shard(1, 2)  # documents 4..7: tokens 41..92
    assert last.cu_seqlens.tolist() == [0, 3, 24, 39, 51]
    assert torch.equal(last.input_ids, batch.input_ids[41:])
    with pytest.raises(ValueError, match="does not split over dp=3"):
        batch.llm_shard(0, 3)


def test_llm_shard_of_a_plain_batch_is_dp_shard():
    batch = synthetic_batch(CFG, 4, seed=0)
    shard = batch.llm_shard(1, 2)
    assert shard.cu_seqlens is None
    assert torch.equal(shard.input_ids, dp_shard(batch.input_ids, 1, 2))
    assert torch.equal(shard.loss_mask, batch.loss_mask[2:4])


def test_packed_batch_checks_its_bounds():
    batch = synthetic_batch(CFG, 2, seed=1, doc_lengths=[5, 6])
    with pytest.raises(ValueError, match="ends at 10 but the packed tensors hold 11"):
        MimoBatch(batch.images, *batch.text, cu_seqlens=[0, 5, 10])
    moved = batch.to(torch.device("cpu"))
    assert moved.cu_seqlens.tolist() == [0, 5, 11] and torch.equal(moved.input_ids, batch.input_ids)


def test_packed_batch_rejects_documents_too_short_for_their_images():
    with pytest.raises(ValueError, match=r"documents \[1\] .* shorter than the 4"):
        synthetic_batch(CFG, 2, doc_lengths=[5, 3])
    with pytest.raises(ValueError, match="batch_size=2 ints"):
        synthetic_batch(CFG, 2, doc_lengths=[5])


@pytest.mark.parametrize(
    ("cu", "error", "message"),
    [
        ([1, 5, 9], ValueError, "must start at 0"),
        ([0, 6, 5, 9], ValueError, "non-decreasing"),
        ([0, 5, 8], ValueError, "ends at 8 but the packed tensors hold 9"),
        ([0.0, 9.0], TypeError, "must hold ints"),
        ("09", TypeError, "must hold ints"),
        (torch.tensor([[0, 9]]), TypeError, "1-D integer tensor"),
        (9, TypeError, "1-D integer tensor or a list of ints"),
    ],
)
def test_bad_cu_seqlens_name_the_fix(cu, error, message):
    with pytest.raises(error, match=message):
        check_cu_seqlens(cu, 9)


def _check(ids, labels, mask, images=None, cu_seqlens=None):
    spec = BatchSpec.of(CFG, I)
    return parse_step_inputs(ids, labels, mask, images, cu_seqlens, spec, images_of_text=False)


def test_parse_step_inputs_accepts_the_packed_layout_and_names_its_faults():
    batch = synthetic_batch(CFG, 2, seed=1, doc_lengths=[5, 6])
    ids, labels, mask = batch.text
    parsed = _check(ids, labels, mask, batch.images, cu_seqlens=[0, 5, 11])
    assert parsed.cu_seqlens.tolist() == [0, 5, 11] and parsed.cu_seqlens.dtype == torch.int64
    by_hand = [int((ids[:5] == I).sum()), int((ids[5:] == I).sum())]
    assert parsed.placeholders.tolist() == by_hand and parsed.packed and parsed.has_images
    # [1, T] packed tensors are accepted and flattened once at the door.
    flat = _check(ids[None], labels[None], mask[None], None, cu_seqlens=[0, 5, 11])
    assert flat.input_ids.shape == (11,) and not flat.has_images
    with pytest.raises(ValueError, match=r"packed input_ids .* must be \[T\]"):
        _check(ids.view(1, 11).repeat(2, 1), labels, mask, cu_seqlens=[0, 11])
    with pytest.raises(ValueError, match="ends at 10 but the packed tensors hold 11"):
        _check(ids, labels, mask, cu_seqlens=[0, 5, 10])
    with pytest.raises(ValueError, match=r"packed \[T\] documents need cu_seqlens"):
        _check(ids, labels, mask)
    with pytest.raises(TypeError, match="cu_seqlens has dtype torch.bool, expected an integer"):
        _check(ids, labels, mask, cu_seqlens=torch.tensor([False, True]))
    with pytest.raises(TypeError, match="input_ids has dtype torch.float32"):
        _check(ids.float(), labels, mask, cu_seqlens=[0, 5, 11])
    with pytest.raises(TypeError, match="images must be a torch.Tensor, RaggedImages or None"):
        _check(ids, labels, mask, [batch.images], cu_seqlens=[0, 5, 11])
    five = ids.clone()
    five[5], five[6:11] = 1, I  # document 1: 5 placeholders for a 4-patch image
    with pytest.raises(ValueError, match="document 1 of the packed batch has 5 image tokens"):
        _check(five, labels, mask, batch.images, cu_seqlens=batch.cu_seqlens)


def test_packed_causal_mask_by_hand():
    mask = packed_causal_mask(torch.tensor([0, 2, 3]))
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, False, True]]


# --------------------------------------------------- the packed reference, checked
def _per_document_loss(model, batch, images):
    """Each document alone, as a plain ``[1, l]`` batch with its sample's images; the
    masked mean over all documents = sum of (mean * count) / total count."""
    total, count = 0.0, 0.0
    cu = batch.cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        mine = images.shard(i, batch.batch_size) if batch.ragged else images[i : i + 1]
        ids, labels, mask = (t[a:b].unsqueeze(0) for t in batch.text)
        n = float(mask.sum())
        total = total + model(ids, labels, mask, mine) * n
        count += n
    return total / count


def _images_with_grad(batch):
    if batch.ragged:
        x = batch.images.tokens.clone().requires_grad_(True)
        return x, batch.images.with_tokens(x)
    x = batch.images.clone().requires_grad_(True)
    return x, x


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "uniform"])
def test_packed_reference_equals_each_document_run_alone(ragged):
    if ragged:
        batch = _ragged()
    else:
        batch = synthetic_batch(CFG, 4, seed=2, text_only=[1], uneven_mask=True,
                                doc_lengths=[7, 2, 11, 5])  # fmt: skip
    torch.manual_seed(0)
    model = ReferenceMimo(CFG)
    x, images = _images_with_grad(batch)
    packed = model(*batch.text, images, cu_seqlens=batch.cu_seqlens)
    packed.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    packed_x = x.grad.clone()
    model.zero_grad()
    y, images = _images_with_grad(batch)
    alone = _per_document_loss(model, batch, images)
    alone.backward()
    # fp32, the same products batched differently (one masked row vs one row per
    # document): rounding only, ~1e-7 relative; 1e-5 leaves 100x headroom, while tokens
    # attending across documents move the loss by 1.4e-3 relative (the last test).
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)
    torch.testing.assert_close(packed_x, y.grad, rtol=1e-5, atol=1e-7)
    for got, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-7)
    # [1, T] input is the same packed batch.
    again = model(*(t.unsqueeze(0) for t in batch.text), images, cu_seqlens=batch.cu_seqlens)
    torch.testing.assert_close(again, packed, rtol=0, atol=0)


def test_packed_reference_keeps_documents_apart():
    # The same tokens as one long document: later documents then see earlier ones.
    batch = _ragged()
    torch.manual_seed(0)
    model = ReferenceMimo(CFG)
    with torch.no_grad():
        packed = model(*batch.text, batch.images, cu_seqlens=batch.cu_seqlens)
        ids, labels, mask = (t.unsqueeze(0) for t in batch.text)
        # One row: all image tokens in one sample (the plain check counts per row).
        one = batch.images.with_tokens(batch.images.tokens)
        one = type(one)(one.tokens, one.tokens_per_image, one.images_per_sample.sum().view(1))
        joined = model(ids, labels, mask, one)
    # Measured 1.4e-3 relative: over 100x the 1e-5 bound of the equality test above.
    assert abs(float(packed) - float(joined)) > 100 * 1e-5 * float(packed)
