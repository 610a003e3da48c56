"""Oracle for the ragged-bridge functional tests (``test_bridge_ragged``, 8 and 6 ranks).

Every rank builds the same global ragged batch: per-sample counts ``C`` (a literal list in
each test file, with text-only samples and all-zero DP blocks), tokens ``X`` ``[sum(C),
*rest]`` and loss weights ``W`` from one seed. The data contract (contiguous sample
blocks by DP index in both grids) then names each rank's tokens by plain slicing; nothing
here calls the plan under test.

Loss: dest token ``j`` of a dest batch is consumed by the dest CP rank ``j mod cp`` (each
token once per replica, as CP sharding does), which takes ``sum(W * y)`` over its tokens
with ``index_select``. Dest TP ranks hold the same data and, as after the LLM's TP
``copy_to_group`` backward, each receives the whole loss's gradient, so the oracle is
``L = sum(W * X)`` over the global batch and every src rank's gradient is ``W`` on its own
tokens. Without the dest-CP all-reduce it would be ``W`` zeroed on the tokens another CP
rank consumes, a different tensor (asserted whenever dest CP > 1).

Tolerance: none (``torch.equal``): the forward copies, and the backward sums, per element,
one nonzero partial with zeros, which is exact on any backend.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import CollectiveCounter, current_device

H = 3
ORDER = ("tp", "cp", "pp", "dp")
HEADER_BYTES = 4 * 8  # samples, tokens, row numel, element size (int64 each)


class RaggedBatch:
    """The global ragged batch and the contract's slices of it."""

    def __init__(self, counts: list[int], rest: tuple[int, ...], device: torch.device):
        self.counts = list(counts)
        self.starts = list(itertools.accumulate([0, *counts]))
        gen = torch.Generator().manual_seed(11)
        total = self.starts[-1]
        self.X = torch.randn(total, *rest, generator=gen).to(device)
        self.W = torch.randn(total, *rest, generator=gen).to(device)

    def samples(self, layout: GridLayout, rank: int) -> range:
        per = len(self.counts) // layout.axis_size("dp")
        dp = layout.coords(rank)["dp"]
        return range(dp * per, (dp + 1) * per)

    def tokens(self, layout: GridLayout, rank: int) -> slice:
        s = self.samples(layout, rank)
        return slice(self.starts[s.start], self.starts[s.stop])


def grids(src: dict, dest: dict, *, src_order=ORDER, dest_order=ORDER):
    return make_grid(**src, axis_names=src_order, create=()), make_grid(
        **dest, axis_names=dest_order, create=("cp",)
    )


