"""The vocab layers' ``sharded_state_dict`` against megatron-core's own, on 4 gloo ranks.

Oracle: megatron's ``GPTModel`` built on the same TP / DP groups (``pg_collection``, no
``parallel_state``) with the padded vocab megatron's training uses
(``make_vocab_size_divisible_by * tp``): its ``embedding.word_embeddings.weight`` and
``output_layer.weight`` entries (``LanguageModule.sharded_state_dict`` sets
``allow_shape_mismatch`` on the latter) must equal ours field by field (key, dtype, local
and global shape, offset, fragmentation, replica id, flags) at TP 1 / 2 / 4 (DP 4 / 2 / 1).
A vocab of 1001 with ``multiple`` 8 is padded at every TP (1008, 1008, 1024 rows).
Megatron's own ``validate_sharding_integrity`` then checks the gathered metadata (and
rejects a planted overlap, so it is not vacuous). Megatron's save path needs CUDA, so the
load is DCP's in-place write into ``ShardedTensor.data`` followed by ``load_state_dict``,
as megatron's trainer does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.validation import (
    determine_global_metadata,
    validate_sharding_integrity,
)
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from mp_bridge.layers import VocabParallelEmbedding, VocabParallelLMHead, padded_vocab_size
from mp_bridge.testing import DistributedWorld

world = DistributedWorld(4, timeout_s=180)

V, H, MULTIPLE = 1001, 8, 8
EMB, OUT = "embedding.word_embeddings.", "output_layer."


def metadata_fields(sharded) -> dict:
    """Every dataclass field of a megatron ``ShardedTensor`` but its data."""
    return {
        f.name: getattr(sharded, f.name) for f in dataclasses.fields(sharded) if f.name != "data"
    }


def groups(tp: int) -> ProcessGroupCollection:
    """megatron's process-group collection of a TP x DP grid over the world (CP = PP = 1)."""
    grid = HyperCommGrid([tp, 1, 1, dist.get_world_size() // tp], ["tp", "cp", "pp", "dp"])
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.cp, pgs.pp = grid.create_pg("tp"), grid.create_pg("cp"), grid.create_pg("pp")
    pgs.dp, pgs.dp_cp = grid.create_pg("dp"), grid.create_pg(["cp", "dp"])
    pgs.tp_cp, pgs.embd, pgs.pos_embd = grid.create_pg(["tp", "cp"]), pgs.pp, pgs.pp
    return pgs


def megatron_config(tp: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
    )  # fmt: skip


def megatron_gpt(pgs: ProcessGroupCollection, tp: int, *, tied: bool) -> GPTModel:
    return GPTModel(
        megatron_config(tp), get_gpt_layer_local_spec(),
        vocab_size=padded_vocab_size(V, tp, multiple=MULTIPLE),
        max_sequence_length=16, position_embedding_type="rope", pg_collection=pgs,
        share_embeddings_and_output_weights=tied,
    )  # fmt: skip


def ours(pgs: ProcessGroupCollection, *, tied: bool = False, bias: bool = False) -> nn.Module:
    model = nn.Module()
    model.emb = VocabParallelEmbedding(V, H, tp_group=pgs.tp, multiple=MULTIPLE)
    tie = model.emb if tied else None
    model.head = VocabParallelLMHead(
        H, V, tp_group=pgs.tp, multiple=MULTIPLE, tie_to=tie, bias=bias
    )
    return model


def our_sharded(model: nn.Module, dp_group, prefixes=(EMB, OUT)) -> dict:
    meta = {"dp_cp_group": dp_group}
    return {
        **model.emb.sharded_state_dict(prefix=prefixes[0], metadata=meta),
        **model.head.sharded_state_dict(prefix=prefixes[1], metadata=meta),
    }


@world.parametrize("tp", [1, 2, 4])
def test_metadata_matches_megatron_gpt_model(tp):
    pgs = groups(tp)
    meta = {"dp_cp_group": pgs.dp_cp}
    model = ours(pgs)
    mine = our_sharded(model, pgs.dp_cp)
    theirs = megatron_gpt(pgs, tp, tied=False).sharded_state_dict(metadata=meta)
    for key in (EMB + "weight", OUT + "weight"):
        assert metadata_fields(mine[key]) == metadata_fields(theirs[key]), key
    assert mine[EMB + "weight"].global_shape == (padded_vocab_size(V, tp, multiple=MULTIPLE), H)
    # The data is the Parameter itself: a DCP load writes into the layer in place.
    assert mine[EMB + "weight"].data is model.emb.weight
    # Tied on one stage: megatron's output layer has no weight entry, and neither has ours.
    tied_theirs = megatron_gpt(pgs, tp, tied=True).sharded_state_dict(metadata=meta)
    tied_mine = our_sharded(ours(pgs, tied=True), pgs.dp_cp)
    assert {k for k in tied_theirs if k.startswith((EMB, OUT))} == set(tied_mine)
    # A biased head: the bias as megatron's ColumnParallelLinear (GPTModel's output layer
    # kind) shards it, with allow_shape_mismatch as LanguageModule.sharded_state_dict sets.
    linear = ColumnParallelLinear(
        H, padded_vocab_size(V, tp, multiple=MULTIPLE), config=megatron_config(tp),
        init_method=nn.init.zeros_, bias=True, tp_group=pgs.tp,
    )  # fmt: skip
    their_bias = linear.sharded_state_dict(prefix=OUT, metadata=meta)[OUT + "bias"]
    their_bias.allow_shape_mismatch = True
    my_bias = our_sharded(ours(pgs, bias=True), pgs.dp_cp)[OUT + "bias"]
    assert metadata_fields(my_bias) == metadata_fields(their_bias)


@world.case
def test_megatron_sharding_validation_accepts_ours_and_rejects_an_overlap():
    sharded = {}
    for tp in (1, 2, 4):
        pgs = groups(tp)
        model = ours(pgs, bias=True)
        sharded.update(our_sharded(model, pgs.dp_cp, (f"tp{tp}.{EMB}", f"tp{tp}.{OUT}")))
    _, global_metadata = determine_global_metadata(sharded)
    validate_sharding_integrity(global_metadata)  # rank 0 checks; raises on a bad pattern
    # Planted: every DP replica claims to be the main one (replica_id 0), so shards overlap.
    for st in sharded.values():
        st.replica_id = (0, 0, 0)
    _, global_metadata = determine_global_metadata(sharded)
    if dist.get_rank() == 0:
        with pytest.raises(CheckpointingException):
            validate_sharding_integrity(global_metadata)


@world.case
def test_a_megatron_style_load_zeroes_our_padding_rows():
    pgs = groups(4)  # rank 3 holds rows [768, 1024): 233 real, 23 padding
    model = ours(pgs, bias=True)
    sharded = our_sharded(model, pgs.dp_cp)
    # What a checkpoint of megatron's layers holds: random rows, padding included.
    gen = torch.Generator().manual_seed(7)
    stored = {k: torch.randn(st.global_shape, generator=gen) for k, st in sharded.items()}
    loaded = {}
    for key, st in sharded.items():  # DCP writes each rank's slice into ShardedTensor.data
        rows = slice(st.global_offset[0], st.global_offset[0] + st.local_shape[0])
        with torch.no_grad():
            st.data.copy_(stored[key][rows])
        loaded[key.replace(EMB, "emb.").replace(OUT, "head.")] = st.data
    model.load_state_dict(loaded)  # megatron's trainer: model.load_state_dict(state_dict)
    shard = model.emb.vocab_shard
    for key, param in (
        (EMB + "weight", model.emb.weight),
        (OUT + "weight", model.head.weight),
        (OUT + "bias", model.head.bias),
    ):
        want = stored[key][shard.start : shard.stop].clone()
        want[shard.num_real :] = 0
        assert torch.equal(param.detach(), want), key
