"""``run_distributed``: run a function on N local processes with an initialized world.

Processes start by ``fork`` where that is safe and by ``forkserver`` where CUDA makes
fork unsafe (the rule: :mod:`mp_bridge.testing.rank_setup`), rendezvous through a
``file://`` store in a fresh temp dir (no ports), and send their return value back
pickled. Every rank gets the caller's environment as it is at the call (a forkserver
started earlier would otherwise hand out its own) and, with ``MP_BRIDGE_TEST_DEVICE``
naming a CUDA device, that device as its current one
(:func:`~mp_bridge.testing.rank_setup.current_device`). Any
failing rank raises in the caller with that rank's traceback; a rank that hangs or dies
fails the call within ``timeout_s`` and every child is killed, so no process is left
behind.

The rank named is the *first cause*, not a victim: when a rank dies, its peers fail too
("Connection closed by peer", or a SIGABRT inside gloo). After the first failure the
parent keeps watching for ``FAILURE_GRACE_S`` and names, in this order, a rank that died
other than by SIGABRT (exit code or signal), a rank whose error is not a lost
connection, a rank that aborted, then any other; the others are listed after it. A rank
still running at a timeout or an abort is named with where it is (a file and line, and
whether that is inside a ``torch.distributed`` call, the test kit's wait for its peers, or
outside any collective), then its Python stacks (``faulthandler`` on ``SIGUSR1``,
:mod:`mp_bridge.testing.stacks`); when exactly one rank is not waiting for the others,
the error's ``rank`` is that one. ``pytest.skip`` on every failing rank skips the
caller's test. The ranks run with ``MP_BRIDGE_CHECK=1`` (agreement checks,
``mp_bridge.checks.agree``) unless the caller's environment sets it.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mp_bridge.checks import check_choice, check_int, check_positive_float
from mp_bridge.testing.rank_setup import START_METHODS, RankSetup, rank_setup
from mp_bridge.testing.stacks import collect_stacks, culprit, describe, stack_path

__all__ = ["DistributedError", "launch", "run_distributed"]

DEFAULT_TIMEOUT_S = 300.0
#: Seconds the parent keeps collecting failures after the first, to find the first cause.
FAILURE_GRACE_S = 2.0
# Errors that are a symptom of a peer's death, not a cause.
_LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "did not all join the agreement check",
)


class DistributedError(RuntimeError):
    """A rank of a :func:`run_distributed` world failed, died or timed out.

    ``rank``: the first cause, when known; ``hanging``: that rank is alive and did not
    finish (a timeout or an abort), rather than failed or died.
    """

    def __init__(self, message: str, rank: int | None = None, *, hanging: bool = False):
        super().__init__(message)
        self.rank = rank
        self.hanging = hanging


def _child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    setup: RankSetup,
    init_file: str,
    timeout_s: float,
    conn: Any,
    env: dict[str, str],
) -> None:
    # The caller's environment at the call (a forkserver's children inherit the server's).
    os.environ.clear()
    os.environ.update(env)
    # One intra-op thread per rank: N ranks on a few cores would otherwise oversubscribe.
    torch.set_num_threads(1)
    # The parent asks a hanging rank for its stacks with SIGUSR1 (kept open until exit).
    stack_file = open(stack_path(init_file, rank), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.setdefault("MP_BRIDGE_CHECK", "1")
    # megatron-core's HyperCommGrid reads these; a parent under torchrun may carry others.
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    payload: tuple[str, Any]
    try:
        setup.bind_device(rank)
        dist.init_process_group(
            setup.backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(*args)
        payload = ("ok", pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        skipped = "pytest" in sys.modules and isinstance(exc, sys.modules["pytest"].skip.Exception)
        payload = ("skip", str(exc)) if skipped else ("error", traceback.format_exc())
    try:
        conn.send(payload)
    except Exception:  # noqa: BLE001 - an unpicklable result is an error too
        conn.send(("error", traceback.format_exc()))
    conn.close()
    # Do not exit before every rank got here: gloo connects its full mesh (the world's and
    # each new group's) asynchronously, and a rank that exits at once closes sockets a
    # peer may still be handshaking on ("connectFullMesh failed: Connection closed by
    # peer"; 25 of 40 8-rank worlds whose fn returned at once failed so). The result is
    # already sent, so a rank stuck here (a peer failed or hangs) only waits to be killed.
    try:
        if dist.is_initialized():
            dist.barrier()
    except BaseException:  # noqa: BLE001 - a peer died; the parent has the results
        pass
    # Skip destroy_process_group: peers may already be gone, and exit frees everything.
    os._exit(0)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by signal {name}"
    return f"exit code {code}"


def failure_severity(kind: str, detail: Any) -> int:
    """Lower = more likely the first cause (see the module docstring)."""
    if kind == "skip":
        return 4
    if kind == "died":
        return 2 if detail == -signal.SIGABRT else 0
    return 3 if any(m in str(detail) for m in _LOST_PEER) else 1


def _failure(rank: int, kind: str, detail: Any) -> str:
    if kind == "died":
        return f"rank {rank} died ({_exit_text(detail)}) before returning"
    return f"rank {rank} raised:\n{detail}"  # (a skip is never the first of a failure)


def _summary(rank: int, kind: str, detail: Any) -> str:
    if kind == "died":
        return f"rank {rank} died ({_exit_text(detail)})"
    if kind == "skip":
        return f"rank {rank} skipped ({detail})"
    last = [line for line in str(detail).strip().splitlines() if line.strip()]
    return f"rank {rank} raised {last[-1].strip()[:200] if last else ''}"


def _kill_all(procs: list[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.join(timeout=5)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    should_abort: Callable[[], str | None] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new ranks; return the per-rank results.

    Each rank has ``torch.distributed`` initialized (``backend``: ``"gloo"``, its tensors
    on :func:`~mp_bridge.testing.current_device`; ``"nccl"`` with rank r on ``cuda:r``).
    ``start_method``: ``None`` picks by the rule of :mod:`~mp_bridge.testing.rank_setup`
    (``fork`` on a machine without CUDA, else ``forkserver``); under ``forkserver`` /
    ``spawn``, ``fn`` and ``args`` travel pickled, so ``fn`` must be a module-level function
    of an importable module. Return values must be picklable. Raises
    :class:`DistributedError` naming the first failing rank with its traceback, or after
    ``timeout_s`` seconds naming the ranks that had not finished; all children are killed
    before it returns or raises. ``should_abort`` is polled while waiting (every ~10 ms);
    when it returns a message the world is killed and :class:`DistributedError` carries
    that message.
    """
    check_choice("backend", backend, ("gloo", "nccl"))
    if start_method is not None:
        check_choice("start_method", start_method, START_METHODS)
    setup = rank_setup(backend=backend, start_method=start_method)
    return launch(setup, fn, world_size, *args, timeout_s=timeout_s, should_abort=should_abort)


