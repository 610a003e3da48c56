"""A transformers LLaVA loaded with ``load_hf`` into the colocated model on 8 ranks equals
transformers' own model in one process.

Every rank builds the same random ``LlavaForConditionalGeneration`` (:func:`tiny_llava`,
fp32), which rank 0 saves with ``save_pretrained``; the colocated model is built from a *random*
reference and then filled by ``load_hf`` at its layout (each rank reading its slices).
The HF model, run in one process on the whole batch, is the oracle (nothing of ours).

Tolerances, the MIMO oracle tests': loss 1e-5 relative (the same fp32 math summed in
another order: TP-split matmuls, K/V gathered over CP; measured ~1e-7); every parameter
whose HF gradient is not None, gathered to full and mapped by its ``named_parameters()``
name, 1e-4 absolute (measured ~1e-7); after five Adam steps (lr 1e-3) the losses 1e-5
relative and the weights 1e-4 relative per tensor (Adam turns a ~1e-7 relative gradient
difference into the same relative update difference; ``ParityReport``'s weight bound).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from mp_bridge.grid import GridLayout, make_grid  # noqa: E402
from mp_bridge.models import (  # noqa: E402
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
)
from mp_bridge.models.hf import (  # noqa: E402
    config_from_hf,
    disk_to_module,
    hf_batch,
    hf_mappings,
    load_hf,
)
from mp_bridge.models.hf.hf_save import hf_tensors  # noqa: E402
from mp_bridge.models.hf.tiny import tiny_llava  # noqa: E402
from mp_bridge.models.parallel.sharding import gather_full_state  # noqa: E402
from mp_bridge.testing import DistributedWorld  # noqa: E402
from tests.hf_llava import grad_errors, llava_inputs, tied_copies_equal  # noqa: E402

world = DistributedWorld(8)
LOSS_RTOL, GRAD_ATOL, WEIGHT_RTOL = 1e-5, 1e-4, 1e-4

FAN_IN_CP2 = (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), {})
LAYOUTS = {
    # encoder grid, LLM grid, model options
    "fan_in_cp2_gather": FAN_IN_CP2,
    "fan_in_cp2_routed": (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), {"flow": "routed"}),
    "llm_pp2": (dict(tp=2, dp=4), dict(tp=2, pp=2, dp=2), {"microbatches": 2}),
    "tp4_sp": (dict(tp=4, dp=2), dict(tp=4, dp=2), {"sequence_parallel": True}),
    # beyond the layouts: Ulysses over CP 4 from an encoder at TP 4, and a pipeline
    # of CP ring stages fed by a fan-in to one LLM replica
    "enc_tp4_to_cp4_a2a_routed": (
        dict(tp=4, dp=2), dict(cp=4, dp=2), {"flow": "routed", "cp_comm": "a2a"},
    ),
    "llm_tp2_cp2_pp2_ring": (
        dict(tp=2, dp=4), dict(tp=2, cp=2, pp=2), {"microbatches": 2, "cp_comm": "ring"},
    ),
}  # fmt: skip
#: text, vision, tied head, images per sample (4 samples: the encoder DP 4 blocks)
MODELS = {
    "clip_llama_untied": ("llama", "clip", False, (1, 1, 1, 1)),
    "siglip_qwen2_tied_ragged": ("qwen2", "siglip", True, (2, 1, 0, 1)),
}


def _grids(enc, llm):
    enc_grid = make_grid(**enc, create=("tp", "dp"))
    create = ("tp", "cp", "dp", ("dp", "cp"), *(("pp",) if llm.get("pp", 1) > 1 else ()))
    return enc_grid, make_grid(**llm, create=create)


def _setup(text, vision, tie, images, enc, llm, options):
    hf = tiny_llava(text, vision, tie=tie)  # the same model on every rank (seeded)
    # Under torch.distributed, save_pretrained writes from rank 0 only: one directory.
    path = [tempfile.mkdtemp(prefix="hf-llava-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    path = path[0]
    if dist.get_rank() == 0:
        hf.save_pretrained(path)
    dist.barrier()
    cfg = config_from_hf(path, seq_len=16)
    ids, pixels, mask, labels = llava_inputs(cfg, images, pad=(0, 3, 0, 5))
    batch = hf_batch(cfg, ids, pixels, labels, mask)
    grids = _grids(enc, llm)
    torch.manual_seed(123)  # a random reference: load_hf must overwrite every weight
    model = build_colocated_mimo(ReferenceMimo(cfg), *grids, **options)
    load_hf(path, model)
    rank = dist.get_rank()
    enc_dp, llm_dp = (GridLayout.from_grid(g).coords(rank)["dp"] for g in grids)
    local = (
        batch.encoder_shard(enc_dp, enc.get("dp", 1)),
        batch.llm_shard(llm_dp, llm.get("dp", 1)),
    )
    return hf, cfg, model, grids, (ids, pixels, mask, labels), local


def _step(model, local):
    images, text = local
    loss = model.train_step(text.input_ids, text.labels, text.loss_mask, images)
    model.sync_gradients()
    return loss


def _adam_steps(hf, model, local, hf_batch_, steps, after=lambda: None):
    """``steps`` Adam steps (lr 1e-3) of transformers' model on its whole batch and of ours
    on this rank's shards; ``after()`` follows each. Returns (our losses, theirs)."""
    ids, pixels, mask, labels = hf_batch_
    hf_optim = torch.optim.Adam(hf.parameters(), lr=1e-3)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    ours, theirs = [], []
    for _ in range(steps):
        hf_optim.zero_grad(set_to_none=True)
        optim.zero_grad(set_to_none=True)
        loss = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels).loss
        loss.backward()
        hf_optim.step()
        theirs.append(loss.item())
        ours.append(_step(model, local).item())
        optim.step()
        after()
    return ours, theirs


