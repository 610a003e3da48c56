"""The one parameter-sharding mechanism in one process (no process group).

A sharded parameter declares its ``ShardSpec`` where it is created; the layers'
``from_full`` and the models' ``load_full_state`` / ``gather_full_state`` read that
declaration. Expected tensors are written out by hand (``torch.arange`` rows and zeros).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mp_bridge.layers import (
    ShardSpec,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    load_shard_,
    mark_sharded,
    shard_spec,
)
from mp_bridge.models import TPLLM, MimoConfig, gather_full_state, load_full_state


def test_declaration_is_read_back_and_padding_rows_load_as_zeros():
    p = nn.Parameter(torch.full((6, 2), 7.0))
    assert shard_spec(p) is None  # unmarked = replicated
    assert mark_sharded(p, dim=-2, group=None, full_size=5) is p
    assert shard_spec(p) == ShardSpec(0, None, 5)  # dim normalized
    load_shard_(p, torch.arange(10.0).view(5, 2))
    assert p.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [0, 0]]


def test_vocab_layers_declare_their_own_parameters():
    emb = VocabParallelEmbedding(10, 4, multiple=4)  # V_local 12: rows 10, 11 are padding
    assert shard_spec(emb.weight) == ShardSpec(0, None, 10)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (0, 12)
    head = VocabParallelLMHead(4, 10, bias=True, multiple=4)
    assert shard_spec(head.weight) == shard_spec(head.bias) == ShardSpec(0, None, 10)
    tied = VocabParallelLMHead(4, 10, multiple=4, tie_to=emb)
    assert tied.weight is emb.weight
    # TPLLM no longer stamps the layers' weights: the declaration is the layers' own.
    llm = TPLLM(MimoConfig())
    assert shard_spec(llm.embed.weight) == ShardSpec(0, None, MimoConfig().vocab_size)


def test_from_full_and_load_full_state_read_the_same_declaration():
    full = torch.arange(40.0).view(10, 4)
    bias = torch.arange(10.0)
    head = VocabParallelLMHead.from_full(full, bias, tp_group=None, multiple=4)
    expected = torch.cat([full, torch.zeros(2, 4)])  # rows 10, 11: zero padding
    assert torch.equal(head.weight, expected)
    assert head.bias.tolist() == list(range(10)) + [0, 0]
    loaded = VocabParallelLMHead(4, 10, bias=True, multiple=4)
    load_full_state(loaded, {"weight": full, "bias": bias})
    assert torch.equal(loaded.weight, expected) and torch.equal(loaded.bias, head.bias)
    back = gather_full_state(head)
    assert torch.equal(back["weight"], full) and torch.equal(back["bias"], bias)


def test_errors_name_the_argument():
    p = nn.Parameter(torch.zeros(6, 2))
    with pytest.raises(ValueError, match=r"full_size=7 does not fit 1 shards of 6 along dim 0"):
        mark_sharded(p, dim=0, group=None, full_size=7)
    with pytest.raises(ValueError, match=r"dim=2 is out of range"):
        mark_sharded(p, dim=2, group=None, full_size=6)
    head = VocabParallelLMHead(4, 5, bias=True)
    with pytest.raises(ValueError, match=r"bias: full tensor has shape \(3,\), expected \(5,\)"):
        load_shard_(head.bias, torch.zeros(3), name="bias")
