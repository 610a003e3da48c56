"""megatron-core's own ``MimoModel`` (>= 0.19) with our communicator, on 4 gloo ranks.

``patch_mimo_model()`` makes ``MimoModel.__init__`` build ``mp_bridge``'s
``ColocatedBridgeCommunicator`` for its colocated encoder; the test then runs megatron's
whole colocated forward (``_forward_all_modules``: encoder submodule, bridge, text
embedding, ``align_embeddings_by_token_positions``, megatron's CP ``PartitionAdapter``,
language model), a backward, and ``MimoModel.destroy()``, on ``current_device()``.

Where it stops short of a production model: the language model is a tiny module
(``TinyLM``: an embedding and a per-token dot product) instead of megatron's
``GPTModel``, and the encoder is one ``nn.Linear``; everything of ``MimoModel`` itself
runs unmodified. (See the README's megatron section for what needs CUDA.)

Oracle: the same encoder / embedding / dot product on the full global batch in one
process. Data contract: the global batch is split over DP in contiguous blocks in both
grids (encoder: images; LLM: token ids); the LLM's CP rank i keeps sequence chunks i and
2cp-1-i (megatron's zigzag). Loss on a rank: ``sum(Wt * out)`` over its local tokens, so
each (sample, position) of a dest DP replica is counted once and every encoder rank's
pixel gradient equals the full-batch gradient on its rows.
Tolerance: rtol 1e-5, atol 1e-6: the matmuls and the H-term dot products run on
different row counts than the oracle's (blocking may change the fp32 summation order,
error <= H * eps * sum|terms|, about 1e-6 here); between two communicators (ours vs
megatron's) on the same model, the comparison is exact (``torch.equal``).
"""

from __future__ import annotations

import contextlib

import pytest

from mp_bridge.grid.megatron_compat import megatron_core_version

if megatron_core_version() < (0, 19):
    pytest.skip(
        "MimoModel's colocated communicator needs megatron-core >= 0.19 "
        f"(installed: {megatron_core_version()}); run `make test-megatron-latest`",
        allow_module_level=True,
    )

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.models.mimo import MimoModel, MimoModelConfig  # noqa: E402
from megatron.core.models.mimo.comm import colocated_communicator as mcore_comm  # noqa: E402
from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mp_bridge.comm import ColocatedBridgeCommunicator  # noqa: E402
from mp_bridge.grid import destroy_grid, make_grid  # noqa: E402
from mp_bridge.integrations.megatron import patch_mimo_model  # noqa: E402
from mp_bridge.testing import DistributedWorld, current_device  # noqa: E402

world = DistributedWorld(4)

B, S, H, C, V = 4, 8, 4, 3, 11  # global batch, sequence, hidden, pixel channels, vocab
IMG = 0  # image placeholder id; text ids are 1..V-1
IMG_POS = (1, 3)  # image token positions: chunk 0 and chunk 1 (two CP ranks at cp=2)
RTOL, ATOL = 1e-5, 1e-6


class TinyEncoder(torch.nn.Module):
    """``pixels [b, n, C] -> [b, n, H]``; same weights on every rank (fixed seed)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.weight = torch.nn.Parameter(torch.randn(H, C, generator=gen))

    def forward(self, pixels):
        return pixels @ self.weight.t()


class TinyEmbedding(torch.nn.Module):
    """megatron's embedding call: ``(input_ids [b, s], position_ids) -> [s, b, H]``."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(V, H, generator=torch.Generator().manual_seed(2))
        )

    def forward(self, input_ids, position_ids=None):
        return self.weight[input_ids].transpose(0, 1)