#: every model at every layout (a tied head at pp 2: the last stage's embedding copy)
CASES = {f"{m}-{lay}": (MODELS[m], LAYOUTS[lay]) for m in MODELS for lay in LAYOUTS}
#: balanced encoders move whole images between encoder DP replicas: a CLIP "default" tower
#: (as many placeholders as patches), images skewed so that the balancer moves some
CASES["clip_llama_skewed-balance_routed"] = (
    ("llama", "clip", False, (3, 0, 1, 0)),
    (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), {"flow": "routed", "balance": True}),
)


@world.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_loss_and_every_hf_gradient_at_the_layout(case):
    (text, vision, tie, images), (enc, llm, options) = case
    hf, cfg, model, grids, (ids, pixels, mask, labels), local = _setup(
        text, vision, tie, images, enc, llm, options
    )
    plans = []  # balanced encoders: the plans, to check that images did move
    if model.balancer is not None:
        balance = model.balancer.balance

        def recorded(*args):
            rows, plan = balance(*args)
            plans.append(plan)
            return rows, plan

        model.balancer.balance = recorded
    try:
        want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels).loss
        want.backward()
        got = _step(model, local)
        grads = gather_full_state(model, grads=True)
    finally:
        destroy_colocated_mimo(model, *grids)
    assert abs(got.item() - want.item()) <= LOSS_RTOL * abs(want.item()), (got, want)
    errors = grad_errors(None, hf, cfg, full_grads=grads)
    worst = max(errors.items(), key=lambda e: e[1])
    assert worst[1] <= GRAD_ATOL, worst
    if options.get("balance"):  # the case exercises the balanced path, or proves nothing
        assert plans and plans[0].moved_images > 0, f"nothing was balanced: {plans}"
    return {"loss": got.item(), "grad_err": worst[1], "compared": len(errors)}


