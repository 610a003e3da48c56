"""FSDP2 (``fully_shard``) with our fused loss and vocab layers, on 4 gloo ranks.

Oracle everywhere: the same model trained in one process on the full tensors and the
global batch (every data-parallel rank's tokens): FSDP2 averages gradients over its ranks,
and each rank's loss is a mean over the same number of tokens, so the reference loss is
the mean over the global batch. Tolerance ``atol = rtol = 1e-5`` in fp32 (as the TP tests'
fused-gradient checks): sums over the tokens in another order (FSDP's reduce-scatter, the
fused loss's chunks, TP's all-reduce), ~1e-7 relative each, through two Adam steps whose
update is bounded by the learning rate. Collective counts are exact.

Meshes: FSDP over all 4 ranks (TP 1), or a ``("dp", "tp")`` mesh of 2 x 2: FSDP over
``"dp"``, our layers' ``tp_group`` from ``"tp"`` (rank ``2 * dp + tp``), or a ``"tp"``
``DTensor`` output weight (FSDP x TP: oracle the TP-only plain ``tp_group`` call, within the
TP tests' ``2e-5``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mp_bridge.checkpoint import load, save
from mp_bridge.layers import (
    ShardSpec,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    fused_linear_cross_entropy,
    mark_sharded,
    shard_spec,
    vocab_parallel_cross_entropy,
)
from mp_bridge.models import gather_full_state, load_full_state
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from mp_bridge.testing.collectives import CollectiveCall
from tests.oracles import vocab_cut

world = DistributedWorld(4, timeout_s=240)

V, H, B, S, LR = 11, 6, 2, 3, 1e-2  # V = 11: at TP 2 rank 1 holds one zero padding row
TOL = dict(atol=1e-5, rtol=1e-5)


def _batch(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``[dp * B, S]`` ids and targets, the same on every rank
    (data-parallel rank ``d`` takes rows ``[d * B, (d + 1) * B)``)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (dp * B, S), generator=g)
    target = torch.randint(0, V, (dp * B, S), generator=g)
    return ids, target


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "emb.weight": torch.randn(V, H, generator=g),
        "head.weight": torch.randn(V, H, generator=g),
    }


def _mesh(tp: int):
    return init_device_mesh(current_device().type, (4 // tp, tp), mesh_dim_names=("dp", "tp"))


class TinyLM(nn.Module):
    """Our vocab layers: ids -> embedding -> head -> vocab-parallel cross-entropy."""

    def __init__(self, tp_group, full: dict[str, torch.Tensor]):
        super().__init__()
        dev = current_device()
        self.tp_group = tp_group
        self.emb = VocabParallelEmbedding.from_full(full["emb.weight"].to(dev), tp_group=tp_group)
        self.head = VocabParallelLMHead.from_full(full["head.weight"].to(dev), tp_group=tp_group)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        return vocab_parallel_cross_entropy(
            logits, target, tp_group=self.tp_group, vocab_size=V, reduction="mean"
        )


def _reference_lm(steps: int, dp: int):
    """One process, full tensors: per-step losses of each data-parallel slice, and the
    final weights."""
    w = {k: v.clone().requires_grad_() for k, v in _full_weights().items()}
    opt = torch.optim.Adam(w.values(), lr=LR)
    ids, target = _batch(dp)
    losses = []
    for _ in range(steps):
        logits = F.embedding(ids, w["emb.weight"]) @ w["head.weight"].t()
        per_token = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        losses.append(per_token.view(dp, B * S).mean(1).detach())
        opt.zero_grad()
        per_token.mean().backward()
        opt.step()
    return losses, {k: v.detach() for k, v in w.items()}


@world.parametrize("tp", [1, 2])
def test_vocab_layers_under_fully_shard_train_like_one_process(tp):
    mesh = _mesh(tp)
    tp_group = mesh.get_group("tp") if tp > 1 else None
    dp_rank = mesh.get_local_rank("dp")
    model = TinyLM(tp_group, _full_weights())
    for part in (model.emb, model.head, model):
        fully_shard(part, mesh=mesh["dp"])
    for name, param in model.named_parameters():
        # the TP declaration survives the swap to FSDP2's DTensor (global shape = TP shard)
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
        assert shard_spec(param) == ShardSpec(0, tp_group, V), name
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    want_losses, want_weights = _reference_lm(2, 4 // tp)
    ids, target = _batch(4 // tp)
    dev = current_device()
    rows = slice(dp_rank * B, (dp_rank + 1) * B)
    for want in want_losses:
        loss = model(ids[rows].to(dev), target[rows].to(dev))
        torch.testing.assert_close(loss.detach().cpu(), want[dp_rank], **TOL)
        opt.zero_grad()
        loss.backward()
        opt.step()
    got = gather_full_state(model)  # FSDP all-gather over dp, then TP, padding dropped
    for name, want in want_weights.items():
        torch.testing.assert_close(got[name].cpu(), want, **TOL)
    load_full_state(model, _full_weights())  # into the DTensor shards, and back: exact
    back = gather_full_state(model)
    assert all(torch.equal(back[k].cpu(), v) for k, v in _full_weights().items())


def _adam_step(model: TinyLM, opt, dp_rank: int) -> None:
    ids, target = _batch(2)
    rows = slice(dp_rank * B, (dp_rank + 1) * B)
    opt.zero_grad()
    model(ids[rows].to(current_device()), target[rows].to(current_device())).backward()
    opt.step()


@world.case
def test_checkpoint_of_fsdp2_over_our_tp_round_trips():
    """FSDP x our TP on the 2 x 2 mesh (``KeepsShardSpecs``): each parameter is a DTensor
    whose global shape is one padded TP shard (V = 11: TP rank 1's last row is padding,
    and FSDP's dp rank 1 holds shard rows 3..5, i.e. full rows 9, 10 and that padding row).
    A checkpoint saved after an Adam step holds the unpadded full tensors: it loads
    exactly into a fresh FSDP model (Adam state back as DTensors on the parameter's mesh
    and placements, equal shard for shard; the next step equals the uninterrupted one,
    bitwise), into the plain TP model and into TP 1 (gathered weights equal, bitwise)."""
    mesh = _mesh(2)
    tp_group, dp_rank = mesh.get_group("tp"), mesh.get_local_rank("dp")

    def wrapped(full):
        model = TinyLM(tp_group, full)
        for part in (model.emb, model.head, model):
            fully_shard(part, mesh=mesh["dp"])
        return model, torch.optim.Adam(model.parameters(), lr=LR)

    zeros = {k: torch.zeros_like(v) for k, v in _full_weights().items()}
    model, opt = wrapped(_full_weights())
    _adam_step(model, opt, dp_rank)
    path = os.path.join(tempfile.gettempdir(), f"mp_bridge_fsdp2_{os.getppid()}", "ckpt")
    save(path, model, opt, step=1)
    saved = gather_full_state(model)
    fresh, fresh_opt = wrapped(zeros)
    assert load(path, fresh, fresh_opt).step == 1
    back = gather_full_state(fresh)
    assert all(torch.equal(back[k], v) for k, v in saved.items())
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, v in opt.state[p].items():
            w = fresh_opt.state[q][key]
            if key != "step":
                assert isinstance(w, DTensor) and w.placements == v.placements, key
            assert torch.equal(getattr(w, "_local_tensor", w), getattr(v, "_local_tensor", v))
    _adam_step(model, opt, dp_rank)
    _adam_step(fresh, fresh_opt, dp_rank)
    on, resumed = gather_full_state(model), gather_full_state(fresh)
    assert all(torch.equal(resumed[k], v) for k, v in on.items())
    for tp_group_now in (tp_group, None):  # plain TP shards, then TP 1 on every rank
        plain = TinyLM(tp_group_now, zeros)
        load(path, plain)
        back = gather_full_state(plain)
        assert all(torch.equal(back[k], v) for k, v in saved.items())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.dirname(path))


@world.case
def test_a_plain_module_loses_its_declaration_to_fully_shard():
    """Why the vocab layers keep their specs (``KeepsShardSpecs``): FSDP2 drops the
    attribute of the parameter it replaces, as it does on any plain module."""
    plain = nn.Linear(H, 4, bias=False, device=current_device())
    mark_sharded(plain.weight, dim=0, group=None, full_size=4)
    fully_shard(plain, mesh=_mesh(1)["dp"])
    assert isinstance(plain.weight, DTensor) and shard_spec(plain.weight) is None


class TiedLM(nn.Module):
    def __init__(self, full: torch.Tensor):
        super().__init__()
        self.emb = VocabParallelEmbedding.from_full(full.to(current_device()), tp_group=None)
        self.head = VocabParallelLMHead(H, V, tie_to=self.emb, device=current_device())

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), target.flatten())


@world.case
def test_tied_embedding_and_head_in_one_fsdp_unit_train_like_one_process():
    """A tied pair shares one Parameter; FSDP2 shards it once when both layers sit in one
    unit (``fully_shard`` on their parent), and its gradient sums both uses."""
    dev, rank = current_device(), dist.get_rank()
    full = _full_weights()["emb.weight"]
    model = TiedLM(full)
    fully_shard(model, mesh=_mesh(1)["dp"])
    assert model.emb.weight is model.head.weight and shard_spec(model.head.weight) is not None
    ids, target = _batch(4)
    rows = slice(rank * B, (rank + 1) * B)
    model(ids[rows].to(dev), target[rows].to(dev)).backward()
    w = full.clone().requires_grad_()
    F.cross_entropy((F.embedding(ids, w) @ w.t()).flatten(0, 1), target.flatten()).backward()
    got = gather_full_state(model, grads=True)
    torch.testing.assert_close(got["emb.weight"].cpu(), w.grad, **TOL)


@world.case
def test_tied_pair_in_two_fsdp_units_is_refused_by_fsdp2():
    """Wrapped apart, the tie would break (each unit swaps in its own parameter): FSDP2
    refuses it at the first forward, naming the fix, before any collective."""
    model = TiedLM(_full_weights()["emb.weight"])
    mesh = _mesh(1)["dp"]
    for part in (model.emb, model.head, model):
        fully_shard(part, mesh=mesh)
    ids, target = _batch(4)
    with pytest.raises(ValueError, match=r"shared with a parameter already managed by another"):
        model(ids[:B].to(current_device()), target[:B].to(current_device()))


class FusedHead(nn.Module):
    """The supported pattern: the fused loss inside the FSDP unit's ``forward``, where
    FSDP2 has gathered ``weight`` (a plain tensor with FSDP alone)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, h: torch.Tensor, target: torch.Tensor, chunk_size: int | None):
        assert not isinstance(self.weight, DTensor)  # gathered: FSDP alone
        return fused_linear_cross_entropy(h, self.weight, target, chunk_size=chunk_size)