class TinyLM(torch.nn.Module):
    """Language model stand-in: ``decoder_input [s, b, H] -> (decoder_input . w) [s, b]``."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = TinyEmbedding()
        self.w = torch.nn.Parameter(torch.randn(H, generator=torch.Generator().manual_seed(3)))

    def forward(self, input_ids, position_ids, decoder_input, labels, attention_mask, **kw):
        return (decoder_input * self.w).sum(-1)


def _global_batch():
    gen = torch.Generator().manual_seed(5)
    pixels = torch.randn(B, len(IMG_POS), C, generator=gen)
    ids = torch.randint(1, V, (B, S), generator=gen)
    ids[:, list(IMG_POS)] = IMG
    weights = torch.randn(B, S, generator=gen)
    dev = current_device()  # drawn on the CPU (same values everywhere), used on the device
    return pixels.to(dev), ids.to(dev), weights.to(dev)


def _oracle(pixels, ids):
    """Full-batch reference: out [B, S] and d(sum(Wt * out))/d(pixels) is taken later."""
    enc, lm = TinyEncoder().to(pixels.device), TinyLM(None).to(pixels.device)
    pixels = pixels.clone().requires_grad_()
    x = lm.embedding.weight[ids].clone()
    x[:, list(IMG_POS)] = enc(pixels)
    return (x * lm.w).sum(-1), pixels


def _cp_index(cp: int, i: int) -> torch.Tensor:
    c, dev = S // (2 * cp), current_device()
    return torch.cat(
        [
            torch.arange(i * c, (i + 1) * c, device=dev),
            torch.arange((2 * cp - 1 - i) * c, (2 * cp - i) * c, device=dev),
        ]
    )


def _rows(dp: int, dp_index: int) -> slice:
    per = B // dp
    return slice(dp_index * per, (dp_index + 1) * per)


def _coords(grid, axis: str) -> int:
    for members in grid.get_rank_enum([axis]):
        if dist.get_rank() in members:
            return members.index(dist.get_rank())
    raise AssertionError(axis)


def _grids(enc, llm, llm_order=("tp", "cp", "pp", "dp")):
    enc_grid = make_grid(**enc, axis_names=("tp", "cp", "pp", "dp"), create=())
    llm_grid = make_grid(
        **llm, axis_names=llm_order, create=("tp", "cp", "pp", "dp", ("dp", "cp"), ("tp", "cp"))
    )
    return enc_grid, llm_grid


def _mimo(enc_grid, llm_grid, language_model: ModuleSpec | None = None):
    cp = llm_grid.shape[llm_grid.dim_names.index("cp")]
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, context_parallel_size=cp,
        use_cpu_initialization=True,
    )  # fmt: skip
    vision = ModuleSpec(
        module=VisionModalitySubmodules,
        submodules={"encoders": {"enc": ModuleSpec(module=TinyEncoder)}},
    )
    mimo_config = MimoModelConfig(
        language_model_spec=language_model or ModuleSpec(module=TinyLM, params={"config": config}),
        modality_submodules_spec={"images": vision},
        special_token_ids={"images": IMG},
        module_to_grid_map={"images": enc_grid, "language": llm_grid},
    )
    model = MimoModel(mimo_config, cp_group=llm_grid.get_pg("cp"), tp_group=llm_grid.get_pg("tp"))
    return model.to(current_device())  # megatron builds it on the CPU (use_cpu_initialization)


def _step(model, enc_grid, llm_grid):
    """One forward + backward on this rank's shards; returns (out, pixel grad, expected)."""
    pixels, ids, weights = _global_batch()
    enc_dp, llm_dp = (g.shape[g.dim_names.index("dp")] for g in (enc_grid, llm_grid))
    llm_cp = llm_grid.shape[llm_grid.dim_names.index("cp")]
    enc_rows = _rows(enc_dp, _coords(enc_grid, "dp"))
    llm_rows = _rows(llm_dp, _coords(llm_grid, "dp"))
    full = torch.arange(S, device=current_device())
    index = _cp_index(llm_cp, _coords(llm_grid, "cp")) if llm_cp > 1 else full
    px = pixels[enc_rows].clone().requires_grad_()
    out, _ = model(
        input_ids=ids[llm_rows],
        modality_inputs={"images": {"enc": {"pixels": px}}},
    )
    wt = weights[llm_rows][:, index].t()  # [s_local, b_local], like out
    (wt * out).sum().backward()
    ref_out, ref_px = _oracle(pixels, ids)
    (weights * ref_out).sum().backward()
    return out.detach(), px.grad, ref_out.detach()[llm_rows][:, index].t(), ref_px.grad[enc_rows]


@contextlib.contextmanager
def _megatron_on_gloo():
    """megatron's communicator hard-codes backend='nccl' for its gather groups: drop it."""
    original = dist.new_subgroups_by_enumeration

    def without_backend(ranks_per_subgroup_list, backend=None, **kw):
        return original(ranks_per_subgroup_list, **kw)

    dist.new_subgroups_by_enumeration = without_backend
    try:
        yield
    finally:
        dist.new_subgroups_by_enumeration = original


def _run(enc, llm, *, ours: bool, llm_order=("tp", "cp", "pp", "dp")):
    enc_grid, llm_grid = _grids(enc, llm, llm_order)
    model = None
    try:
        with patch_mimo_model() if ours else _megatron_on_gloo():
            model = _mimo(enc_grid, llm_grid)
        comm = model.colocated_comms[("images", "language")]
        assert type(comm) is (
            ColocatedBridgeCommunicator if ours else mcore_comm.ColocatedBridgeCommunicator
        )
        return _step(model, enc_grid, llm_grid)
    finally:
        if model is not None:
            model.destroy()
            assert model.colocated_comms == {}
        destroy_grid(enc_grid)
        destroy_grid(llm_grid)


def _assert_oracle(result):
    out, grad, ref_out, ref_grad = result
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)


@world.case
def test_fan_in_cp1_matches_oracle_and_megatrons_communicator_bitwise():
    enc, llm = {"dp": 4}, {"tp": 2, "dp": 2}
    ours = _run(enc, llm, ours=True)
    _assert_oracle(ours)
    theirs = _run(enc, llm, ours=False)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@world.case
