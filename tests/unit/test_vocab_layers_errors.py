"""Bad input to the vocab-parallel layers raises a clear error (single process, no group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mp_bridge.comm import deterministic_all_reduce
from mp_bridge.layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    masked_mean,
    masked_sum,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)

LOGITS = torch.randn(2, 3, 10)
TARGET = torch.randint(0, 10, (2, 3))


def test_target_shape_mismatch():
    with pytest.raises(ValueError, match=r"target shape \(2, 4\) must equal .* \(2, 3\)"):
        vocab_parallel_cross_entropy(LOGITS, torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("bad", [TARGET.float(), TARGET.bool()])
def test_target_dtype(bad):
    with pytest.raises(TypeError, match="target must hold integer class ids"):
        vocab_parallel_cross_entropy(LOGITS, bad)
    with pytest.raises(TypeError, match="target must hold integer class ids"):
        vocab_parallel_logprobs(LOGITS, bad)


def test_vocab_size_larger_than_padded_vocab():
    with pytest.raises(ValueError, match=r"vocab_size=11 must be in \[1, 10\].*padded vocab 10"):
        vocab_parallel_cross_entropy(LOGITS, TARGET, vocab_size=11)
    with pytest.raises(ValueError, match=r"vocab_size=0 must be in \[1, 10\]"):
        vocab_parallel_entropy(LOGITS, vocab_size=0)


def test_target_out_of_range_and_padding_ids():
    t = TARGET.clone()
    t[1, 1] = 9
    with pytest.raises(ValueError, match=r"target holds id 9 outside \[0, 9\) or ignore_index"):
        vocab_parallel_cross_entropy(LOGITS, t, vocab_size=9)
    t[1, 1] = -100
    with pytest.raises(ValueError, match=r"target holds id -100 outside \[0, 10\); fix the labels"):
        vocab_parallel_logprobs(LOGITS, t, ignore_index=None)


def test_bad_smoothing_temperature_and_logits():
    with pytest.raises(ValueError, match=r"label_smoothing=1.5 must be a float in \[0.0, 1.0\]"):
        vocab_parallel_cross_entropy(LOGITS, TARGET, label_smoothing=1.5)
    with pytest.raises(ValueError, match="temperature=0.0 must be a finite float > 0"):
        vocab_parallel_logprobs(LOGITS, TARGET, temperature=0.0)
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        vocab_parallel_entropy(TARGET)


def test_single_process_matches_torch_with_padding():
    # tp_group=None: one process holding the whole (padded) vocab; the last two columns are
    # padding. fp64 so the comparison is to ~1e-12.
    z = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 9, -100, 5])
    got = vocab_parallel_cross_entropy(z, t, vocab_size=10, label_smoothing=0.2)
    want = F.cross_entropy(z[:, :10], t, label_smoothing=0.2, reduction="none")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_cross_entropy(x, t, vocab_size=10, label_smoothing=0.2), (z,)
    )
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_entropy(x, vocab_size=10), (z,))


def test_embedding_errors():
    emb = VocabParallelEmbedding(10, 4)
    with pytest.raises(ValueError, match=r"ids hold 10, outside \[0, 10\)"):
        emb(torch.tensor([1, 10]))
    with pytest.raises(TypeError, match="ids has dtype torch.float32, expected an integer"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="num_embeddings=0 must be an int >= 1"):
        VocabParallelEmbedding(0, 4)
    with pytest.raises(ValueError, match=r"weight must be a \[V, H\] tensor"):
        VocabParallelEmbedding.from_full(torch.zeros(10), tp_group=None)


def test_lm_head_errors():
    head = VocabParallelLMHead(4, 10)
    with pytest.raises(ValueError, match=r"h must be \[..., 4\] \(hidden_size\), got \(2, 5\)"):
        head(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="tie_to must be a VocabParallelEmbedding"):
        VocabParallelLMHead(4, 10, tie_to=head)
    with pytest.raises(ValueError, match="differ from this head"):
        VocabParallelLMHead(4, 11, tie_to=VocabParallelEmbedding(10, 4))
    with pytest.raises(ValueError, match=r"bias must be a \[V\] = \[10\] tensor"):
        VocabParallelLMHead.from_full(torch.zeros(10, 4), torch.zeros(9), tp_group=None)


def test_masked_reduction_errors():
    with pytest.raises(ValueError, match=r"mask shape \(3,\) must equal values shape \(2,\)"):
        masked_mean(torch.zeros(2), torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="values has dtype torch.int64, expected a floating"):
        masked_sum(torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="group must be None, a ProcessGroup or a list of them"):
        masked_sum(torch.zeros(2), torch.ones(2, dtype=torch.bool), group="dp")


def test_deterministic_all_reduce_errors():
    with pytest.raises(ValueError, match=r"op='prod' is not supported"):
        deterministic_all_reduce(torch.ones(2), op="prod")
    with pytest.raises(TypeError, match="must be real floating or integer"):
        deterministic_all_reduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="accumulate_dtype must be a floating torch.dtype"):
        deterministic_all_reduce(torch.ones(2), accumulate_dtype=torch.int32)
