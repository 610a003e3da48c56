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

The first test of a world size that pytest runs starts that world once, runs *every*
case registered at that size on every rank (in registration order), and caches the
per-rank outcomes; each test then
reports its own case, with the failing rank's traceback. Ranks report each case as it
ends, so when a case fails on some ranks while the others stay stuck in a collective
(the usual shape of a distributed bug) the world is stopped ``abort_grace_s`` seconds
later: that case reports the traceback, the cases not reached report that they did not
run, and nothing waits for the full timeout.

Backend: ``MP_BRIDGE_BACKEND`` (default ``gloo``). Under ``torchrun`` (``RANK`` /
``WORLD_SIZE`` set by the launcher) the cases run in the launched processes themselves,
e.g. on 8 GPUs::

    MP_BRIDGE_BACKEND=nccl torchrun --nproc-per-node 8 -m pytest tests/functional
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .launcher import DEFAULT_TIMEOUT_S, DistributedError, run_distributed, under_torchrun

__all__ = ["DistributedWorld", "world_backend"]

Outcome = tuple[str, Any]  # ("ok", value), ("error", traceback) or ("not_run", reason)


def world_backend() -> str:
    """The backend tests use: ``MP_BRIDGE_BACKEND`` (``gloo`` or ``nccl``), default gloo."""
    backend = os.environ.get("MP_BRIDGE_BACKEND", "gloo").lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"MP_BRIDGE_BACKEND={backend!r}; use 'gloo' or 'nccl'")
    return backend


def _check_size(size: Any, name: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name}={size!r} must be a positive int (the number of ranks)")
    return size


def _label(values: tuple, names: list[str], index: int) -> str:
    """A pytest-like id: scalars as written, anything else as ``name<index>``."""
    parts = []
    for name, value in zip(names, values):
        simple = value is None or isinstance(value, (bool, int, float, str))
        parts.append(str(value) if simple else f"{name}{index}")
    return "-".join(parts)


class _CaseProgress:
    """Parent-side view of the per-case reports the ranks stream while the world runs."""

    def __init__(self, queue: Any, world_size: int, grace_s: float):
        self.queue, self.world_size, self.grace_s = queue, world_size, grace_s
        self.done: dict[str, dict[int, Outcome]] = {}
        self.first_error: tuple[str, int, float] | None = None  # (case, rank, when)

    def drain(self) -> None:
        while not self.queue.empty():
            rank, name, status, text = self.queue.get()
            self.done.setdefault(name, {})[rank] = (status, text)
            if status == "error" and self.first_error is None:
                self.first_error = (name, rank, time.monotonic())

    def abort_reason(self) -> str | None:
        """A message once a failed case has left other ranks behind for ``grace_s``."""
        self.drain()
        if self.first_error is None:
            return None
        name, rank, when = self.first_error
        finished = self.done.get(name, {})
        if len(finished) == self.world_size or time.monotonic() - when < self.grace_s:
            return None
        stuck = sorted(set(range(self.world_size)) - set(finished))
        return (
            f"case {name!r} failed on rank {rank} and ranks {stuck} did not finish it within "
            f"{self.grace_s:.0f} s (probably waiting in a collective); the world was stopped"
        )


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
        self.timeout_s = timeout_s
        self.abort_grace_s = abort_grace_s
        self._cases: dict[int, list[tuple[str, Callable[[], Any]]]] = {}
        self._size_of: dict[str, int] = {}
        self._outcomes: dict[int, dict[str, list[Outcome]]] = {}
        self._failure: dict[int, BaseException] = {}
        self._queue: Any = None

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
        for rank, (status, value) in enumerate(outcomes):
            if status == "error":
                raise DistributedError(f"case {name!r} failed on rank {rank}:\n{value}", rank)
        for rank, (status, value) in enumerate(outcomes):
            if status == "not_run":
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
        cases = self._cases[size]
        # A SimpleQueue writes synchronously (no feeder thread), so nothing is lost when a
        # rank exits right after reporting.
        self._queue = mp.get_context("fork").SimpleQueue()
        progress = _CaseProgress(self._queue, size, self.abort_grace_s)
        try:
            per_rank = run_distributed(
                self._run_cases,
                size,
                size,
                backend=world_backend(),
                timeout_s=self.timeout_s,
                should_abort=progress.abort_reason,
            )
        except DistributedError as exc:
            if progress.first_error is None:
                raise
            progress.drain()
            return self._partial_outcomes(size, progress, str(exc))
        finally:
            self._queue = None
        return {name: [rank_result[name] for rank_result in per_rank] for name, _ in cases}

    def _partial_outcomes(
        self, size: int, progress: _CaseProgress, reason: str
    ) -> dict[str, list[Outcome]]:
        """Outcomes after an abort: finished cases as reported, the rest marked not run."""
        out: dict[str, list[Outcome]] = {}
        for name, _ in self._cases[size]:
            reports = progress.done.get(name, {})
            missing: Outcome = ("not_run", reason)
            out[name] = [reports.get(r, missing) for r in range(size)]
        return out

    def _run_cases(self, size: int) -> dict[str, Outcome]:
        results: dict[str, Outcome] = {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, fn in self._cases[size]:
            torch.manual_seed(1234)
            try:
                results[name] = ("ok", fn())
                report = (rank, name, "ok", "")
            except Exception:  # noqa: BLE001 - reported per case
                text = traceback.format_exc()
                results[name] = ("error", text)
                report = (rank, name, "error", text)
            if self._queue is not None:
                self._queue.put(report)
        return results

    def _run_in_process(self, size: int) -> dict[str, list[Outcome]]:
        import pytest

        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            pytest.skip(f"needs {size} ranks, torchrun launched {world}")
        if not dist.is_initialized():
            backend = world_backend()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.timeout_s))
        mine = self._run_cases(size)
        gathered: list[dict[str, Outcome] | None] = [None] * world
        # Only statuses travel: results may hold device tensors.
        statuses = {n: (s, v if s == "error" else None) for n, (s, v) in mine.items()}
        dist.all_gather_object(gathered, statuses)
        out = {}
        for name, _ in self._cases[size]:
            per_rank = [g[name] for g in gathered]  # type: ignore[index]
            per_rank[dist.get_rank()] = mine[name]
            out[name] = per_rank
        return out
