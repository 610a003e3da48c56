"""FSDP2 models through a checkpoint: DP 4 -> one process -> FSDP2 x DTensor TP -> DP 4.

A two-layer MLP (``fc1: [F, H]``, ``fc2: [H, F]``, biases) trains with Adam on one global
batch (``N`` rows; each data-parallel rank takes its contiguous rows, and FSDP2's
gradient average over ``"dp"`` makes it the global mean). The run moves through four
layouts, two Adam steps each, saving and loading between them:

1. 4 ranks, ``fully_shard`` over a ``"dp"`` mesh of 4 (``fc2``'s 6 rows split 2, 2, 2, 0:
   one rank holds an empty shard);
2. one process, plain tensors (a model-only ``nn.Module`` and Adam);
3. 4 ranks, torchtitan's FSDP2 x DTensor TP on a ``("dp", "tp")`` 2 x 2 mesh
   (``ColwiseParallel`` fc1, ``RowwiseParallel`` fc2: ``fc1.weight`` is
   ``(_StridedShard(0), Shard(0))``);
4. 4 ranks, FSDP2 DP 4 again; then a same-layout resume.

Checks: each load is exact (the gathered weights and Adam state equal what was saved,
bitwise; the optimizer state is a DTensor on the parameter's mesh and placements); each
step's gathered weights match the one-process run of all 8 steps from the same start
within ``atol = rtol = 1e-5`` (fp32: FSDP's reduce-scatter and TP's all-reduce sum in
another order, ~1e-7 relative each, through Adam updates bounded by the learning rate; as
``test_fsdp2.py``); the same-layout resume's step equals the uninterrupted run's bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from mp_bridge.checkpoint import load, save
from mp_bridge.testing import current_device, run_distributed

H, FF, N, LR = 6, 12, 8, 1e-2
TOL = dict(atol=1e-5, rtol=1e-5)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(p.shape, generator=g) * 0.5 for n, p in MLP().named_parameters()}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)


def _oracle(steps: int) -> list[dict[str, torch.Tensor]]:
    """One process, full batch: the weights after each step (index 0: the start)."""
    model = MLP()
    model.load_state_dict(_start())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _batch()
    out = [_start()]
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _snapshot(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Full weights and Adam state (collective over the mesh for DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = _full(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"{name}:{k}"] = _full(v)
    return out


def _build(tp: int):
    model = MLP().to(current_device())
    model.load_state_dict(_start())
    mesh = init_device_mesh(current_device().type, (4 // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=LR), mesh.get_local_rank("dp"), 4 // tp


def _train(model, opt, dp_rank: int, dp: int, steps: int, want: list) -> list[float]:
    """``steps`` steps on this rank's rows; the worst deviation from ``want`` per step."""
    x, y = _batch()
    rows = slice(dp_rank * N // dp, (dp_rank + 1) * N // dp)
    dev = current_device()
    worst = []
    for w in want[:steps]:
        opt.zero_grad()
        F.mse_loss(model(x[rows].to(dev)), y[rows].to(dev)).backward()
        opt.step()
        got = _snapshot(model, opt)
        worst.append(max(float((got[n] - v).abs().max() - TOL["rtol"] * v.abs().max())
                         for n, v in w.items()))  # fmt: skip
    return worst


def _unequal(got: dict, want: dict) -> list[str]:
    return sorted(k for k in set(got) | set(want) if k not in got or k not in want
                  or not torch.equal(got[k], want[k]))  # fmt: skip


def _dtensor_states(opt) -> bool:
    return all(isinstance(v, DTensor) and v.placements == p.placements
               for p, s in opt.state.items() for k, v in s.items() if k != "step")  # fmt: skip


def _phase_a(path: str, want: list):
    model, opt, dp_rank, dp = _build(1)
    worst = _train(model, opt, dp_rank, dp, 2, want[1:3])
    save(path, model, opt, step=2)
    return worst, _snapshot(model, opt)


def _phase_c_d(path_b: str, path: str, want: list, saved_b: dict):
    model, opt, dp_rank, dp = _build(2)  # FSDP2 x DTensor TP
    assert load(path_b, model, opt).step == 4
    exact = [_unequal(_snapshot(model, opt), saved_b), _dtensor_states(opt)]
    worst = _train(model, opt, dp_rank, dp, 2, want[5:7])
    save(path + "c", model, opt, step=6)
    saved_c = _snapshot(model, opt)
    model, opt, dp_rank, dp = _build(1)  # FSDP2 DP 4
    load(path + "c", model, opt)
    exact += [_unequal(_snapshot(model, opt), saved_c), _dtensor_states(opt)]
    worst += _train(model, opt, dp_rank, dp, 1, want[7:8])
    save(path + "d", model, opt, step=7)
    worst += _train(model, opt, dp_rank, dp, 1, want[8:9])
    on = _snapshot(model, opt)
    model, opt, dp_rank, dp = _build(1)  # same-layout resume
    load(path + "d", model, opt)
    _train(model, opt, dp_rank, dp, 1, want[8:9])
    exact.append(_unequal(_snapshot(model, opt), on))
    return worst, exact


def test_fsdp2_dp4_to_one_process_to_fsdp2_tp_to_dp4(tmp_path):
    want = _oracle(8)
    path = str(tmp_path / "ck")
    results = run_distributed(_phase_a, 4, path + "a", want, timeout_s=240)
    assert all(w <= TOL["atol"] for r in results for w in r[0]), [r[0] for r in results]
    saved_a = results[0][1]

    model = MLP()  # one process: plain tensors
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    assert load(path + "a", model, opt).step == 2
    assert _unequal(_snapshot(model, opt), saved_a) == []
    x, y = _batch()
    for w in want[3:5]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        for n, v in w.items():
            torch.testing.assert_close(dict(model.named_parameters())[n].detach(), v, **TOL)
    save(path + "b", model, opt, step=4)

    results = run_distributed(
        _phase_c_d, 4, path + "b", path, want, _snapshot(model, opt), timeout_s=240
    )
    for worst, exact in results:
        assert all(w <= TOL["atol"] for w in worst), worst
        assert exact == [[], True, [], True, []], exact