@world.case
def test_five_adam_steps_match_transformers_five_steps():
    enc, llm, options = FAN_IN_CP2
    hf, cfg, model, grids, (ids, pixels, mask, labels), local = _setup(
        "qwen2", "clip", False, (1, 1, 1, 1), enc, llm, options
    )
    try:
        ours, theirs = _adam_steps(hf, model, local, (ids, pixels, mask, labels), 5)
        full = model.to_full()
    finally:
        destroy_colocated_mimo(model, *grids)
    assert all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
    assert theirs[-1] < theirs[0]  # it trains, or equal weights would prove nothing
    hf_params, worst = dict(hf.named_parameters()), (0.0, "")
    for m in hf_mappings(cfg):
        for key, tensor in zip(m.hf, hf_tensors(m, full[m.ours])):
            want = hf_params[disk_to_module(key)].detach()
            diff = float((tensor - want).abs().max())
            if key.endswith("k_proj.bias"):
                # Softmax ignores a shift shared by all keys, so the key bias's gradient
                # is zero in exact arithmetic: both runs hold rounding noise that
                # Adam scales to steps of up to lr in arbitrary directions. Bound:
                # 5 steps of at most lr each.
                assert diff <= 5 * 1e-3, (key, diff)
                continue
            worst = max(worst, (diff / float(want.abs().max()), key))
    assert worst[0] <= WEIGHT_RTOL, worst
    return {"losses": ours, "weight_rel": worst}


@world.case
def test_a_tied_head_at_pp2_trains_like_transformers_and_its_copies_stay_equal():
    """Tied SigLIP + Qwen2 at LLM TP2/PP2/DP2: three Adam steps give transformers' losses,
    the first stage's embedding and the last stage's copy stay bitwise equal, and both
    equal transformers' trained (tied) weight to the five-step test's bound."""
    enc, llm, options = LAYOUTS["llm_pp2"]
    hf, cfg, model, grids, (ids, pixels, mask, labels), local = _setup(
        "qwen2", "siglip", True, (2, 1, 0, 1), enc, llm, options
    )
    equal = []
    try:
        ours, theirs = _adam_steps(
            hf, model, local, (ids, pixels, mask, labels), 3,
            after=lambda: equal.append(tied_copies_equal(model)),
        )  # fmt: skip
        embed = model.llm.to_full()["embed.weight"]  # this rank's stage: first or last
    finally:
        destroy_colocated_mimo(model, *grids)
    assert equal == [1, 1, 1], equal  # every rank is on the first or the last stage
    assert all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
    assert theirs[-1] < theirs[0]
    want = hf.get_input_embeddings().weight.detach()
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    rel = float((embed - want).abs().max() / want.abs().max())
    assert rel <= WEIGHT_RTOL, rel
    return {"losses": ours, "embed_rel": rel}


