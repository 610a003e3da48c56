"""How a :class:`~mp_bridge.testing.DistributedWorld`'s cases run, on one resolved
:class:`~mp_bridge.testing.rank_setup.RankSetup`.

- :func:`run_started`: in ranks this process starts (:func:`~.launcher.launch`); the
  ranks meet after every case, and after a failed case (or one that some ranks ended and
  others did not within ``abort_grace_s``, or a dead rank) the world is stopped and a new
  one runs the remaining cases, so a rank that failed before a collective cannot
  misalign the collectives of later cases;
- :func:`run_in_process`: under torchrun, in the launched processes themselves.

Both return, per case, one :data:`~.case_progress.Outcome` per rank. A world's cases are
``world.cases_at(size)``: name -> a function of no arguments, registered in order.
"""

from __future__ import annotations

import datetime
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mp_bridge.testing.case_progress import CaseProgress, Outcome
from mp_bridge.testing.launcher import DistributedError, launch
from mp_bridge.testing.rank_setup import RankSetup

__all__ = ["run_cases", "run_in_process", "run_started"]

Cases = dict[str, Callable[[], Any]]


def _rank_main(world: Any, size: int, todo: list[str], queue: Any, meet: Any):
    """What every started rank runs (module level, so it pickles; the world travels by
    reference under forkserver / spawn)."""
    return run_cases(world.cases_at(size), todo, _Meeting(queue, meet, size))


class _Meeting:
    """A started rank's line to the parent (per-case reports) and to its peers (the
    shared counters they meet on after every case)."""

    def __init__(self, queue: Any, counters: Any, size: int):
        self.queue, self.counters, self.size = queue, counters, size

    def report(self, rank: int, name: str, status: str, value: Any) -> None:
        """Stream a case's outcome to the parent (a result only when it pickles on CPU)."""
        try:
            blob = pickle.dumps(value) if status == "ok" else value
            if status == "ok" and isinstance(value, torch.Tensor) and value.device.type != "cpu":
                blob = pickle.dumps(None)
        except Exception:  # noqa: BLE001 - the result comes back with the world's, if it ends
            blob = pickle.dumps(None)
        self.queue.put((rank, name, status, blob))

    def meet_after(self, i: int, failed: bool) -> bool:
        """Wait until every rank ended case ``i``; True when one of them failed it."""
        with self.counters.get_lock():
            self.counters[2 * i] += 1
            self.counters[2 * i + 1] += int(failed)
        while self.counters[2 * i] < self.size:  # a rank stuck in the case: the parent stops us
            time.sleep(0.001)
        return self.counters[2 * i + 1] > 0


def run_cases(cases: Cases, todo: list[str], meeting: _Meeting | None = None) -> dict[str, Outcome]:
    """This rank's outcomes of ``todo``, in order (seed 1234 before each); with a
    ``meeting``, each is reported and the ranks meet after it, stopping after a failed one."""
    import pytest

    results: dict[str, Outcome] = {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for i, name in enumerate(todo):
        if meeting is not None:
            meeting.report(rank, name, "start", "")
        torch.manual_seed(1234)
        try:
            results[name] = ("ok", cases[name]())
        except pytest.skip.Exception as skip:
            results[name] = ("skip", str(skip.msg))
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = ("error", traceback.format_exc())
        if meeting is None:
            continue
        meeting.report(rank, name, *results[name])
        if meeting.meet_after(i, results[name][0] == "error"):
            break  # a rank failed this case: the remaining cases run in a new world
    return results


def run_started(
    world: Any, size: int, setup: RankSetup, *, timeout_s: float, abort_grace_s: float
) -> dict[str, list[Outcome]]:
    """Run every case of ``size`` in started ranks; after a failed case, a new world runs
    the rest.

    A rank that failed a case may have skipped collectives its peers are waiting in
    (or would pair with the next case's): so the ranks meet after every case, and
    a failed case ends the world; the cases after it run in a fresh one. Each world
    runs at least one case, so at most one world per case is started.
    """
    names = list(world.cases_at(size))
    out: dict[str, list[Outcome]] = {}
    while len(out) < len(names):
        todo = [n for n in names if n not in out]
        ended = _run_one_world(world, size, todo, setup, timeout_s, abort_grace_s)
        if not ended:  # cannot happen (a world ends its first case), but never loop
            raise DistributedError(f"a {size}-rank world ended none of {todo}")
        out.update(ended)
    return out


def _run_one_world(
    world: Any, size: int, todo: list[str], setup: RankSetup, timeout_s: float, grace_s: float
) -> dict[str, list[Outcome]]:
    """Run the cases ``todo`` in one world; outcomes of those that ended (>= 1)."""
    ctx = setup.context()
    # A SimpleQueue writes synchronously (no feeder thread), so nothing is lost when a
    # rank exits right after reporting.
    queue = ctx.SimpleQueue()
    counters = ctx.Array("i", 2 * len(todo))  # per case: ranks ended, ranks failed
    progress = CaseProgress(queue, size, grace_s)
    try:
        per_rank = launch(
            setup,
            _rank_main,
            size,
            world,
            size,
            todo,
            queue,
            counters,
            timeout_s=timeout_s,
            should_abort=progress.abort_reason,
        )
    except DistributedError as exc:
        progress.drain()
        return _partial_outcomes(size, todo, progress, exc)
    out = {}
    for name in todo:
        if all(name in rank_result for rank_result in per_rank):
            out[name] = [rank_result[name] for rank_result in per_rank]
    return out


def _partial_outcomes(
    size: int, todo: list[str], progress: CaseProgress, exc: DistributedError
) -> dict[str, list[Outcome]]:
    """After a world was stopped: the cases that ended as reported, then the case it
    stopped in (the dead or failing rank named, the stuck ranks with ``exc``)."""
    out: dict[str, list[Outcome]] = {}
    for name in todo:
        reports = progress.done.get(name, {})
        if len(reports) == size:
            out[name] = [reports[r] for r in range(size)]
            continue
        started = name in progress.started.values() or bool(reports)
        if not started and out == {} and not progress.started:
            started = True  # the world never reached a case: report it on the first
        if not started:
            break
        dead = exc.rank
        outcomes: list[Outcome] = []
        for r in range(size):
            if r in reports:
                outcomes.append(reports[r])
            elif r == dead and exc.hanging:
                outcomes.append(("hung", str(exc)))
            elif r == dead:
                outcomes.append(("died", f"rank {r} during case {name!r}: {exc}"))
            else:
                outcomes.append(("not_run", str(exc)))
        out[name] = outcomes
        break
    return out


def run_in_process(
    world: Any, size: int, setup: RankSetup, *, timeout_s: float
) -> dict[str, list[Outcome]]:
    """Under torchrun: run every case of ``size`` in this launched process, then gather
    every rank's statuses (only statuses travel: results may hold device tensors)."""
    if not dist.is_initialized():
        setup.bind_device(setup.local_rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(setup.backend, timeout=timeout)
    cases = world.cases_at(size)
    mine = run_cases(cases, list(cases))
    gathered: list[dict[str, Outcome] | None] = [None] * dist.get_world_size()
    statuses = {n: (s, v if s != "ok" else None) for n, (s, v) in mine.items()}
    dist.all_gather_object(gathered, statuses)
    out = {}
    for name in cases:
        per_rank = [g[name] for g in gathered]  # type: ignore[index]
        per_rank[dist.get_rank()] = mine[name]
        out[name] = per_rank
    return out
