"""Bridge outputs are the caller's own tensors: in-place use is allowed and harmless.

For FAN_IN, FAN_OUT and EQUAL, dest CP 1 and 2, ``[b, s, h]`` and batch-major flattened
``(b*s, h)`` inputs (4 forked gloo ranks), the LLM side modifies the bridge output in place
(``mul_``, ``add_``) before using it. Each case checks, on every rank:

- the in-place ops do not raise (a custom-Function view would);
- the encoder activation ``a = relu(x)`` is unchanged afterwards, holds no shared storage
  with the output, and its own backward still works (``relu`` saves its output, so an
  aliased in-place op would fail backward with a version-counter error);
- forward values and the gradient of the encoder input equal a single-process computation
  on the full tensors.

Oracle (independent of the plan): the global batch X is split over DP in contiguous blocks
in both grids; each dest rank uses its CP chunks (i and 2cp-1-i of 2cp) of
``y = 3 * bridge(relu(x)) + 1`` in ``sum(W * y)``, so (as in test_bridge) every src rank's
gradient is ``3 * W * (X > 0)`` on its own rows, over the whole sequence.
Tolerance: none (``torch.equal``): the forward only copies, the in-place ops and the oracle
apply the same single fp32 multiply to the same numbers, and the backward sums one nonzero
partial with zeros (the other CP rank's zero padding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm import BridgeDirection, ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout
from mp_bridge.testing import DistributedWorld, current_device

world = DistributedWorld(4)

B, S, H = 8, 8, 3
ORDER = ("tp", "cp", "pp", "dp")


def _layout(tp=1, cp=1, dp=1) -> GridLayout:
    return GridLayout((tp, cp, 1, dp), ORDER)


def _rows(layout: GridLayout, rank: int) -> slice:
    per = B // layout.axis_size("dp")
    dp = layout.coords(rank)["dp"]
    return slice(dp * per, (dp + 1) * per)


def _cp_index(cp: int, i: int) -> torch.Tensor:
    c = S // (2 * cp)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c), torch.arange((2 * cp - 1 - i) * c, (2 * cp - i) * c)]
    )


def _check(src: GridLayout, dest: GridLayout, direction: BridgeDirection) -> None:
    device, rank = current_device(), dist.get_rank()
    gen = torch.Generator().manual_seed(11)
    X = torch.randn(B, S, H, generator=gen).to(device)
    W = torch.randn(B, S, H, generator=gen).to(device)
    cp, cp_rank = dest.axis_size("cp"), dest.coords(rank)["cp"]
    index = _cp_index(cp, cp_rank).to(device)
    for flat in (False, True):
        mapping = {"b": 0, "h": 1} if flat else None
        with ColocatedBridgeCommunicator(src, dest, dim_mapping=mapping) as bridge:
            assert bridge.direction is direction
            x = X[_rows(src, rank)].clone().requires_grad_()
            a = torch.relu(x)  # the encoder activation; relu saves it for backward
            a_in = a.reshape(-1, H) if flat else a
            before = a.detach().clone()
            y = bridge.communicate(a_in)
            assert y.data_ptr() != a.data_ptr()
            assert y.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
            y.mul_(3.0)  # in place, as an LLM might (scaling, adding a position embedding)
            y.add_(1.0)
            y3 = y.view(-1, S, H) if flat else y
            dest_rows = _rows(dest, rank)
            assert torch.equal(y3.detach(), X[dest_rows].relu() * 3.0 + 1.0)
            assert torch.equal(a.detach(), before), "in-place use changed the encoder activation"
            (W[dest_rows].index_select(1, index) * y3.index_select(1, index)).sum().backward()
            expected = (W * 3.0 * (X > 0))[_rows(src, rank)]
            assert torch.equal(x.grad, expected), f"flat={flat}"


CASES = {
    "fan_in_cp1": (_layout(dp=4), _layout(tp=2, dp=2), BridgeDirection.FAN_IN),
    "fan_in_cp2": (_layout(dp=4), _layout(cp=2, dp=2), BridgeDirection.FAN_IN),
    "fan_out_cp1": (_layout(tp=2, dp=2), _layout(dp=4), BridgeDirection.FAN_OUT),
    "fan_out_cp2": (_layout(tp=4), _layout(cp=2, dp=2), BridgeDirection.FAN_OUT),
    "equal_cp1": (_layout(tp=2, dp=2), _layout(tp=2, dp=2), BridgeDirection.EQUAL),
    "equal_cp2": (_layout(tp=2, dp=2), _layout(cp=2, dp=2), BridgeDirection.EQUAL),
}


@world.case
def test_fan_in_cp1():
    _check(*CASES["fan_in_cp1"])


@world.case
def test_fan_in_cp2():
    _check(*CASES["fan_in_cp2"])


@world.case
def test_fan_out_cp1():
    _check(*CASES["fan_out_cp1"])


@world.case
def test_fan_out_cp2():
    _check(*CASES["fan_out_cp2"])


@world.case
def test_equal_cp1():
    _check(*CASES["equal_cp1"])


@world.case
def test_equal_cp2():
    _check(*CASES["equal_cp2"])


@world.case
def test_no_grad_output_is_owned_too():
    # Inference (no autograd): in-place on the output still leaves the source alone.
    rank = dist.get_rank()
    for src, dest, _ in CASES.values():
        with ColocatedBridgeCommunicator(src, dest) as bridge:
            x = torch.full((B // src.axis_size("dp"), S, H), float(rank), device=current_device())
            with torch.no_grad():
                bridge.communicate(x).zero_()
            assert torch.equal(x, torch.full_like(x, float(rank)))