class TrunkAndHead(nn.Module):
    def __init__(self, trunk: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.trunk, self.head = nn.Linear(H, H, bias=False), FusedHead(head)
        with torch.no_grad():
            self.trunk.weight.copy_(trunk)

    def forward(self, x, target, chunk_size=None):
        return self.head(torch.tanh(self.trunk(x)), target, chunk_size)


@world.parametrize("chunk_size", [1, 4, None])
def test_fused_loss_inside_fsdp_forward_runs_only_fsdps_collectives(chunk_size):
    """One step: FSDP2's all-gathers only (trunk and head: one in forward, one in backward
    with ``reshard_after_forward=True``), the same at every ``chunk_size``; FSDP2
    reduce-scatters both gradients; loss and gradients equal one process's."""
    dev, rank = current_device(), dist.get_rank()
    g = torch.Generator().manual_seed(11)
    trunk_w, head_w = torch.randn(H, H, generator=g), torch.randn(V, H, generator=g)
    x, target = torch.randn(4 * 5, H, generator=g), torch.randint(0, V, (4 * 5,), generator=g)
    model = TrunkAndHead(trunk_w, head_w).to(dev)
    mesh = _mesh(1)["dp"]
    for part in (model.trunk, model.head, model):
        fully_shard(part, mesh=mesh)
    rows = slice(5 * rank, 5 * rank + 5)
    with CollectiveCounter() as counter:
        loss = model(x[rows].to(dev), target[rows].to(dev), chunk_size)
        loss.backward()
    assert counter.counts() == {"all_gather": 4, "reduce_scatter": 2}, counter.calls
    # FSDP2 pads to equal shards: the trunk's 6 rows to 2 a rank, the head's 11 to 3; each
    # all-gather receives 3 other ranks' rows of H fp32: 3 * 2 * 6 * 4 and 3 * 3 * 6 * 4.
    gathers = sorted(c.bytes_received for c in counter.calls if c.name == "all_gather")
    assert gathers == [144, 144, 216, 216], counter.calls
    assert isinstance(model.head.weight.grad, DTensor)
    wt, wh = trunk_w.clone().requires_grad_(), head_w.clone().requires_grad_()
    per_token = F.cross_entropy(torch.tanh(x @ wt.t()) @ wh.t(), target, reduction="none")
    per_token.mean().backward()
    torch.testing.assert_close(loss.detach().cpu(), per_token[rows].mean().detach(), **TOL)
    got = gather_full_state(model, grads=True)
    torch.testing.assert_close(got["head.weight"].cpu(), wh.grad, **TOL)
    torch.testing.assert_close(got["trunk.weight"].cpu(), wt.grad, **TOL)


@world.case
def test_mixed_precision_gives_an_fp32_gradient_from_bf16_products():
    """``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: forward and the
    gradient's products run in bf16 (the gathered weight and the cast inputs); FSDP2
    reduces in fp32 and keeps ``dW`` in the sharded parameter's dtype, fp32. Tolerance
    against fp32: bf16's 8-bit mantissa, ``rtol = atol = 3e-2`` (the TP tests' bf16)."""
    dev, rank = current_device(), dist.get_rank()
    full = _full_weights()["head.weight"]
    head = VocabParallelLMHead.from_full(full.to(dev), tp_group=None)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(head, mesh=_mesh(1)["dp"], mp_policy=policy)
    h = torch.randn(4 * 3, H, generator=torch.Generator().manual_seed(5))
    rows = slice(3 * rank, 3 * rank + 3)
    logits = head(h[rows].to(dev))
    assert logits.dtype == torch.bfloat16
    logits.float().square().mean().backward()
    assert head.weight.dtype == head.weight.grad.dtype == torch.float32
    w = full.clone().requires_grad_()
    (h @ w.t()).square().view(4, 3, V).mean((1, 2)).mean().backward()
    got = gather_full_state(head, grads=True)["weight"]
    torch.testing.assert_close(got.cpu(), w.grad, rtol=3e-2, atol=3e-2)


class TpFusedHead(nn.Module):
    """torchtitan's output module: a ``"tp"`` DTensor weight, the fused loss inside
    ``forward`` (where FSDP2 has gathered the ``"dp"`` dim); records what it is handed."""

    def __init__(self, weight: DTensor):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.seen: list[tuple] = []

    def forward(self, h: torch.Tensor, target: torch.Tensor, chunk_size: int | None):
        w = self.weight
        self.seen.append((w.device_mesh.mesh_dim_names, w.placements))
        return fused_linear_cross_entropy(h, w, target, chunk_size=chunk_size)


@world.parametrize("chunk_size, spmd", [(c, s) for s in (False, True) for c in (1, 4, None)])
def test_fsdp_times_tp_on_a_2d_mesh_equals_the_tp_only_run(chunk_size, spmd):
    """FSDP x TP: ``distribute_tensor(w, mesh["tp"], [Shard(0)])`` (V = 11: 6 and 5 rows)
    wrapped by ``fully_shard(mesh=mesh["dp"])`` is ``(_StridedShard(0), Shard(0))`` on
    ``("dp", "tp")``, refused outside ``forward``; inside, FSDP2 hands it over as
    ``(Shard(0),)`` on ``("tp",)``. One step issues the TP-only run's collectives plus
    FSDP2's own: an all-gather in forward and one in backward (the other dp rank's 3
    padded rows of this TP shard) and one reduce-scatter, at every ``chunk_size``. Loss,
    ``d hidden``, ``d W`` (averaged over ``"dp"``) and the Adam step equal the plain
    ``tp_group`` call's on the same tokens within the TP tests' ``2e-5``. ``spmd``: the
    weight ``(Replicate(), Shard(0))`` on the 2-D mesh, ``fully_shard(mesh=mesh,
    dp_mesh_dims=DataParallelMeshDims(shard="dp"))``; forward sees that placement."""
    tol, mesh, dev = dict(atol=2e-5, rtol=2e-5), _mesh(2), current_device()
    dp, tp, tp_group = mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), mesh.get_group("tp")
    g = torch.Generator().manual_seed(13)
    full, x = torch.randn(V, H, generator=g), torch.randn(2, 5, H, generator=g).to(dev)
    target = torch.randint(0, V, (2, 5), generator=g).to(dev)
    # the TP-only run: both dp slices' plain calls on this rank's padded rows, d W averaged
    w_ref, ref = vocab_cut(full, 6, tp, 0).to(dev).requires_grad_(), []
    for d in range(2):
        h = x[d].clone().requires_grad_()
        with CollectiveCounter() as plain:
            loss = fused_linear_cross_entropy(
                h, w_ref, target[d], tp_group=tp_group, vocab_size=V, chunk_size=chunk_size
            )
            loss.backward()
        ref.append((loss.detach(), h.grad, plain.calls))
    w_ref.grad /= 2
    if spmd:
        head = TpFusedHead(distribute_tensor(full.to(dev), mesh, [Replicate(), Shard(0)]))
        # the parameter's own mesh: fully_shard wants that object, and DTensor's sharding
        # cache may hand back an equal mesh of an earlier case for `nn.Parameter(w)`
        spmd_mesh, dims = head.weight.device_mesh, DataParallelMeshDims(shard="dp")
        fully_shard(head, mesh=spmd_mesh, dp_mesh_dims=dims, reshard_after_forward=True)
    else:
        head = TpFusedHead(distribute_tensor(full.to(dev), mesh["tp"], [Shard(0)]))
        fully_shard(head, mesh=mesh["dp"], reshard_after_forward=True)
    assert head.weight.device_mesh.mesh_dim_names == ("dp", "tp")
    outside = r"_StridedShard\(dim=0, sf=2\) over mesh dim 'dp' as well as Shard\(0\) over 'tp'"
    with CollectiveCounter() as refused, pytest.raises(ValueError, match=outside):
        fused_linear_cross_entropy(x[dp], head.weight, target[dp])  # outside forward
    assert not refused.calls and not refused.check_calls, refused.calls
    h = x[dp].clone().requires_grad_()
    with CollectiveCounter() as counter:
        loss = head(h, target[dp], chunk_size)
        loss.backward()
    seen = (("dp", "tp"), (Replicate(), Shard(0))) if spmd else (("tp",), (Shard(0),))
    assert head.seen == [seen], head.seen
    fsdp = [CollectiveCall("all_gather", 2, 3 * H * 4)] * 2 + [
        CollectiveCall("reduce_scatter", 2, 3 * H * 4)
    ]
    assert Counter(counter.calls) == Counter(ref[dp][2] + fsdp), (counter.calls, ref[dp][2])
    torch.testing.assert_close(loss.detach(), ref[dp][0], **tol)
    torch.testing.assert_close(h.grad, ref[dp][1], **tol)
    grad = head.weight.grad  # FSDP2's reduce-scatter: rows [3 dp, 3 dp + 3) of the TP shard
    assert isinstance(grad, DTensor) and grad.placements == head.weight.placements
    rows = slice(3 * dp, 3 * dp + grad.to_local().shape[0])
    torch.testing.assert_close(grad.to_local(), w_ref.grad[rows], **tol)
    for param in (head.weight, w_ref):
        torch.optim.Adam([param], lr=LR).step()
    torch.testing.assert_close(head.weight.to_local().detach(), w_ref.detach()[rows], **tol)
