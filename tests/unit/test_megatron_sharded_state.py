"""The vocab layers' megatron ``sharded_state_dict`` in one process: errors and padding.

The TP / DP metadata is compared with megatron's own layers in
``tests/functional/test_megatron_sharded_state.py``; here, with no process group, the
one-process values are written out by hand (vocab 1001, ``multiple`` 8: one shard of
1008 rows, 7 of them padding).
"""

from __future__ import annotations

import pytest
import torch

from mp_bridge.layers import VocabParallelEmbedding, VocabParallelLMHead

META = {"dp_cp_group": None}


def test_one_process_metadata_is_the_padded_shard():
    head = VocabParallelLMHead(4, 1001, multiple=8, bias=True)
    sharded = head.sharded_state_dict(prefix="output_layer.", metadata=META)
    assert set(sharded) == {"output_layer.weight", "output_layer.bias"}
    weight = sharded["output_layer.weight"]
    assert (weight.key, weight.global_shape, weight.global_offset) == (
        "output_layer.weight", (1008, 4), (0, 0),
    )  # fmt: skip
    assert weight.replica_id == (0, 0, 0) and weight.allow_shape_mismatch
    assert sharded["output_layer.bias"].global_shape == (1008,)


def test_megatron_prepended_offsets_add_a_leading_axis():
    emb = VocabParallelEmbedding(1001, 4, multiple=8)
    st = emb.sharded_state_dict(sharded_offsets=((0, 2, 3),), metadata=META)["weight"]
    assert (st.global_shape, st.global_offset, st.prepend_axis_num) == ((3, 1008, 4), (2, 0, 0), 1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({}, ValueError, r"metadata=None must be a dict holding .*'dp_cp_group'"),
        ({"metadata": {"dp_group": None}}, ValueError, r"metadata=\{'dp_group'.*dp_cp_group"),
        ({"metadata": {"dp_cp_group": 2}}, TypeError, r"metadata\['dp_cp_group'\]=2 must be"),
        ({"metadata": META, "sharded_offsets": (1, 0, 2)}, ValueError, r"sharded_offsets=\(1"),
        ({"metadata": META, "prefix": 3}, TypeError, r"prefix=3 must be a str"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        VocabParallelEmbedding(10, 4).sharded_state_dict(**kwargs)


def test_load_state_dict_zeroes_padding_rows_of_the_module_and_its_tied_head():
    emb = VocabParallelEmbedding(1001, 4, multiple=8)
    head = VocabParallelLMHead(4, 1001, multiple=8, tie_to=emb, bias=True)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    stored = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    stored["head.weight"] = stored["emb.weight"]  # one tied Parameter, two names
    model.load_state_dict(stored)  # a megatron checkpoint's padding rows are not zero
    for key, param in model.state_dict().items():
        want = stored[key].clone()
        want[1001:] = 0
        assert torch.equal(param, want), key
    assert set(head.sharded_state_dict(metadata=META)) == {"bias"}  # the embedding owns it