def launch(
    setup: RankSetup,
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    should_abort: Callable[[], str | None] | None = None,
) -> list[Any]:
    """:func:`run_distributed` on a resolved :class:`~mp_bridge.testing.rank_setup.RankSetup`
    (a ``DistributedWorld`` passes the one it resolved for the world); every rank gets it."""
    check_int("world_size", world_size, low=1, fix="the number of ranks")
    if setup.backend == "nccl" and torch.cuda.device_count() < 1:
        raise ValueError("backend='nccl' needs CUDA devices; use backend='gloo' on CPU")
    timeout_s = check_positive_float("timeout_s", timeout_s, fix="seconds, e.g. timeout_s=60")
    ctx = _context(fn, setup)
    tmpdir = tempfile.mkdtemp(prefix="mp_bridge_rdzv_")
    init_file = os.path.join(tmpdir, "store")
    procs: list[mp.Process] = []
    conns = []
    env = dict(os.environ)
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(fn, args, rank, world_size, setup, init_file, timeout_s, child_end, env),
                daemon=True,
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        return _collect(procs, conns, timeout_s, should_abort, init_file)
    finally:
        _kill_all(procs)
        for conn in conns:
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _context(fn: Callable[..., Any], setup: RankSetup) -> Any:
    """The multiprocessing context for this world; under a pickling start method, a ``fn``
    that cannot travel is a ``TypeError`` here rather than a confusing one in ``start``."""
    ctx = setup.context()
    if setup.start_method != "fork":
        try:
            pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means the same fix
            raise TypeError(
                f"fn={fn!r} cannot be pickled ({exc}), and ranks started by "
                f"{setup.start_method!r} receive it pickled; pass a module-level "
                "function of an importable module (or MP_BRIDGE_START_METHOD=fork on a "
                "machine without CUDA)"
            ) from exc
    return ctx


def _collect(
    procs: list[mp.Process],
    conns: list[Any],
    timeout_s: float,
    should_abort: Callable[[], str | None] | None,
    init_file: str,
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, Any, float]] = {}  # rank -> (kind, detail, seen at)
    pending = set(range(len(procs)))
    while pending:
        for rank in sorted(pending):
            conn = conns[rank]
            if conn.poll():
                try:
                    status, value = conn.recv()
                except EOFError:
                    procs[rank].join(timeout=1)
                    status, value = "died", procs[rank].exitcode
                pending.discard(rank)
                if status == "ok":
                    results[rank] = pickle.loads(value)
                else:
                    failures[rank] = (status, value, time.monotonic())
            elif not procs[rank].is_alive() and not conn.poll():
                pending.discard(rank)
                failures[rank] = ("died", procs[rank].exitcode, time.monotonic())
        if failures:
            first_seen = min(t for _, _, t in failures.values())
            if not pending or time.monotonic() - first_seen > FAILURE_GRACE_S:
                _raise_first_cause(failures)
            time.sleep(0.01)
            continue
        reason = should_abort() if should_abort is not None and pending else None
        if reason:
            stacks = collect_stacks(procs, sorted(pending), init_file)
            raise DistributedError(f"{reason}\n{describe(stacks)}", culprit(stacks), hanging=True)
        if pending and time.monotonic() > deadline:
            stacks = collect_stacks(procs, sorted(pending), init_file)
            raise DistributedError(
                f"timed out after {timeout_s:g} s: ranks {sorted(pending)} did not finish "
                f"(finished: {sorted(results)})\n{describe(stacks)}",
                culprit(stacks),
                hanging=True,
            )
        if pending:
            time.sleep(0.01)
    return [results[r] for r in range(len(procs))]


def _raise_first_cause(failures: dict[int, tuple[str, Any, float]]) -> None:
    order = sorted(failures, key=lambda r: (failure_severity(*failures[r][:2]), failures[r][2], r))
    first = order[0]
    kind, detail, _ = failures[first]
    if kind == "skip":  # every failing rank skipped: skip the caller's test
        import pytest

        pytest.skip(f"rank {first} skipped: {detail}")
    message = _failure(first, kind, detail)
    if len(order) > 1:
        others = "; ".join(_summary(r, *failures[r][:2]) for r in order[1:])
        message += f"\n(then, probably as a consequence: {others})"
    raise DistributedError(message, rank=first)
