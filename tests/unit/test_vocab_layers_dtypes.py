"""Integer or mismatched-dtype weights and hidden states on the vocab layers: a TypeError
naming the argument, raised before any matmul or collective (single process, no group)."""

from __future__ import annotations

import pytest
import torch

from mp_bridge.layers import VocabParallelEmbedding, VocabParallelLMHead


def test_lm_head_rejects_integer_hidden_states():
    head = VocabParallelLMHead(4, 10)
    with pytest.raises(TypeError, match=r"h has dtype torch.int64, expected a floating dtype"):
        head(torch.zeros(2, 4, dtype=torch.long))


def test_lm_head_rejects_hidden_states_of_another_dtype():
    head = VocabParallelLMHead(4, 10)  # fp32 weight
    h = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"h has dtype torch.bfloat16 but the head's weight has"):
        head(h)
    assert head(h.float()).dtype == torch.float32  # the fix the message names works


@pytest.mark.parametrize("cls", [VocabParallelEmbedding, VocabParallelLMHead])
def test_integer_weight_dtype_is_refused(cls):
    with pytest.raises(TypeError, match=r"dtype=torch.int64 must be a floating torch.dtype"):
        cls(4, 10, dtype=torch.long)
    with pytest.raises(TypeError, match=r"weight.dtype=torch.int32 must be a floating"):
        cls.from_full(torch.zeros(10, 4, dtype=torch.int32), tp_group=None)


def test_lm_head_bias_of_another_dtype_is_refused():
    w = torch.zeros(10, 4)
    with pytest.raises(TypeError, match=r"bias has dtype torch.float64 but weight has"):
        VocabParallelLMHead.from_full(w, torch.zeros(10, dtype=torch.float64), tp_group=None)


def test_group_must_be_a_process_group():
    with pytest.raises(TypeError, match=r"tp_group=2 must be a torch.distributed ProcessGroup"):
        VocabParallelEmbedding(10, 4, tp_group=2)
