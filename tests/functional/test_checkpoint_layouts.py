"""Checkpoints of the colocated MIMO model across layouts, on 8 ranks (gloo).

Each layout pair trains 2 Adam steps at the saved layout, saves (weights, Adam state,
RNG), builds the model at the loading layout from *other* weights (a reference seeded
differently, every parameter then shifted by 1 so padding rows are non-zero), loads,
and checks:

- the load is exact: every weight and Adam state tensor (gathered over TP, padding
  dropped) equals the saved one bitwise, on the names a rank holds at both layouts (a
  pipeline stage holds its own); every padding row is zero;
- training on for 2 steps matches the single-process oracle of all 4 steps (the same
  noisy batches): losses ``rel <= 1e-5``, weights ``rel <= 1e-4``, the tolerances of
  ``test_models_oracle*.py`` (the same fp32 math summed in another order).

The same-layout resume is bitwise: its 2 steps after the load give the same losses and
the same weights and Adam state (``torch.equal``) as the run that never stopped. Between
save and load every rank reseeds its generators, so a load that did not restore the RNG
states would draw other image noise and fail it (the teeth case checks exactly that).
"""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist

import mp_bridge.checkpoint.rng as ckpt_rng
from mp_bridge.checkpoint import load, save
from mp_bridge.layers import shard_spec
from mp_bridge.testing import DistributedWorld
from tests.functional.checkpoint_runs import (
    LOSS_RTOL,
    WEIGHT_RTOL,
    build,
    max_rel,
    oracle,
    seed_all,
    unequal,
    world_max,
)

world = DistributedWorld(8, timeout_s=900)

E_TP2 = dict(encoder_tp=2, encoder_dp=4)
PAIRS = {
    "enc-tp2dp4>tp4dp2,llm-tp2cp2dp2>tp4dp2": (
        dict(E_TP2, llm_tp=2, llm_cp=2, llm_dp=2),
        dict(encoder_tp=4, encoder_dp=2, llm_tp=4, llm_dp=2),
    ),
    "llm-pp2>pp1,tp2>tp1cp2": (
        dict(E_TP2, llm_tp=2, llm_pp=2, llm_dp=2, microbatches=2),
        dict(encoder_tp=1, encoder_dp=8, llm_tp=1, llm_cp=2, llm_dp=4),
    ),
    "llm-pp1>pp4": (
        dict(encoder_tp=1, encoder_dp=8, llm_tp=1, llm_dp=8),
        dict(E_TP2, llm_tp=2, llm_pp=4, microbatches=2),
    ),
    "tp8-sp>routed-tp2cp2": (
        dict(encoder_tp=8, encoder_dp=1, llm_tp=8, llm_dp=1, sequence_parallel=True),
        dict(E_TP2, llm_tp=2, llm_cp=2, llm_dp=2, flow="routed"),
    ),
}
SAME = {
    "pp2-M2": dict(E_TP2, llm_tp=2, llm_pp=2, llm_dp=2, microbatches=2),
    "cp2-sp-routed": dict(
        E_TP2, llm_tp=2, llm_cp=2, llm_dp=2, sequence_parallel=True, flow="routed"
    ),  # fmt: skip
    # One encoder TP group spans a first and a middle LLM stage: building them must not
    # leave the global generator in a stage-dependent state (image noise drawn from it
    # would differ over encoder TP, and the replicated encoder parameters with it).
    "enc-tp4-pp4": dict(encoder_tp=4, encoder_dp=2, llm_tp=2, llm_pp=4),
}


def _shared_dir() -> str:
    box = [tempfile.mkdtemp(prefix="mp_bridge_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0] + "/ckpt"


def _cleanup(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path.rsplit("/", 1)[0], ignore_errors=True)


def _padding_nonzero(model) -> list[str]:
    """Sharded parameters with a non-zero row outside this rank's real pieces."""
    bad = []
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        if spec is None:
            continue
        keep = torch.zeros(p.shape[spec.dim], dtype=torch.bool)
        for piece in spec.local_pieces(p.shape[spec.dim]):
            keep[piece.local_start : piece.local_start + piece.length] = True
        if p.detach().index_select(spec.dim, (~keep).nonzero().flatten().to(p.device)).any():
            bad.append(name)
    return bad


@world.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_load_at_another_layout_is_exact_and_training_on_matches_the_oracle(pair):
    saved, loading = PAIRS[pair]
    path = _shared_dir()
    seed_all(0)
    a = build(saved, seed=0)
    losses = [a.step(i) for i in range(2)]
    save(path, a.model, a.optimizer, step=2, extra={"pair": pair})
    at_save, used = a.full(), a.used
    a.destroy()
    seed_all(1234)  # other noise unless the load restores the RNG states
    b = build(loading, seed=7)
    with torch.no_grad():
        for p in b.model.parameters():
            p.add_(1.0)  # padding rows non-zero: the load must zero them
    info = load(path, b.model, b.optimizer)
    loaded = b.full()
    moved = unequal(loaded, at_save)
    shared = len(set(loaded) & set(at_save))
    padding = _padding_nonzero(b.model)
    qkv = sum(1 for k in set(loaded) & set(at_save) if "qkv" in k)
    losses += [b.step(i) for i in (2, 3)]
    final = b.full()
    b.destroy()
    _cleanup(path)
    ref_losses, ref_state = oracle(used + b.used, seed=0)
    loss_rel = max(abs(x - y) / abs(y) for x, y in zip(losses, ref_losses))
    weight_rel, worst = max_rel({k: v for k, v in final.items() if ":" not in k}, ref_state)
    weight_rel = world_max(weight_rel)
    summary = (
        f"{pair}: moved {moved}, padding {padding}, loss {loss_rel}, weight {weight_rel} "
        f"(worst here: {worst})"
    )
    assert (info.step, info.extra, info.world_size) == (2, {"pair": pair}, 8), summary
    assert shared > 0 and qkv > 0 and not moved and not padding, summary
    assert loss_rel <= LOSS_RTOL and weight_rel <= WEIGHT_RTOL, summary
    return loss_rel, weight_rel


def _same_layout(layout: dict, restore_rng: bool):
    path = _shared_dir()
    seed_all(0)
    a = build(layout, seed=0)
    for i in range(2):
        a.step(i)
    save(path, a.model, a.optimizer, step=2)
    never_stopped = [a.step(i) for i in (2, 3)]
    final = a.full()
    a.destroy()
    seed_all(4321)
    b = build(layout, seed=7)
    original = ckpt_rng.restore
    if not restore_rng:
        ckpt_rng.restore = lambda state: None
    try:
        load(path, b.model, b.optimizer)
    finally:
        ckpt_rng.restore = original
    resumed = [b.step(i) for i in (2, 3)]
    differ = unequal(b.full(), final)
    b.destroy()
    _cleanup(path)
    return never_stopped, resumed, differ, final


@world.parametrize("layout", list(SAME), ids=list(SAME))
def test_resume_at_the_same_layout_is_bitwise(layout):
    never_stopped, resumed, differ, final = _same_layout(SAME[layout], restore_rng=True)
    assert resumed == never_stopped and not differ, (resumed, never_stopped, differ)
    assert any(":exp_avg" in k for k in final)  # Adam state was compared too


@world.case
def test_teeth_a_resume_without_the_rng_states_is_not_bitwise():
    never_stopped, resumed, differ, _ = _same_layout(SAME["pp2-M2"], restore_rng=False)
    assert resumed != never_stopped and differ
