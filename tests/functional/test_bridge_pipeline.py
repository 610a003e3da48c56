"""The bridge into a pipelined LLM (dest PP > 1) on 8 ranks: ``communicate``,
``communicate_ragged`` and ``route`` deliver to the first stage only.

Oracle: every rank builds the same global batch from one seed; the data contract
(contiguous sample blocks by DP index) names each rank's encoder and LLM samples by
slicing. A first-stage rank must get exactly its LLM batch, a later-stage rank ``[0, ...]``.
Loss: each first-stage rank takes ``sum(W * y)`` over the sequence positions of its CP
rank (``s % cp == c``: a CP rank's gradient covers its own positions only, as the LLM's
``index_select`` gives), LLM TP replicas counting once; so the single-process gradient of
every encoder rank (each TP replica) is ``W`` of its samples. Tolerance: none
(``torch.equal``): forward and backward only copy rows, and the CP all-reduce adds
disjoint supports (``x + 0``).

Bytes (``CollectiveCounter``): forward, a first-stage rank receives its LLM batch minus the
samples it holds, a later stage nothing; backward, an encoder rank receives the gradient
of its samples it did not consume (all of them on a later stage); never an all-gather of
rows. Layouts: the issue's three (all FAN_IN) plus a FAN_OUT and an EQUAL one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.functional.route_oracle import check_route

world = DistributedWorld(8, timeout_s=600)
ORDER = ("tp", "cp", "pp", "dp")
B, S, H = 8, 4, 3

LAYOUTS = {
    "tp2dp4-tp2pp2dp2": (dict(tp=2, dp=4), dict(tp=2, pp=2, dp=2), "FAN_IN"),
    "tp1dp8-tp1cp2pp2dp2": (dict(tp=1, dp=8), dict(tp=1, cp=2, pp=2, dp=2), "FAN_IN"),
    "tp2dp4-tp2pp4dp1": (dict(tp=2, dp=4), dict(tp=2, pp=4, dp=1), "FAN_IN"),
    "tp4dp2-pp2dp4": (dict(tp=4, dp=2), dict(pp=2, dp=4), "FAN_OUT"),
    "tp2dp4-pp2dp4": (dict(tp=2, dp=4), dict(pp=2, dp=4), "EQUAL"),
}


def _setup(src: dict, dest: dict):
    src_grid = make_grid(**src, axis_names=ORDER, create=())
    dest_grid = make_grid(**dest, axis_names=ORDER, create=("cp", "tp"))
    s, d = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    rank = dist.get_rank()
    sc, dc = s.coords(rank), d.coords(rank)
    s_samples = range(sc["dp"] * B // s.axis_size("dp"), (sc["dp"] + 1) * B // s.axis_size("dp"))
    d_samples = range(dc["dp"] * B // d.axis_size("dp"), (dc["dp"] + 1) * B // d.axis_size("dp"))
    return src_grid, dest_grid, dc, d.axis_size("cp"), s_samples, d_samples


def _cp_mask(n_rows: int, positions, cp: int, c: int) -> torch.Tensor:
    """Rows whose sequence position belongs to CP rank ``c`` (``pos % cp == c``)."""
    return torch.tensor([positions[i] % cp == c for i in range(n_rows)], device=current_device())


def _check_bytes(fwd, bwd, *, got_fwd: int, got_bwd: int, cp: int, consumes: bool):
    assert "all_gather" not in fwd.counts() and "all_gather" not in bwd.counts(), fwd.calls
    assert fwd.counts().get("all_to_all") == 1, fwd.calls
    assert bwd.counts().get("all_to_all") == 1, bwd.calls
    assert fwd.bytes_received("all_to_all") == got_fwd, (fwd.calls, got_fwd)
    assert bwd.bytes_received("all_to_all") == got_bwd, (bwd.calls, got_bwd)
    reduces = 1 if consumes and cp > 1 else 0
    assert bwd.counts().get("all_reduce", 0) == reduces, bwd.calls


@world.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_communicate_delivers_to_the_first_stage(layout):
    src, dest, direction = LAYOUTS[layout]
    src_grid, dest_grid, dc, cp, s_samples, d_samples = _setup(src, dest)
    gen = torch.Generator().manual_seed(3)
    X, W = (torch.randn(B, S, H, generator=gen).to(current_device()) for _ in range(2))
    x = X[s_samples.start : s_samples.stop].clone().requires_grad_()
    consumes = dc["pp"] == 0
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        assert bridge.direction.name == direction and bridge.gather_group is None
        with CollectiveCounter() as fwd:
            y = bridge.communicate(x)
        want = X[d_samples.start : d_samples.stop] if consumes else X[:0]
        assert torch.equal(y, want), (tuple(y.shape), tuple(want.shape))
        keep = _cp_mask(S, list(range(S)), cp, dc["cp"]).view(1, S, 1).to(y.dtype)
        w = W[d_samples.start : d_samples.stop] if consumes else W[:0]
        with CollectiveCounter() as bwd:
            (y * w * keep).sum().backward()
    assert torch.equal(x.grad, W[s_samples.start : s_samples.stop]), "x.grad != W"
    row = S * H * x.element_size()
    held = set(s_samples)
    _check_bytes(
        fwd, bwd, cp=cp, consumes=consumes,
        got_fwd=sum(s not in held for s in d_samples) * row if consumes else 0,
        got_bwd=sum(not (consumes and s in d_samples) for s in s_samples) * row,
    )  # fmt: skip


@world.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_communicate_ragged_delivers_to_the_first_stage(layout):
    src, dest, direction = LAYOUTS[layout]
    src_grid, dest_grid, dc, cp, s_samples, d_samples = _setup(src, dest)
    counts = [3, 0, 5, 1, 2, 4, 0, 6]  # a text-only sample or two
    starts = [sum(counts[:i]) for i in range(B + 1)]
    gen = torch.Generator().manual_seed(4)
    X, W = (torch.randn(starts[-1], H, generator=gen).to(current_device()) for _ in range(2))
    x = X[starts[s_samples.start] : starts[s_samples.stop]].clone().requires_grad_()
    consumes = dc["pp"] == 0
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        with CollectiveCounter() as fwd:
            y, dest_counts = bridge.communicate_ragged(x, [counts[s] for s in s_samples])
        rows = slice(starts[d_samples.start], starts[d_samples.stop]) if consumes else slice(0, 0)
        assert torch.equal(y, X[rows]), (tuple(y.shape), rows)
        want_counts = [counts[s] for s in d_samples] if consumes else []
        assert dest_counts.tolist() == want_counts, (dest_counts, want_counts)
        positions = [p for s in d_samples for p in range(counts[s])] if consumes else []
        keep = _cp_mask(len(positions), positions, cp, dc["cp"]).view(-1, 1).to(y.dtype)
        with CollectiveCounter() as bwd:
            (y * W[rows] * keep).sum().backward()
    assert torch.equal(x.grad, W[starts[s_samples.start] : starts[s_samples.stop]]), "x.grad"
    row, held = H * x.element_size(), set(s_samples)
    # forward: a 32-byte header from every other rank, FAN_IN 8 bytes per moved count
    moved = [s for s in d_samples if s not in held] if consumes else []
    assert fwd.bytes_received("all_gather") == 7 * 32, fwd.calls
    fwd_tokens = sum(counts[s] for s in moved) * row
    assert fwd.counts().get("all_to_all") == (2 if direction == "FAN_IN" else 1), fwd.calls
    assert fwd.bytes_received("all_to_all") == fwd_tokens + 8 * len(moved), fwd.calls
    bwd_tokens = sum(counts[s] for s in s_samples if not (consumes and s in d_samples)) * row
    assert bwd.counts().get("all_to_all") == 1, bwd.calls
    assert bwd.bytes_received("all_to_all") == bwd_tokens, (bwd.calls, bwd_tokens)
    assert bwd.counts().get("all_reduce", 0) == (1 if consumes and cp > 1 else 0), bwd.calls


ROUTE_CASES = [
    (name, sp, packed)
    for name in ("tp2dp4-tp2pp2dp2", "tp1dp8-tp1cp2pp2dp2", "tp2dp4-tp2pp4dp1", "tp4dp2-pp2dp4")
    for sp, packed in ((False, False), (True, True))
]


@world.parametrize(
    "layout, sp, packed",
    ROUTE_CASES,
    ids=[f"{n}-sp{int(s)}-packed{int(p)}" for n, s, p in ROUTE_CASES],
)
def test_route_delivers_to_the_first_stage_shard(layout, sp, packed):
    src, dest, direction = LAYOUTS[layout]
    check_route(dict(tp=1, dp=1) | src, dest, 8, direction=direction, sp=sp, packed=packed)