def _tp4_shard_elements() -> int:
    """The elements one rank holds of tiny_llava's CLIP + Llama at encoder TP 4 / LLM TP 4,
    counted by hand from the HF shapes: sharded tensors / 4, replicated ones whole."""
    h, f, layers = 16, 32, 2  # vision hidden, ffn, layers run (feature layer -2 of 3)
    vision = 16 * 48 + h + 5 * h + 2 * h  # patch conv (no bias), class token, 5 positions, pre-norm
    vision += layers * (
        4 * h + 2 * h  # ln1, ln2 (weight, bias); attention out and fc2 biases (row: whole)
        + (3 * h * h + 3 * h + h * h + f * h + f + h * f) // 4  # qkv w/b, out, fc1 w/b, fc2
    )  # fmt: skip
    projector = (32 * 16 + 32 + 32 * 32) // 4 + 32  # linear_1 w/b sharded, linear_2 w, its bias
    H, ffn, kv_rows, vocab = 32, 48, (8 + 2 * 4) * 4, 64  # text hidden, ffn, qkv rows, vocab
    text = 2 * (2 * H + (kv_rows * H + H * H + 2 * ffn * H + H * ffn) // 4) + H  # layers, norm
    text += 2 * vocab * H // 4  # embedding and head (vocab 64 splits evenly: no padding)
    return vision + projector + text


@world.case
def test_a_model_built_from_a_config_holds_only_its_shards_and_loads_hf():
    enc, llm = dict(tp=4, dp=2), dict(tp=4, dp=2)
    hf = tiny_llava("llama", "clip")
    path = [tempfile.mkdtemp(prefix="hf-llava-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if dist.get_rank() == 0:
        hf.save_pretrained(path[0])
    dist.barrier()
    cfg = config_from_hf(path[0], seq_len=16)
    grids = _grids(enc, llm)
    model = build_colocated_mimo(cfg, *grids)  # no ReferenceMimo anywhere
    try:
        held = sum(p.numel() for p in model.parameters())
        assert held == _tp4_shard_elements(), (held, _tp4_shard_elements())
        assert all(p.dtype == torch.float32 for p in model.parameters())  # 4 bytes each
        load_hf(path[0], model)
        ids, pixels, mask, labels = llava_inputs(cfg, (1, 1, 1, 1))
        batch = hf_batch(cfg, ids, pixels, labels, mask)
        rank = dist.get_rank()
        enc_dp, llm_dp = (GridLayout.from_grid(g).coords(rank)["dp"] for g in grids)
        local = (batch.encoder_shard(enc_dp, 2), batch.llm_shard(llm_dp, 2))
        got = _step(model, local)
    finally:
        destroy_colocated_mimo(model, *grids)
    want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels).loss
    assert abs(got.item() - want.item()) <= LOSS_RTOL * abs(want.item()), (got, want)
    return {"bytes_per_rank": 4 * held}


@world.case
def test_packed_documents_under_cp_match_hf_rows():
    """HF's right-padded rows == our packed documents (their real tokens, ``cu_seqlens``)
    at encoder TP2/DP4 -> LLM TP2/CP2/DP2: rotary positions inside each document survive
    the CP cut of packed input."""
    enc, llm, options = FAN_IN_CP2
    hf, cfg, model, grids, (ids, pixels, mask, labels), _ = _setup(
        "llama", "clip", False, (1, 1, 1, 1), enc, llm, options
    )
    plain = hf_batch(cfg, ids, pixels, labels, mask)
    keep = mask.bool().flatten()
    lengths = mask.sum(dim=1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    flat = [t.flatten()[keep] for t in (plain.input_ids, plain.labels, plain.loss_mask)]
    packed = type(plain)(plain.images, *flat, cu_seqlens=cu)
    rank = dist.get_rank()
    enc_dp, llm_dp = (GridLayout.from_grid(g).coords(rank)["dp"] for g in grids)
    images, text = packed.encoder_shard(enc_dp, 4), packed.llm_shard(llm_dp, 2)
    try:
        got = model.train_step(
            text.input_ids, text.labels, text.loss_mask, images, cu_seqlens=text.cu_seqlens
        )
    finally:
        destroy_colocated_mimo(model, *grids)
    want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels).loss
    assert abs(got.item() - want.item()) <= LOSS_RTOL * abs(want.item()), (got, want)
    return {"loss": got.item()}


SAVE_CASES = [
    "clip_llama_untied-llm_pp2",
    "clip_llama_untied-tp4_sp",
    "siglip_qwen2_tied_ragged-llm_pp2",
]


@world.parametrize("case", SAVE_CASES)
def test_save_hf_at_the_layout_gives_back_the_hf_tensors_bitwise(case):
    """``load_hf`` then ``save_hf`` on 8 ranks (TP shards gathered; at PP 2 the second
    stage's tensors sent to rank 0) writes what transformers' ``save_pretrained`` wrote
    (a tied head: the embedding once, held by both end stages; no ``lm_head.weight``)."""
    from safetensors.torch import load_file

    from mp_bridge.models.hf import save_hf

    (text, vision, tie, images), (enc, llm, options) = CASES[case]
    hf, cfg, model, grids, _, _ = _setup(text, vision, tie, images, enc, llm, options)
    out = [tempfile.mkdtemp(prefix="hf-out-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out, src=0)
    try:
        save_hf(f"{out[0]}/model", model)
    finally:
        destroy_colocated_mimo(model, *grids)
    if dist.get_rank() != 0:
        return None
    after = load_file(f"{out[0]}/model/model.safetensors")
    want = {k: t.detach() for k, t in hf.state_dict().items()}
    if tie:  # save_pretrained leaves the tied head to the embedding
        del want["lm_head.weight"]
    got = {disk_to_module(k): t for k, t in after.items()}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    return {"tensors": len(got)}