def test_fan_out_cp1_matches_oracle_and_megatrons_communicator_bitwise():
    enc, llm = {"tp": 2, "dp": 2}, {"dp": 4}
    ours = _run(enc, llm, ours=True)
    _assert_oracle(ours)
    theirs = _run(enc, llm, ours=False)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@world.case
def test_dest_cp2_works_with_ours_and_is_refused_by_megatrons():
    enc, llm = {"dp": 4}, {"cp": 2, "dp": 2}
    _assert_oracle(_run(enc, llm, ours=True))
    with pytest.raises(ValueError, match="CP must be 1"):
        _run(enc, llm, ours=False)


@world.case
def test_non_nesting_layouts_refused_by_ours_silently_wrong_in_megatrons():
    # encoder (tp, dp) = (2, 2) with tp fastest; LLM the same sizes with dp fastest:
    # rank 1 holds encoder replica 0's images but LLM replica 1's tokens.
    enc, llm, order = {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2}, ("dp", "tp", "cp", "pp")
    with pytest.raises(ValueError, match="nest"):
        _run(enc, llm, ours=True, llm_order=order)
    out, grad, ref_out, ref_grad = _run(enc, llm, ours=False, llm_order=order)
    wrong = not torch.allclose(out, ref_out, rtol=RTOL, atol=ATOL)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, wrong)
    assert flags == [False, True, True, False], flags


@world.case
def test_patch_is_scoped_and_module_stays_megatrons_after_undo():
    with patch_mimo_model() as patch:
        assert mcore_comm is not None
        from megatron.core.models.mimo.model import base

        assert base.ColocatedBridgeCommunicator is ColocatedBridgeCommunicator
        assert patch.active
    assert base.ColocatedBridgeCommunicator is mcore_comm.ColocatedBridgeCommunicator
    assert not patch.active


@world.case
def test_megatron_gpt_model_builds_on_cpu_and_stops_at_its_attention_buffer():
    # How far a real megatron GPTModel (local spec, no Transformer Engine) gets on CPU:
    # MimoModel + our communicator + GPTModel build; the forward runs the encoder, the
    # bridge, the text embedding and the alignment, then stops in GPTModel's
    # DotProductAttention, whose score buffer comes from parallel_state's global memory
    # buffer (allocated on torch.cuda.current_device(); never initialized without CUDA).
    if current_device().type == "cuda":
        pytest.skip(
            "pins how far megatron's GPTModel gets on the CPU (it stops at the CUDA-only "
            "attention buffer); on CUDA it needs megatron's initialized parallel_state"
        )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    enc_grid, llm_grid = _grids({"dp": 4}, {"tp": 2, "dp": 2})
    pg = llm_grid.get_pg
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
        tensor_model_parallel_size=2,
    )  # fmt: skip
    groups = ProcessGroupCollection(
        tp=pg("tp"), cp=pg("cp"), pp=pg("pp"), dp=pg("dp"), dp_cp=pg(["dp", "cp"]),
        tp_cp=pg(["tp", "cp"]), embd=None, pos_embd=None,
    )  # fmt: skip
    gpt = ModuleSpec(
        module=GPTModel,
        params=dict(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V + 1,
            max_sequence_length=S, position_embedding_type="none", pg_collection=groups,
        ),
    )  # fmt: skip
    with patch_mimo_model():
        model = _mimo(enc_grid, llm_grid, language_model=gpt)
    try:
        assert type(model.colocated_comms[("images", "language")]) is ColocatedBridgeCommunicator
        pixels, ids, _ = _global_batch()
        enc_rows = _rows(4, _coords(enc_grid, "dp"))
        llm_rows = _rows(2, _coords(llm_grid, "dp"))
        with pytest.raises(AssertionError, match="global memory buffer is not initialized"):
            model(
                input_ids=ids[llm_rows],
                modality_inputs={"images": {"enc": {"pixels": pixels[enc_rows]}}},
            )
    finally:
        model.destroy()
        destroy_grid(enc_grid)
        destroy_grid(llm_grid)


@world.case
def test_megatrons_equal_output_aliases_its_input_ours_does_not():
    # EQUAL (same TP/DP): megatron's forward is `tensor.contiguous()`, the input itself.
    enc_grid, llm_grid = _grids({"tp": 2, "dp": 2}, {"tp": 2, "dp": 2})
    try:
        theirs = mcore_comm.ColocatedBridgeCommunicator(
            src_grid=enc_grid, dest_grid=llm_grid, dim_mapping={"b": 0, "h": 1}
        )
        ours = ColocatedBridgeCommunicator(
            src_grid=enc_grid, dest_grid=llm_grid, dim_mapping={"b": 0, "h": 1}
        )
        x = torch.randn(4, H).to(current_device())
        assert theirs.communicate(x).data_ptr() == x.data_ptr()
        assert ours.communicate(x).data_ptr() != x.data_ptr()
        theirs.destroy()
        ours.destroy()
    finally:
        destroy_grid(enc_grid)
        destroy_grid(llm_grid)
