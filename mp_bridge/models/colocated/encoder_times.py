"""Per-rank encoder time before and after balancing: what ``mp-bridge demo --balance`` prints.

:func:`encoder_times` runs on every rank of an initialized world (collective). It builds
the encoder and projection of one seeded :class:`ReferenceMimo` on an encoder grid
(``tp × dp`` over the whole world), then for each batch times this rank's encoder forward
plus backward (``sum`` of the projected rows) twice: on its own encoder DP shard, and on
the images :class:`~mp_bridge.comm.bridge.execution.balancer.ImageBalancer` gives its replica (cost
``t² + c·t``, ``c = cfg.encoder_cost_c``). The image moves are outside the timed region:
the times are the encoder work that balancing evens out. Each time is the median of
``repeats`` runs after a barrier, summed over the batches; every rank returns every rank's
times, and the plan's estimated ``max/mean`` before and after (summed over the batches).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import check_int
from mp_bridge.comm import ImageBalancer
from mp_bridge.grid import AXIS_NAMES, GridLayout, destroy_grid, make_grid
from mp_bridge.models.data.batch import MimoBatch
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.parallel.encoder import TPEncoder, TPProjection
from mp_bridge.models.reference.model import ReferenceMimo
from mp_bridge.table import format_table

__all__ = ["EncoderTimes", "encoder_times", "format_encoder_times"]


@dataclass(frozen=True)
class EncoderTimes:
    """Seconds per rank (world order) of encoder forward+backward, before/after balancing,
    and the balance plans' estimated cost ``max/mean`` over the replicas."""

    before: tuple[float, ...]
    after: tuple[float, ...]
    estimated_before: float
    estimated_after: float

    @staticmethod
    def ratio(times: Sequence[float]) -> float:
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0


def encoder_times(
    cfg: MimoConfig,
    batches: Sequence[MimoBatch],
    *,
    encoder_tp: int,
    encoder_dp: int,
    axis_names: Sequence[str] = AXIS_NAMES,
    repeats: int = 3,
    seed: int = 0,
    device: torch.device | None = None,
) -> EncoderTimes:
    """Time the encoder on every rank before and after balancing (module docstring).
    ``batches``: global ragged batches (the same on every rank)."""
    check_int("repeats", repeats, low=1)
    if not batches or not all(isinstance(b.images, RaggedImages) for b in batches):
        raise ValueError("encoder_times needs ragged batches (RaggedImages): uniform images "
                         "weigh the same on every replica")  # fmt: skip
    device = device or torch.device("cpu")
    torch.manual_seed(seed)
    reference = ReferenceMimo(cfg)
    grid = make_grid(tp=encoder_tp, dp=encoder_dp, axis_names=axis_names, create=("tp", "dp"))
    try:
        tp_group = grid.get_pg("tp")
        encoder = TPEncoder.from_full(reference.encoder, cfg, tp_group=tp_group, device=device)
        projection = TPProjection.from_full(
            reference.projection, cfg, tp_group=tp_group, device=device
        )
        balancer = ImageBalancer(
            dp_group=grid.get_pg("dp"), count_group=dist.group.WORLD, c=cfg.encoder_cost_c
        )
        replica = GridLayout.from_grid(grid).coords(dist.get_rank())["dp"]

        def timed(images: RaggedImages) -> float:
            runs = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                projection(encoder(images)).sum().backward()
                runs.append(time.perf_counter() - start)
            return statistics.median(runs)

        before = after = 0.0
        loads_before, loads_after = [0.0] * encoder_dp, [0.0] * encoder_dp
        for batch in batches:
            mine = batch.encoder_shard(replica, encoder_dp).to(device)
            before += timed(mine)
            rows, plan = balancer.balance(mine.tokens, mine.tokens_per_image)
            sizes = torch.tensor(plan.tokens_after(replica), dtype=torch.int64)
            after += timed(RaggedImages(rows, sizes, torch.ones(len(sizes), dtype=torch.int64)))
            loads_before = [a + b for a, b in zip(loads_before, plan.loads_before)]
            loads_after = [a + b for a, b in zip(loads_after, plan.loads_after)]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (before, after))
    finally:
        destroy_grid(grid)
    return EncoderTimes(
        before=tuple(b for b, _ in every),
        after=tuple(a for _, a in every),
        estimated_before=EncoderTimes.ratio(loads_before),
        estimated_after=EncoderTimes.ratio(loads_after),
    )


def format_encoder_times(times: EncoderTimes) -> str:
    """A per-rank table (ms) and the ``max/mean`` before and after balancing."""
    rows = [("rank", "encoder fwd+bwd before (ms)", "after (ms)")]
    rows += [
        (str(r), f"{1e3 * b:.2f}", f"{1e3 * a:.2f}")
        for r, (b, a) in enumerate(zip(times.before, times.after))
    ]
    ratio = EncoderTimes.ratio
    return (
        format_table(rows)
        + f"\nmeasured max/mean {ratio(times.before):.2f} -> {ratio(times.after):.2f} "
        f"(max {1e3 * max(times.before):.2f} -> {1e3 * max(times.after):.2f} ms); estimated "
        f"cost max/mean over the encoder DP replicas {times.estimated_before:.2f} -> "
        f"{times.estimated_after:.2f}"
    )
