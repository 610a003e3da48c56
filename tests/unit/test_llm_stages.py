"""Pipeline stages of the LLM, the pipeline runner's checks and the packed capacity (one
process, no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from mp_bridge.models import MimoConfig, ReferenceLLM
from mp_bridge.models.parallel import (
    LLMPipeline,
    TPLLMStage,
    agree_capacity,
    packed_length,
    pad_packed_to,
    stage_layers,
)
from mp_bridge.models.reference.model import reference_masked_mean

CFG = MimoConfig(llm_layers=4)


def test_stage_layers_literal():
    assert [stage_layers(5, 2, s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [stage_layers(4, 4, s) for s in range(4)] == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match=r"n_layers=2 < n_stages=4.*at most 2 stages"):
        stage_layers(2, 4, 0)
    with pytest.raises(ValueError, match="stage"):
        stage_layers(4, 2, 2)


@given(st.integers(1, 40), st.integers(1, 40))
def test_stage_layers_partition_the_blocks(n_layers, n_stages):
    if n_layers < n_stages:
        return
    got = [i for s in range(n_stages) for i in stage_layers(n_layers, n_stages, s)]
    assert got == list(range(n_layers))
    sizes = [len(stage_layers(n_layers, n_stages, s)) for s in range(n_stages)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_stages_hold_every_reference_parameter_once(n_stages):
    ref = ReferenceLLM(CFG)
    names = []
    for s in range(n_stages):
        stage = TPLLMStage.from_full(ref, CFG, stage=s, n_stages=n_stages)
        own = dict(stage.named_parameters())
        names += own
        for name, p in own.items():  # loaded from the reference, not left at init
            assert torch.equal(p, ref.state_dict()[name]), name
    assert sorted(names) == sorted(n for n, _ in ref.named_parameters())


@pytest.mark.parametrize("n_stages", [2, 3])
def test_a_tied_head_has_its_embedding_copy_on_the_last_stage(n_stages):
    """Megatron's tied pipeline: the last stage registers its own ``embed`` and ties the
    head to it, so the reference's one name ``embed.weight`` is on the first and the last
    stage (loaded equal), and no stage holds a ``head.weight`` of its own."""
    cfg = MimoConfig(llm_layers=4, tie_embeddings=True)
    ref = ReferenceLLM(cfg)
    stages = [TPLLMStage.from_full(ref, cfg, stage=s, n_stages=n_stages) for s in range(n_stages)]
    first, *middle, last = stages
    assert last.head.weight is last.embed.weight is not first.embed.weight
    assert torch.equal(last.embed.weight, first.embed.weight)
    assert torch.equal(first.embed.weight, ref.embed.weight)
    assert [p is s.embed.weight for s in (first, last) for p in s.tied_parameters()] == [True] * 2
    assert all(not s.tied_parameters() and not hasattr(s, "embed") for s in middle)
    names = [set(dict(s.named_parameters())) for s in stages]
    assert "head.weight" not in set().union(*names)
    assert set().union(*names) == {n for n, _ in ref.named_parameters()}
    assert names[0] & names[-1] == {"embed.weight"}
    with pytest.raises(RuntimeError, match="only stage 0 embeds ids"):
        last.embed_tokens(torch.zeros(1, 2, dtype=torch.long))
    assert TPLLMStage(cfg, stage=0, n_stages=1).tied_parameters() == []


def test_building_a_stage_draws_no_random_numbers():
    # A stage's default inits (embedding, head) depend on the stage; were they drawn from
    # the global generator, data drawn after the build would differ between stages.
    ref = ReferenceLLM(CFG)
    before = torch.get_rng_state()
    for s in range(4):
        TPLLMStage.from_full(ref, CFG, stage=s, n_stages=4)
    assert torch.equal(torch.get_rng_state(), before)


def test_one_stage_pipeline_matches_reference():
    torch.manual_seed(0)
    ref = ReferenceLLM(CFG)
    stage = TPLLMStage.from_full(ref, CFG, stage=0, n_stages=1)
    ids = torch.randint(0, CFG.vocab_size, (4, 8))
    labels = torch.randint(0, CFG.vocab_size, (4, 8))
    mask = (torch.rand(4, 8) > 0.3).float()
    pos = torch.arange(8).expand(4, 8)
    loss = LLMPipeline(stage, pp_group=None).step(
        2,
        position_ids=[pos[:2], pos[2:]],
        inputs=lambda m: stage.embed_tokens(ids[2 * m : 2 * m + 2]),
        labels=[labels[:2], labels[2:]],
        loss_mask=[mask[:2], mask[2:]],
    )
    logits = ref(ref.embed(ids))
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    want = reference_masked_mean(per_token.view(4, 8), mask)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    got = dict(stage.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-5, atol=1e-7)


def test_pipeline_errors():
    stage = TPLLMStage(CFG, stage=1, n_stages=2)
    with pytest.raises(ValueError, match=r"stage 1 of 2 does not match pp_group \(rank 0 of 1\)"):
        LLMPipeline(stage, pp_group=None)
    with pytest.raises(TypeError, match="stage must be a TPLLMStage"):
        LLMPipeline(ReferenceLLM(CFG), pp_group=None)
    one = TPLLMStage(CFG, stage=0, n_stages=1)
    with pytest.raises(ValueError, match=r"schedule='pipedream' must be one of"):
        LLMPipeline(one, pp_group=None, schedule="pipedream")
    pipe = LLMPipeline(one, pp_group=None)
    pos = torch.arange(8).expand(1, 8)
    with pytest.raises(ValueError, match="position_ids must be a list of 2 microbatch entries"):
        pipe.step(2, position_ids=[pos], inputs=lambda m: None, labels=[], loss_mask=[])
    with pytest.raises(ValueError, match=r"shapes \[\(1, 6\), \(1, 8\)\].*pad every microbatch"):
        pipe.step(2, position_ids=[pos, pos[:, :6]], inputs=lambda m: None)
    with pytest.raises(ValueError, match="stage 0 needs inputs=callable"):
        pipe.step(1, position_ids=[pos])
    with pytest.raises(ValueError, match=r"labels\[0\] has shape \(1, 6\) but its position_ids"):
        pipe.step(1, position_ids=[pos], inputs=len, labels=[pos[:, :6]], loss_mask=[pos])
    with pytest.raises(RuntimeError, match="stage 1 has no embedding"):
        stage.embed_tokens(torch.zeros(1, 8, dtype=torch.long))


def test_packed_capacity():
    cu = torch.tensor([0, 3, 8])
    assert packed_length(cu, 1) == 8 and packed_length(cu, 2) == 12
    assert agree_capacity(12, cp=2) == 12  # one process: rounded to 2·cp = 4 only
    assert agree_capacity(13, cp=2, tp=2, sequence_parallel=True) == 16
    ids = torch.arange(8)
    cu2, ids2, lab2, mask2 = pad_packed_to(16, cp=2, cu_seqlens=cu, input_ids=ids, labels=ids,
                                           loss_mask=torch.ones(8))  # fmt: skip
    assert cu2.tolist() == [0, 3, 8, 12] and ids2.tolist() == list(range(8)) + [0] * 4
    assert lab2[8:].tolist() == [-100] * 4 and mask2[8:].tolist() == [0] * 4
    assert pad_packed_to(12, cp=2, cu_seqlens=cu)[0].tolist() == [0, 3, 8]
    with pytest.raises(ValueError, match="needs 12 tokens after the CP cut but capacity=8"):
        pad_packed_to(8, cp=2, cu_seqlens=cu)
