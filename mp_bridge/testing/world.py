"""Run many test cases inside one distributed world (one start-up per test file).

Usage in a test module::

    world = DistributedWorld(8)

    @world.case
    def test_all_reduce_sums():      # runs on every rank of the shared world
        ...

The first test that pytest runs starts the world once, runs *every* registered case on
every rank (in registration order), and caches the per-rank outcomes; each test then
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
from collections.abc import Callable
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
    """A lazily started world of ``world_size`` ranks shared by the cases of one module."""

    def __init__(
        self, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S, abort_grace_s: float = 20
    ):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.abort_grace_s = abort_grace_s
        self._cases: list[tuple[str, Callable[[], Any]]] = []
        self._outcomes: dict[str, list[Outcome]] | None = None
        self._failure: BaseException | None = None
        self._queue: Any = None

    def case(self, fn: Callable[[], Any]) -> Callable[[], None]:
        """Register ``fn`` (no arguments) to run on every rank; return a pytest test."""
        name = fn.__name__
        if any(n == name for n, _ in self._cases):
            raise ValueError(f"case {name!r} registered twice; give each case a unique name")
        self._cases.append((name, fn))

        @functools.wraps(fn)
        def test() -> None:
            self.check(name)

        return test

    def check(self, name: str) -> list[Any]:
        """Per-rank return values of case ``name``; raises with the failing rank's traceback."""
        outcomes = self._run()[name]
        for rank, (status, value) in enumerate(outcomes):
            if status == "error":
                raise DistributedError(f"case {name!r} failed on rank {rank}:\n{value}", rank)
        for rank, (status, value) in enumerate(outcomes):
            if status == "not_run":
                message = f"case {name!r} did not finish on rank {rank}: {value}"
                raise DistributedError(message, rank)
        return [value for _, value in outcomes]

    # ----------------------------------------------------------------- running
    def _run(self) -> dict[str, list[Outcome]]:
        if self._failure is not None:
            raise DistributedError(f"the shared world failed earlier: {self._failure}")
        if self._outcomes is None:
            try:
                if under_torchrun():
                    self._outcomes = self._run_in_process()
                else:
                    self._outcomes = self._run_forked()
            except BaseException as exc:
                self._failure = exc
                raise
        return self._outcomes

    def _run_forked(self) -> dict[str, list[Outcome]]:
        # A SimpleQueue writes synchronously (no feeder thread), so nothing is lost when a
        # rank exits right after reporting.
        self._queue = mp.get_context("fork").SimpleQueue()
        progress = _CaseProgress(self._queue, self.world_size, self.abort_grace_s)
        try:
            per_rank = run_distributed(
                self._run_cases,
                self.world_size,
                backend=world_backend(),
                timeout_s=self.timeout_s,
                should_abort=progress.abort_reason,
            )
        except DistributedError as exc:
            if progress.first_error is None:
                raise
            progress.drain()
            return self._partial_outcomes(progress, str(exc))
        finally:
            self._queue = None
        return {name: [rank_result[name] for rank_result in per_rank] for name, _ in self._cases}

    def _partial_outcomes(self, progress: _CaseProgress, reason: str) -> dict[str, list[Outcome]]:
        """Outcomes after an abort: finished cases as reported, the rest marked not run."""
        out: dict[str, list[Outcome]] = {}
        for name, _ in self._cases:
            reports = progress.done.get(name, {})
            missing: Outcome = ("not_run", reason)
            out[name] = [reports.get(r, missing) for r in range(self.world_size)]
        return out

    def _run_cases(self) -> dict[str, Outcome]:
        results: dict[str, Outcome] = {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, fn in self._cases:
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

    def _run_in_process(self) -> dict[str, list[Outcome]]:
        import pytest

        world = int(os.environ["WORLD_SIZE"])
        if world != self.world_size:
            pytest.skip(f"needs {self.world_size} ranks, torchrun launched {world}")
        if not dist.is_initialized():
            backend = world_backend()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.timeout_s))
        mine = self._run_cases()
        gathered: list[dict[str, Outcome] | None] = [None] * world
        # Only statuses travel: results may hold device tensors.
        statuses = {n: (s, v if s == "error" else None) for n, (s, v) in mine.items()}
        dist.all_gather_object(gathered, statuses)
        out = {}
        for name, _ in self._cases:
            per_rank = [g[name] for g in gathered]  # type: ignore[index]
            per_rank[dist.get_rank()] = mine[name]
            out[name] = per_rank
        return out
