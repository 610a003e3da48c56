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

Where the ranks run (backend: ``MP_BRIDGE_BACKEND``, default ``gloo``; device; start
method; torchrun or not) is one :class:`~mp_bridge.testing.rank_setup.RankSetup`, resolved
when a world size first runs and used for every world started for it. Under ``torchrun``
the cases run in the launched processes themselves, and a world of another size than the
launched one is skipped with its reason, e.g. on 8 GPUs::

    MP_BRIDGE_BACKEND=nccl torchrun --nproc-per-node 8 -m pytest tests/functional

This module is the pytest face (registration, one test per case, outcomes as pytest
results); :mod:`~mp_bridge.testing.world_runner` runs the cases. Under fork the ranks
inherit the world; under forkserver / spawn it travels as a reference to the module that
built it (:mod:`~mp_bridge.testing.world_registry`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mp_bridge.checks import check_int, check_positive_float
from mp_bridge.testing.case_progress import Outcome
from mp_bridge.testing.launcher import DEFAULT_TIMEOUT_S, DistributedError, failure_severity
from mp_bridge.testing.rank_setup import rank_setup
from mp_bridge.testing.world_registry import find_world, module_reference
from mp_bridge.testing.world_runner import run_in_process, run_started

__all__ = ["DistributedWorld"]


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

    def cases_at(self, size: int) -> dict[str, Callable[[], Any]]:
        """The cases registered at world size ``size``: name -> function, in order."""
        return dict(self._cases[size])

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
        """Every case of ``size``, run once on one set-up resolved for this world."""
        if size in self._failure:
            raise DistributedError(
                f"the shared {size}-rank world failed earlier: {self._failure[size]}"
            )
        if size not in self._outcomes:
            setup = rank_setup()
            if setup.under_torchrun and setup.torchrun_world != size:
                import pytest

                pytest.skip(f"needs {size} ranks, torchrun launched {setup.torchrun_world}")
            try:
                if setup.under_torchrun:
                    self._outcomes[size] = run_in_process(
                        self, size, setup, timeout_s=self.timeout_s
                    )
                else:
                    self._outcomes[size] = run_started(
                        self,
                        size,
                        setup,
                        timeout_s=self.timeout_s,
                        abort_grace_s=self.abort_grace_s,
                    )
            except BaseException as exc:
                self._failure[size] = exc
                raise
        return self._outcomes[size]