def check_ragged(
    src: dict,
    dest: dict,
    counts: list[int],
    *,
    direction: str,
    scale: int,
    rest: tuple[int, ...] = (H,),
    as_tensor: bool = False,
    **orders,
) -> None:
    """Forward, gradient, collective counts and bytes, and no aliasing, on this rank."""
    device, rank = current_device(), dist.get_rank()
    src_grid, dest_grid = grids(src, dest, **orders)
    s_lay, d_lay = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    cp, cd = d_lay.axis_size("cp"), d_lay.coords(rank).get("cp", 0)
    batch = RaggedBatch(counts, rest, device)
    src_tok, dest_tok = batch.tokens(s_lay, rank), batch.tokens(d_lay, rank)
    local = [counts[s] for s in batch.samples(s_lay, rank)]
    tps = torch.tensor(local, dtype=torch.int32, device=device) if as_tensor else local
    x = batch.X[src_tok].clone().requires_grad_()
    row_bytes = torch.zeros(1, *rest).numel() * x.element_size()

    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        assert bridge.direction.name == direction and bridge.scale == scale, bridge.plan
        with CollectiveCounter() as fwd:
            y, dest_counts = bridge.communicate_ragged(x, tps)
        assert dest_counts.dtype == torch.int64
        assert dest_counts.tolist() == [counts[s] for s in batch.samples(d_lay, rank)]
        assert torch.equal(y, batch.X[dest_tok]), "forward is not this rank's dest tokens"

        n_dest = y.shape[0]
        idx = torch.arange(n_dest, device=device)[cd::cp]  # dest tokens j with j % cp == cd
        W_dest = batch.W[dest_tok]
        loss = (y.index_select(0, idx) * W_dest.index_select(0, idx)).sum()
        with CollectiveCounter() as bwd:
            loss.backward()

    expected = batch.W[src_tok]
    assert torch.equal(x.grad, expected), "src gradient differs from the oracle dL/dX = W"
    if cp > 1:
        # Some rank's expected gradient differs from its no-all-reduce value (W zeroed on
        # the tokens other CP ranks consume), so skipping the CP all-reduce fails the case.
        sensitive = [
            r
            for r in s_lay.ranks
            if not torch.equal(
                batch.W[batch.tokens(s_lay, r)],
                batch.W[batch.tokens(s_lay, r)]
                * _cp_owned_mask(batch, s_lay, d_lay, r, d_lay.coords(r)["cp"], cp, rest),
            )
        ]
        assert sensitive, "case cannot detect a skipped CP all-reduce"

    # Collective budget and exact bytes (other members' tokens, never padded).
    t_src, t_dest = src_tok.stop - src_tok.start, dest_tok.stop - dest_tok.start
    n_src = len(local)
    fwd_counts, bwd_counts = {}, {}
    if direction == "FAN_IN":
        fwd_counts = {"all_gather": 1, "all_to_all": 1}
        assert fwd.bytes_received("all_gather") == (scale - 1) * HEADER_BYTES
        moved = (scale - 1) * 8 * n_src + (t_dest - t_src) * row_bytes
        assert fwd.bytes_received("all_to_all") == moved, (fwd.calls, moved)
    if direction == "FAN_OUT":
        bwd_counts["all_to_all"] = 1
        assert bwd.bytes_received("all_to_all") == (t_src - t_dest) * row_bytes, bwd.calls
    if cp > 1:
        bwd_counts["all_reduce"] = 1
        assert bwd.bytes_received("all_reduce") == t_dest * row_bytes
    assert fwd.counts() == fwd_counts, fwd.calls
    assert bwd.counts() == bwd_counts, bwd.calls
    assert all(c.group_size == scale for c in fwd.calls + bwd.calls if c.name != "all_reduce")

    # The output never aliases the input: overwriting y leaves x intact.
    with torch.no_grad():
        y.fill_(float("nan"))
    assert torch.equal(x.detach(), batch.X[src_tok])


def _cp_owned_mask(batch, s_lay, d_lay, rank, cd, cp, rest) -> torch.Tensor:
    """1 on ``rank``'s src tokens whose dest position j (in the dest batch holding them)
    has ``j % cp == cd``: the gradient a CP rank would pass back without the all-reduce."""
    src_tok = batch.tokens(s_lay, rank)
    per = len(batch.counts) // d_lay.axis_size("dp")
    mask = []
    for t in range(src_tok.start, src_tok.stop):
        sample = next(s for s in range(len(batch.counts)) if batch.starts[s + 1] > t)
        first = batch.starts[(sample // per) * per]
        mask.append(1.0 if (t - first) % cp == cd else 0.0)
    m = torch.tensor(mask, device=batch.W.device)
    return m.reshape(-1, *([1] * len(rest)))


def check_double_backward(src: dict, dest: dict, counts: list[int]) -> None:
    """``backward(create_graph=True)`` records every adjoint's collective: with
    ``g = dL/dx`` (``W_src``, a function of the dest weights through the CP all-reduce and
    the direction step), ``d sum(g * V_src) / dW_dest`` must be the global ``V`` on this
    rank's dest tokens that its CP rank consumes (zero on the others)."""
    device, rank = current_device(), dist.get_rank()
    src_grid, dest_grid = grids(src, dest)
    s_lay, d_lay = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    cp, cd = d_lay.axis_size("cp"), d_lay.coords(rank).get("cp", 0)
    batch = RaggedBatch(counts, (H,), device)
    V = torch.randn(batch.X.shape, generator=torch.Generator().manual_seed(5)).to(device)
    src_tok, dest_tok = batch.tokens(s_lay, rank), batch.tokens(d_lay, rank)
    local = [counts[s] for s in batch.samples(s_lay, rank)]
    x = batch.X[src_tok].clone().requires_grad_()
    w_dest = batch.W[dest_tok].clone().requires_grad_()
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        y, _ = bridge.communicate_ragged(x, local)
        idx = torch.arange(y.shape[0], device=device)[cd::cp]
        loss = (y.index_select(0, idx) * w_dest.index_select(0, idx)).sum()
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        assert torch.equal(g.detach(), batch.W[src_tok])
        (g * V[src_tok]).sum().backward()
    owned = torch.zeros(y.shape[0], 1, device=device)
    owned[idx] = 1.0
    assert torch.equal(w_dest.grad, V[dest_tok] * owned)
