"""Where a still-running rank is: its Python stacks (``faulthandler`` on ``SIGUSR1``).

Each rank registers ``faulthandler`` on ``SIGUSR1`` writing to its own file; the parent
signals the ranks it waits for and reads the files. A stack is cut at the launcher's
``_child`` frame (the frames below it are the parent's, inherited through ``fork``), and
its innermost frame says where the rank is: in a ``torch.distributed`` call, in the test
kit's wait for its peers (it finished), or anywhere else (it hangs outside a collective).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import time

__all__ = ["Stack", "collect_stacks", "stack_path"]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')
# Test-kit frames where a rank that finished its work waits for its peers
# (world_runner._Meeting.meet_after, launcher._child).
_WAITING = ("meet_after", "_child")


def stack_path(init_file: str, rank: int) -> str:
    """The file rank ``rank`` of the world rendezvousing at ``init_file`` dumps into."""
    return f"{init_file}.stacks.{rank}"


class Stack:
    """One rank's dumped stacks: ``text`` (cut at ``_child``) and ``where`` (one line)."""

    def __init__(self, rank: int, raw: str):
        self.rank = rank
        kept = []
        for line in raw.strip().splitlines():
            kept.append(line)
            if line.strip().endswith(" in _child"):
                break
        self.text = "\n".join(kept)
        frames = [m for m in (_FRAME.search(line) for line in kept) if m]
        self.top = frames[0] if frames else None

    @property
    def waiting(self) -> bool:
        """The rank finished its work and waits for its peers (or is in a collective)."""
        return self.in_collective or (self.top is not None and self.top["fn"] in _WAITING)

    @property
    def in_collective(self) -> bool:
        return self.top is not None and "torch/distributed" in self.top["file"]

    @property
    def where(self) -> str:
        if self.top is None:
            return f"rank {self.rank}: no stack written"
        place = f"{self.top['file']}:{self.top['line']} in {self.top['fn']}"
        if self.in_collective:
            state = "in a torch.distributed call"
        elif self.top["fn"] in _WAITING:
            state = "finished, waiting for the other ranks"
        else:
            state = "outside any collective"
        return f"rank {self.rank} is at {place} ({state})"


def collect_stacks(procs: list[mp.Process], ranks: list[int], init_file: str) -> list[Stack]:
    """The stacks of those ``ranks`` still alive (one ``SIGUSR1`` each, 0.5 s to write)."""
    asked = []
    for rank in ranks:
        if procs[rank].is_alive():
            try:
                os.kill(procs[rank].pid, signal.SIGUSR1)
                asked.append(rank)
            except ProcessLookupError:
                pass
    time.sleep(0.5)  # faulthandler writes from the signal handler, at once
    out = []
    for rank in asked:
        try:
            with open(stack_path(init_file, rank)) as f:
                out.append(Stack(rank, f.read()))
        except OSError:
            out.append(Stack(rank, ""))
    return out


def describe(stacks: list[Stack]) -> str:
    """One ``where`` line per rank, then the stacks."""
    lines = [s.where for s in stacks]
    for s in stacks:
        lines.append(f"--- stacks of rank {s.rank} ---\n{s.text or '(none written)'}")
    return "\n".join(lines)


def culprit(stacks: list[Stack]) -> int | None:
    """The one rank that is not waiting for its peers, if exactly one is."""
    busy = [s.rank for s in stacks if not s.waiting]
    return busy[0] if len(busy) == 1 else None
