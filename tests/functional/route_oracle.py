"""Oracle for ``ColocatedBridgeCommunicator.route`` (``test_route``, 8 and 6 ranks).

Every rank builds the same global batch from one seed: per sample a sequence length
(plain: all ``S``; packed: odd lengths), a random set of image positions (some samples
none), image tokens ``X`` ``[sum(counts), H]`` sample-major and loss weights ``W``. The
data contract (contiguous sample blocks by DP index) names each rank's encoder tokens and
LLM samples by slicing; the local shard is an independent padded cut written here
(:func:`ref_local_tokens`), never the code under test.

Loss: each LLM rank takes ``sum(W[g] * y[g])`` over its rows. LLM TP replicas without SP
hold the same rows and count once (Megatron's TP convention), so the single-process
gradient is ``dL/dX = W`` on every encoder rank (each TP replica). Tolerance: none
(``torch.equal``): forward and backward only copy rows.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import CollectiveCounter, current_device

H = 3
ORDER = ("tp", "cp", "pp", "dp")


class RouteBatch:
    """The global batch: lengths, image positions, tokens ``X`` and weights ``W``."""

    def __init__(self, n_samples: int, *, packed: bool, seed: int = 7, plain_len: int = 11):
        gen = torch.Generator().manual_seed(seed)
        odd = [5, 9, 3, 13, 7, 1, 11, 15]
        self.lengths = [odd[i % len(odd)] if packed else plain_len for i in range(n_samples)]
        self.positions = []
        for i, n in enumerate(self.lengths):
            count = 0 if i % 5 == 3 else int(torch.randint(0, n + 1, (1,), generator=gen))
            self.positions.append(sorted(torch.randperm(n, generator=gen)[:count].tolist()))
        self.counts = [len(p) for p in self.positions]
        self.starts = list(itertools.accumulate([0, *self.counts]))
        device = current_device()
        self.X = torch.randn(self.starts[-1], H, generator=gen).to(device)
        self.W = torch.randn(self.starts[-1], H, generator=gen).to(device)
        self.packed = packed

    def samples(self, layout: GridLayout, rank: int) -> range:
        per = len(self.lengths) // layout.axis_size("dp")
        dp = layout.coords(rank)["dp"]
        return range(dp * per, (dp + 1) * per)

    def token_rows(self, samples: range) -> slice:
        return slice(self.starts[samples.start], self.starts[samples.stop])

    def image_mask(self, samples: range) -> tuple[torch.Tensor, list[int] | None]:
        rows = []
        for s in samples:
            m = torch.zeros(self.lengths[s], dtype=torch.bool)
            m[self.positions[s]] = True
            rows.append(m)
        if self.packed:
            cu = list(itertools.accumulate([0, *(self.lengths[s] for s in samples)]))
            return torch.cat(rows).to(current_device()), cu
        return torch.stack(rows).to(current_device()), None

    def global_row(self, sample: int, pos: int) -> int | None:
        """Row of ``X`` at ``(sample, pos)``, ``None`` for a text position."""
        p = self.positions[sample]
        return self.starts[sample] + p.index(pos) if pos in p else None


def ref_local_tokens(lengths, packed, cp, c, pieces, t):
    """``(sample index, position)`` (``None`` = padding) of shard ``(c, t)`` in local order.

    Independent cut: pad each document (plain: each row, to ``2·cp·pieces``) at its end to
    ``2·cp`` (1 at cp = 1), with SP a padding-only document completing the packed total;
    CP rank ``c`` keeps chunks ``c`` and ``2·cp−1−c`` of ``2·cp``; SP piece ``t`` of ``pieces``.
    """
    f = 2 * cp if cp > 1 else 1

    def cut(seq):
        if cp == 1:
            return seq
        size = len(seq) // (2 * cp)
        return seq[c * size : (c + 1) * size] + seq[(2 * cp - 1 - c) * size : (2 * cp - c) * size]

    def piece(seq):
        size = len(seq) // pieces
        return seq[t * size : (t + 1) * size]

    docs = [[(i, p) for p in range(n)] for i, n in enumerate(lengths)]
    if not packed:  # every row on its own, padded to the SP-and-CP multiple
        out = []
        for d in docs:
            out += piece(cut(d + [None] * (-len(d) % (f * pieces))))
        return out
    docs = [d + [None] * (-len(d) % f) for d in docs]
    total = sum(len(d) for d in docs)
    if total % (f * pieces):
        docs.append([None] * (-total % (f * pieces)))
    return piece([tok for d in docs for tok in cut(d)])


def local_image_rows(batch, d_lay: GridLayout, rank: int, *, packed: bool, sp: bool) -> list[int]:
    """Global rows of ``batch.X`` that LLM rank ``rank`` holds, in its local token order,
    computed in one process from the cut (``ref_local_tokens``)."""
    dc, d_samples = d_lay.coords(rank), batch.samples(d_lay, rank)
    cp, tp = d_lay.axis_size("cp"), d_lay.axis_size("tp")
    pieces = tp if sp and tp > 1 else 1
    local = ref_local_tokens(
        [batch.lengths[s] for s in d_samples], packed, cp, dc["cp"], pieces, dc["tp"] % pieces
    )
    rows = [batch.global_row(d_samples[i], p) for i, p in (tok for tok in local if tok)]
    return [r for r in rows if r is not None]


def grids(src: dict, dest: dict):
    src_grid = make_grid(**src, axis_names=ORDER, create=())
    return src_grid, make_grid(**dest, axis_names=ORDER, create=("cp", "tp"))


def check_route(src: dict, dest: dict, n_samples: int, *, direction: str, sp: bool, packed: bool):
    """Forward rows, gradient, collective counts and bytes on this rank."""
    rank = dist.get_rank()
    batch = RouteBatch(n_samples, packed=packed)
    src_grid, dest_grid = grids(src, dest)
    s_lay, d_lay = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    dc = d_lay.coords(rank)
    cp, tp = d_lay.axis_size("cp"), d_lay.axis_size("tp")
    pieces = tp if sp and tp > 1 else 1
    s_samples, d_samples = batch.samples(s_lay, rank), batch.samples(d_lay, rank)
    x = batch.X[batch.token_rows(s_samples)].clone().requires_grad_()
    tps = [batch.counts[s] for s in s_samples]
    mask, cu = batch.image_mask(d_samples)

    rows = local_image_rows(batch, d_lay, rank, packed=packed, sp=sp)
    consumes = dc["pp"] == 0  # with LLM PP > 1 only the first stage receives image rows
    rows = rows if consumes else []
    want = batch.X[rows]
    row_bytes = H * x.element_size()
    partition = PartitionAdapter(
        cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"), sequence_parallel=sp
    )
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        assert bridge.direction.name == direction, bridge.plan
        bridge.prepare_route()  # the route groups are made once, outside the per-call budget
        with CollectiveCounter() as fwd:
            y = bridge.route(
                x, tokens_per_sample=tps, image_mask=mask, partition=partition, cu_seqlens=cu
            )
        assert torch.equal(y, want), "route rows are not the oracle's local image rows"
        # The layout shard() built (ShardedBatch.layout) replaces cu_seqlens, unparsed.
        layout = partition.layout(mask.shape[-1], cu_seqlens=cu)
        y2 = bridge.route(x.detach(), tokens_per_sample=tps, image_mask=mask, partition=partition,
                          layout=layout)  # fmt: skip
        assert torch.equal(y2, want), "route(layout=...) differs from route(cu_seqlens=...)"
        if consumes:
            _check_partition_contract(partition, batch, mask, cu, d_samples, y, pieces, dc["tp"])
        with CollectiveCounter() as bwd:
            (y * batch.W[rows]).sum().backward()
    assert torch.equal(x.grad, batch.W[batch.token_rows(s_samples)]), "x.grad != W"

    # Budget and exact bytes: rows of the shard this rank does not hold (forward), the
    # gradients of its own tokens it did not consume (backward), plus the metadata: one
    # count row per rank of the world (7 int64: rank, encoder samples, LLM samples, encoder
    # tokens, LLM image tokens, two fingerprints) and, FAN_OUT, the shard id of each image
    # token of every member's LLM batch, padded to the group's largest LLM batch.
    world = dist.get_world_size()
    own = range(batch.token_rows(s_samples).start, batch.token_rows(s_samples).stop)
    members = src["tp"] if direction == "FAN_OUT" else tp * cp * d_lay.axis_size("pp")
    meta = (world - 1) * 8 * 7
    fwd_want, bwd_want = {"all_gather": 1}, {}
    if members > 1 and direction == "FAN_IN":
        fwd_want = {"all_gather": 1, "all_to_all": 1}
        moved = sum(r not in own for r in rows) * row_bytes
        assert fwd.bytes_received("all_to_all") == moved, (fwd.calls, moved)
    if members > 1 and direction == "FAN_OUT":
        per = len(d_samples)  # the encoder batch is k LLM batches of `per` samples
        blocks = range(s_samples.start, s_samples.stop, per)
        widest = max(sum(batch.counts[b : b + per]) for b in blocks)
        fwd_want = {"all_gather": 2 if widest else 1}  # nothing to send: no second gather
        meta += (members - 1) * 8 * widest
    assert fwd.bytes_received("all_gather") == meta, (fwd.calls, meta)
    if members > 1:
        bwd_want = {"all_to_all": 1}
        not_mine = sum(r not in set(rows) for r in own) * row_bytes
        assert bwd.bytes_received("all_to_all") == not_mine, (bwd.calls, not_mine)
    assert fwd.counts() == fwd_want, fwd.calls
    assert bwd.counts() == bwd_want, bwd.calls


def _check_partition_contract(partition, batch, mask, cu, d_samples, y, pieces, tp_rank):
    """``route`` == ``partition.shard(full).embeddings[local image mask]`` (the contract)."""
    full = torch.zeros(*mask.shape, H, device=mask.device)
    flat = [(i, p) for i, s in enumerate(d_samples) for p in batch.positions[s]]
    rows = [batch.global_row(d_samples[i], p) for i, p in flat]
    if batch.packed:
        offsets = cu[:-1]
        full[[offsets[i] + p for i, p in flat]] = batch.X[rows]
        full, ids = full.unsqueeze(0), mask.long().unsqueeze(0)
    else:
        full[[i for i, _ in flat], [p for _, p in flat]] = batch.X[rows]
        ids = mask.long()
    out = partition.shard(full, input_ids=ids, cu_seqlens=cu)
    local_mask = out.input_ids.bool()
    if pieces > 1:  # per-token tensors are CP-local; the SP piece is the TP rank's slice
        local_mask = local_mask.chunk(pieces, dim=1)[tp_rank]
    assert torch.equal(out.embeddings[local_mask], y), "route differs from shard()[mask]"
