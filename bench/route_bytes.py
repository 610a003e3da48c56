"""Bytes per rank of ``route`` versus the uniform bridge + CP all-reduce (8 CPU ranks).

Layout: encoder ``tp=2, dp=4`` -> LLM ``tp=2, cp=2, dp=2`` (FAN_IN k=2), SP off and on,
``h = 1024`` fp32, 2 samples per encoder rank, ``S = 1024`` with ``S_img = 256`` image
tokens per sample at random positions (one seed, the same on every rank).

- ``uniform``: ``communicate`` on ``[b, S_img, h]`` (forward all-gather) and its backward
  all-reduce over dest CP of the full ``[b_llm, S_img, h]`` gradient (today's flow).
- ``route``: ``route`` forward (metadata all-gather + ``all_to_all_single``) and backward
  (one ``all_to_all_single``).
``tests/functional/test_route.py`` asserts that ``route``'s token exchanges are exactly at
the bound: the image rows of the rank's shard it does not hold as an encoder rank
(forward) and the gradients of its tokens it did not consume (backward).

KiB received, max and mean over ranks. Run:
``PYTHONPATH=. python bench/route_bytes.py``
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.table import format_table
from mp_bridge.testing import CollectiveCounter, run_distributed

H, S, S_IMG, B_SRC = 1024, 1024, 256, 2
SRC, DEST = dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2)
ORDER = ("tp", "cp", "pp", "dp")


def _rank_bytes(sp: bool) -> dict[str, int]:
    rank = dist.get_rank()
    src_grid = make_grid(**SRC, axis_names=ORDER, create=())
    dest_grid = make_grid(**DEST, axis_names=ORDER, create=("cp", "tp"))
    s_lay, d_lay = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    gen = torch.Generator().manual_seed(0)
    n = B_SRC * s_lay.axis_size("dp")
    masks = torch.zeros(n, S, dtype=torch.bool)
    for i in range(n):
        masks[i, torch.randperm(S, generator=gen)[:S_IMG]] = True
    dest_dp = d_lay.coords(rank)["dp"]
    b_dest = n // d_lay.axis_size("dp")
    x = torch.randn(B_SRC * S_IMG, H, requires_grad=True)
    part = PartitionAdapter(
        cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"), sequence_parallel=sp
    )
    out = {}
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        with CollectiveCounter() as fwd:
            y = bridge.route(
                x,
                tokens_per_sample=[S_IMG] * B_SRC,
                image_mask=masks[dest_dp * b_dest : (dest_dp + 1) * b_dest],
                partition=part,
            )
        with CollectiveCounter() as bwd:
            y.sum().backward()
        out["route fwd"] = fwd.bytes_received()
        out["route meta"] = fwd.bytes_received("all_gather")
        out["route bwd"] = bwd.bytes_received()
        xu = x.detach().reshape(B_SRC, S_IMG, H).requires_grad_()
        with CollectiveCounter() as fwd:
            yu = bridge.communicate(xu)
        with CollectiveCounter() as bwd:
            yu.sum().backward()
        out["uniform fwd"] = fwd.bytes_received()
        out["uniform bwd"] = bwd.bytes_received()
    return out


def main() -> None:
    rows = [("sp", "quantity", "max KiB", "mean KiB")]
    for sp in (False, True):
        per_rank = run_distributed(_rank_bytes, 8, sp)
        for key in ("uniform fwd", "uniform bwd", "route fwd", "route meta", "route bwd"):
            vals = [r[key] / 1024 for r in per_rank]
            rows.append((str(sp), key, f"{max(vals):.1f}", f"{sum(vals) / len(vals):.1f}"))
    print("command: PYTHONPATH=. python bench/route_bytes.py")
    print(f"encoder {SRC} -> llm {DEST}, h={H} fp32, S={S}, S_img={S_IMG}, {B_SRC} samples/rank")
    print(format_table(rows))


if __name__ == "__main__":
    main()
