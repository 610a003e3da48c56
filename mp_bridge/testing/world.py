"""Run many test cases inside one distributed world (one start-up per test file).

Usage in a test module::

    world = DistributedWorld(8)

    @world.case
    def test_all_reduce_sums():      # runs on every rank of the shared 8-rank world
        ...

    @world.case(world_size=6)        # a second world, of 6 ranks, in the same module
    def test_groups_of_three():
        ...

    @world.parametrize("cp, sp", [(2, False), (4, True)])   # one case (and test id) per set
    def test_shard(cp, sp):
        ...

The first test of a world size that pytest runs starts that world, runs *every* case
registered at that size on every rank (in registration order), and caches the per-rank
outcomes; each test then reports its own case. Per case:

- a case that passed stays passed, whatever happens to later cases;
- a failing case names its rank and traceback (the first cause: a rank whose error is a
  lost connection is named only if no other rank failed);
- ``pytest.skip`` inside a case skips that case;
- the ranks meet after every case; when a case failed on any rank, or some ranks ended
  a case while others did not within ``abort_grace_s`` (stuck in a collective, or
  hanging: their stacks are in the report, via ``faulthandler``), or a rank died
  (named, with its exit code or signal), that world is stopped and a *new* world runs
  the remaining cases, so a rank that failed before a collective cannot misalign the
  collectives of later cases.

Backend: ``MP_BRIDGE_BACKEND`` (default ``gloo``). Under ``torchrun`` the cases run in
the launched processes themselves, and a world of another size than the launched one is
skipped with its reason, e.g. on 8 GPUs::

    MP_BRIDGE_BACKEND=nccl torchrun --nproc-per-node 8 -m pytest tests/functional

Start methods (``start_method``): under fork the ranks inherit the world; under forkserver /
spawn it travels as a reference to the module that built it (``world_registry``).
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mp_bridge.checks import check_int, check_positive_float
from mp_bridge.testing.case_progress import CaseProgress, Outcome
from mp_bridge.testing.launcher import (
    DEFAULT_TIMEOUT_S,
    DistributedError,
    device_under_test,
    failure_severity,
    rank_device_type,
    run_distributed,
    under_torchrun,
)
from mp_bridge.testing.start_method import rank_context
from mp_bridge.testing.world_registry import find_world, module_reference

__all__ = ["DistributedWorld", "world_backend"]


def _run_world_cases(world: DistributedWorld, size: int, todo: list[str], queue, meet):
    """The function every rank of a world runs (module level, so it pickles)."""
    world._queue, world._meet = queue, meet
    return world._run_cases(size, todo)


def world_backend() -> str:
    """The backend tests use: ``MP_BRIDGE_BACKEND`` (``gloo`` or ``nccl``), default gloo."""
    backend = os.environ.get("MP_BRIDGE_BACKEND", "gloo").lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"MP_BRIDGE_BACKEND={backend!r}; use 'gloo' or 'nccl'")
    return backend


def _check_size(size: Any, name: str) -> int:
    return check_int(name, size, low=1, fix="the number of ranks")


def _label(values: tuple, names: list[str], index: int) -> str:
    """A pytest-like id: scalars as written, anything else as ``name<index>``."""
    parts = []
    for name, value in zip(names, values):
        simple = value is None or isinstance(value, (bool, int, float, str))
        parts.append(str(value) if simple else f"{name}{index}")
    return "-".join(parts)


class DistributedWorld:
    """Lazily started worlds shared by the cases of one module, one world per world size.

    ``world_size`` is the default size of a case; ``case(world_size=n)`` and
    ``parametrize(..., world_size=n)`` register cases at other sizes. Each size used
    starts its world once (at the first test of that size) and runs all of its cases.
    """

    def __init__(
        self, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S, abort_grace_s: float = 20
    ):
        self.world_size = _check_size(world_size, "world_size")
        self.timeout_s = check_positive_float("timeout_s", timeout_s, fix="seconds")
        self.abort_grace_s = check_positive_float("abort_grace_s", abort_grace_s, fix="seconds")
        self._cases: dict[int, list[tuple[str, Callable[[], Any]]]] = {}
        self._size_of: dict[str, int] = {}
        self._outcomes: dict[int, dict[str, list[Outcome]]] = {}
        self._failure: dict[int, BaseException] = {}
        self._queue: Any = None
        self._meet: Any = None
        # Built on import: ranks started by forkserver/spawn find it by this reference.
        self._ref = module_reference(self, sys._getframe(1))

    def __reduce__(self) -> tuple[Any, tuple[str, int]]:
        if self._ref is None:
            raise TypeError(
                "this DistributedWorld was built inside a function, so ranks started by "
                "forkserver/spawn (any machine with CUDA) cannot import it; build it at "
                "module level, or run with MP_BRIDGE_START_METHOD=fork on a CPU machine"
            )
        return find_world, self._ref

    @property
    def sizes(self) -> tuple[int, ...]:
        """The world sizes that have registered cases, in registration order."""
        return tuple(self._cases)

    def case(self, fn: Callable[[], Any] | None = None, *, world_size: int | None = None) -> Any:
        """Register ``fn`` (no arguments) to run on every rank; return a pytest test.

        Use as ``@world.case`` (the default size) or ``@world.case(world_size=6)``.
        """
        if fn is None:
            return functools.partial(self.case, world_size=world_size)
        name = fn.__name__
        self._register(name, fn, world_size)

        @functools.wraps(fn)
        def test() -> None:
            self.check(name)

        return test

    def parametrize(
        self,
        argnames: str | Sequence[str],
        argvalues: Iterable[Any],
        *,
        ids: Sequence[str] | None = None,
        world_size: int | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[[str], None]]:
        """Register ``fn(**params)`` once per parameter set, as ``pytest.mark.parametrize``.

        ``argnames``: ``"a, b"`` or ``("a", "b")``; ``argvalues``: one value (one name) or
        one tuple per set. Each set is its own case named ``fn.__name__ + "[id]"`` and its
        own pytest test id (``ids`` or ones made from the values).
        """
        import pytest

        names = (
            [n.strip() for n in argnames.split(",")]
            if isinstance(argnames, str)
            else list(argnames)
        )
        sets = [tuple(v) if len(names) > 1 else (v,) for v in argvalues]
        if ids is not None and len(ids) != len(sets):
            raise ValueError(f"ids has {len(ids)} entries for {len(sets)} parameter sets")
        for i, values in enumerate(sets):
            if len(values) != len(names):
                raise ValueError(
                    f"parameter set {i} {values!r} has {len(values)} values for names {names}"
                )

        def decorator(fn: Callable[..., Any]) -> Callable[[str], None]:
            labels = [ids[i] if ids else _label(v, names, i) for i, v in enumerate(sets)]
            if len(set(labels)) != len(labels):
                raise ValueError(f"{fn.__name__}: parameter ids {labels} are not unique; pass ids")
            for label, values in zip(labels, sets):
                case = functools.partial(fn, **dict(zip(names, values)))
                self._register(f"{fn.__name__}[{label}]", case, world_size)

            def test(world_case: str) -> None:
                self.check(f"{fn.__name__}[{world_case}]")

            test.__name__, test.__qualname__ = fn.__name__, fn.__qualname__
            test.__module__, test.__doc__ = fn.__module__, fn.__doc__
            return pytest.mark.parametrize("world_case", labels)(test)

        return decorator

    def check(self, name: str) -> list[Any]:
        """Per-rank return values of case ``name``; raises with the failing rank's traceback."""
        if name not in self._size_of:
            raise KeyError(f"no case {name!r} is registered; known: {sorted(self._size_of)}")
        outcomes = self._run(self._size_of[name])[name]
        errors = [r for r, (status, _) in enumerate(outcomes) if status in ("error", "died")]
        if errors:  # name the first cause, not a rank that lost its connection to it
            rank = min(errors, key=lambda r: (failure_severity(*outcomes[r]), r))
            raise DistributedError(
                f"case {name!r} failed on rank {rank}:\n{outcomes[rank][1]}", rank
            )
        for rank, (status, value) in enumerate(outcomes):
            if status == "skip":  # the others may have been left in a collective: fine
                import pytest

                pytest.skip(f"case {name!r} skipped on rank {rank}: {value}")
        hung = [r for r, (status, _) in enumerate(outcomes) if status == "hung"]
        for rank, (status, value) in [(r, outcomes[r]) for r in hung] + list(enumerate(outcomes)):
            if status in ("hung", "not_run"):
                message = f"case {name!r} did not finish on rank {rank}: {value}"
                raise DistributedError(message, rank)
        return [value for _, value in outcomes]

    def _register(self, name: str, fn: Callable[[], Any], world_size: int | None) -> None:
        size = self.world_size if world_size is None else _check_size(world_size, "world_size")
        if name in self._size_of:
            raise ValueError(f"case {name!r} registered twice; give each case a unique name")
        if size in self._outcomes:
            raise RuntimeError(f"case {name!r} registered after the {size}-rank world ran")
        self._size_of[name] = size
        self._cases.setdefault(size, []).append((name, fn))

    # ----------------------------------------------------------------- running
    def _run(self, size: int) -> dict[str, list[Outcome]]:
        if size in self._failure:
            raise DistributedError(
                f"the shared {size}-rank world failed earlier: {self._failure[size]}"
            )
        if under_torchrun() and int(os.environ["WORLD_SIZE"]) != size:
            import pytest

            pytest.skip(f"needs {size} ranks, torchrun launched {os.environ['WORLD_SIZE']}")
        if size not in self._outcomes:
            try:
                if under_torchrun():
                    self._outcomes[size] = self._run_in_process(size)
                else:
                    self._outcomes[size] = self._run_forked(size)
            except BaseException as exc:
                self._failure[size] = exc
                raise
        return self._outcomes[size]

    def _run_forked(self, size: int) -> dict[str, list[Outcome]]:
        """Run every case of ``size``; after a failed case, a new world runs the rest.

        A rank that failed a case may have skipped collectives its peers are waiting in
        (or would pair with the next case's): so the ranks meet after every case, and
        a failed case ends the world; the cases after it run in a fresh one. Each world
        runs at least one case, so at most one world per case is started.
        """
        names = [name for name, _ in self._cases[size]]
        out: dict[str, list[Outcome]] = {}
        while len(out) < len(names):
            todo = [n for n in names if n not in out]
            ended = self._run_world(size, todo)
            if not ended:  # cannot happen (a world ends its first case), but never loop
                raise DistributedError(f"a {size}-rank world ended none of {todo}")
            out.update(ended)
        return out

    def _run_world(self, size: int, todo: list[str]) -> dict[str, list[Outcome]]:
        """Run the cases ``todo`` in one world; outcomes of those that ended (>= 1)."""
        ctx = rank_context(rank_device_type(world_backend()))
        # A SimpleQueue writes synchronously (no feeder thread), so nothing is lost when a
        # rank exits right after reporting.
        self._queue = ctx.SimpleQueue()
        self._meet = ctx.Array("i", 2 * len(todo))  # per case: ranks ended, ranks failed
        progress = CaseProgress(self._queue, size, self.abort_grace_s)
        try:
            per_rank = run_distributed(
                _run_world_cases,
                size,
                self,
                size,
                todo,
                self._queue,
                self._meet,
                backend=world_backend(),
                timeout_s=self.timeout_s,
                should_abort=progress.abort_reason,
                start_method=ctx.get_start_method(),
            )
        except DistributedError as exc:
            progress.drain()
            return self._partial_outcomes(size, todo, progress, exc)
        finally:
            self._queue = self._meet = None
        out = {}
        for name in todo:
            if all(name in rank_result for rank_result in per_rank):
                out[name] = [rank_result[name] for rank_result in per_rank]
        return out

    def _partial_outcomes(
        self, size: int, todo: list[str], progress: CaseProgress, exc: DistributedError
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

    def _run_cases(self, size: int, todo: list[str]) -> dict[str, Outcome]:
        import pytest

        results: dict[str, Outcome] = {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        cases = dict(self._cases[size])
        for i, name in enumerate(todo):
            self._report(rank, name, "start", "")
            torch.manual_seed(1234)
            try:
                results[name] = ("ok", cases[name]())
            except pytest.skip.Exception as skip:
                results[name] = ("skip", str(skip.msg))
            except Exception:  # noqa: BLE001 - reported per case
                results[name] = ("error", traceback.format_exc())
            self._report(rank, name, *results[name])
            failed = results[name][0] == "error"
            if self._meet is not None and self._meet_after(i, size, failed):
                break  # a rank failed this case: the remaining cases run in a new world
        return results

    def _report(self, rank: int, name: str, status: str, value: Any) -> None:
        """Stream a case's outcome to the parent (a result only when it pickles on CPU)."""
        if self._queue is None:
            return
        try:
            blob = pickle.dumps(value) if status == "ok" else value
            if status == "ok" and isinstance(value, torch.Tensor) and value.device.type != "cpu":
                blob = pickle.dumps(None)
        except Exception:  # noqa: BLE001 - the result comes back with the world's, if it ends
            blob = pickle.dumps(None)
        self._queue.put((rank, name, status, blob))

    def _meet_after(self, i: int, size: int, failed: bool) -> bool:
        """Wait until every rank ended case ``i``; True when one of them failed it."""
        with self._meet.get_lock():
            self._meet[2 * i] += 1
            self._meet[2 * i + 1] += int(failed)
        while self._meet[2 * i] < size:  # a rank stuck in the case: the parent stops us
            time.sleep(0.001)
        return self._meet[2 * i + 1] > 0

    def _run_in_process(self, size: int) -> dict[str, list[Outcome]]:

        world = int(os.environ["WORLD_SIZE"])
        if not dist.is_initialized():
            backend = world_backend()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            elif device_under_test().type == "cuda":  # the one-GPU mode under torchrun
                torch.cuda.set_device(device_under_test())
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.timeout_s))
        mine = self._run_cases(size, [name for name, _ in self._cases[size]])
        gathered: list[dict[str, Outcome] | None] = [None] * world
        # Only statuses travel: results may hold device tensors.
        statuses = {n: (s, v if s != "ok" else None) for n, (s, v) in mine.items()}
        dist.all_gather_object(gathered, statuses)
        out = {}
        for name, _ in self._cases[size]:
            per_rank = [g[name] for g in gathered]  # type: ignore[index]
            per_rank[dist.get_rank()] = mine[name]
            out[name] = per_rank
        return out
