"""Parent-side progress of a :class:`~mp_bridge.testing.DistributedWorld`'s cases."""

from __future__ import annotations

import pickle
import time
from typing import Any

__all__ = ["CaseProgress", "Outcome"]

# ("ok", value), ("error", traceback), ("died", message), ("skip", reason), ("not_run", reason),
# ("hung", message): alive but did not finish the case (named first)
Outcome = tuple[str, Any]


class CaseProgress:
    """Parent-side view of the per-case reports the ranks stream while a world runs.

    Ranks report ``"start"`` and then ``"ok"``/``"error"``/``"skip"`` for each case. The
    world is stopped (``abort_reason``) when a case has ended on some ranks but not on
    the others for ``grace_s`` seconds: after an error, the others are stuck in a
    collective the failing rank never reached; without one, a rank hangs.
    """

    def __init__(self, queue: Any, world_size: int, grace_s: float):
        self.queue, self.world_size, self.grace_s = queue, world_size, grace_s
        self.done: dict[str, dict[int, Outcome]] = {}
        self.started: dict[int, str] = {}  # rank -> the case it started last
        self.first_end: dict[str, float] = {}  # case -> when its first rank ended it
        self.first_error: tuple[str, int, float] | None = None  # (case, rank, when)

    def drain(self) -> None:
        while not self.queue.empty():
            rank, name, status, value = self.queue.get()
            if status == "start":
                self.started[rank] = name
                continue
            if status == "ok":
                value = pickle.loads(value)
            self.done.setdefault(name, {})[rank] = (status, value)
            self.first_end.setdefault(name, time.monotonic())
            if status == "error" and self.first_error is None:
                self.first_error = (name, rank, time.monotonic())

    def abort_reason(self) -> str | None:
        """A message once a case has ended on some ranks and not others for ``grace_s``."""
        self.drain()
        for name, when in self.first_end.items():
            finished = self.done[name]
            if len(finished) == self.world_size or time.monotonic() - when < self.grace_s:
                continue
            stuck = sorted(set(range(self.world_size)) - set(finished))
            failed = sorted(r for r, (st, _) in finished.items() if st == "error")
            cause = f"failed on ranks {failed} and " if failed else "ended on other ranks but "
            return (
                f"case {name!r} {cause}ranks {stuck} did not finish it within "
                f"{self.grace_s:.0f} s (stuck in a collective or hanging); the world was "
                "stopped and the cases after it run in a new world"
            )
        return None
