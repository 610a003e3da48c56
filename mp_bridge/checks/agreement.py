"""Agreement: ranks of a group that disagree get the same clear error on every rank.

A collective whose ranks disagree (one rank sends ``[2, 8, 4]``, the others
``[2, 4, 8]``; fp64 on one rank; 5 tokens versus 4; a target that differs across TP)
aborts inside gloo, hangs, or silently returns garbage. So every public entry point that
runs a collective (the table in :mod:`mp_bridge.checks.entry_points`) parses its
arguments once into a frozen spec (a dataclass with a ``fields()`` method: name -> small
value that every rank of the group must hold equal, e.g. shapes, dtypes, options) and
calls :func:`agree` before its first collective. :class:`FrozenSpec` gives a frozen
dataclass that ``fields()``::

    @dataclass(frozen=True)
    class ReduceSpec(FrozenSpec):
        op: str
        shape: tuple[int, ...]

    agree("deterministic_all_reduce", group, ReduceSpec("sum", (4,)))

The exchange (:func:`check_agreement`, which ``agree`` runs on the spec's fields): each
rank packs what its group must agree on into one fixed-size int64 row (the call site, a
hash of each field, an exact fingerprint of each tensor that must be identical), the rows
are all-gathered (**one** small collective per group, ``8 * (4 + 16)`` bytes per rank),
and on any difference every rank raises the same :class:`AgreementError` (a
``ValueError``) naming the argument, the ranks and their values. Only then (the error
path) a second exchange, ``all_gather_object``, fetches the readable values for the
message. The row holds :data:`MAX_FIELDS` slots; a spec with more fields folds the rest
into the last slot (:func:`pack_row`), so a spec may grow without the row growing.

When: ``MP_BRIDGE_CHECK=1`` in the environment (``mp_bridge.testing`` sets it in the
ranks it starts unless the caller set it). Off by default: each check is a host sync
(the rows are read on the host) plus a latency-bound collective; see the README for the
measured cost. ``always=True`` (the model step) checks whatever the variable says.

Tools that observe collectives (``mp_bridge.testing.CollectiveCounter``) ask
:func:`in_agreement_check` to tell this check's collectives from the operation's own.

Four exchanges stay outside this mechanism because they carry data the call itself
needs, not only a verdict: the bridge's per-sample count rows
(``comm/bridge/execution/sample_counts.py``: every rank of the world needs every
replica's counts to compare encoder samples with LLM image positions), the ragged FAN_IN
header (``comm/bridge/execution/ragged.py``: each member's token count sizes the
gather's output; it carries a code of the row shape and dtype and is that call's only
agreement), the pipelined LLM's ragged delivery header
(``comm/bridge/execution/stage.py``: samples, tokens, row numel and element size per
rank size the first stage's exchange; that call's only agreement) and the image
balancer's count rows (``comm/bridge/execution/balancer.py``: the plan is made from
every replica's counts; the row carries a code of the frozen ``BalanceSpec``, compared
through ``agree`` when it differs). All raise the same error on every rank, as here.

What it cannot see: a rank that never calls the check (e.g. ``masked_mean`` given the
group on one rank only). Under ``MP_BRIDGE_CHECK=1`` the ranks that did call it wait at
most ``MP_BRIDGE_CHECK_TIMEOUT`` seconds (default 60) on gloo, then raise
``TimeoutError`` naming the call and the group; the rank that skipped the collective
cannot know. (Otherwise they wait like any collective: up to the group's timeout.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = [
    "MAX_FIELDS",
    "AgreementError",
    "AgreementSpec",
    "FrozenSpec",
    "agree",
    "check_agreement",
    "checks_enabled",
    "fingerprint",
    "in_agreement_check",
    "pack_row",
    "run_checked",
]

#: Slots of the row for fields (plus fingerprints); more fields fold into the last slot.
MAX_FIELDS = 16
_HEADER = 4  # [global rank, call-site hash, has local error, number of fields]
_running = threading.local()


class AgreementError(ValueError):
    """The ranks of a group disagree on an argument (or one rank rejected its input).

    ``failures``: ``(rank, error type name, message)`` of each rank that rejected its
    input, in rank order (empty when the ranks only disagree), the same on every rank: a
    caller may re-raise the first one as its own type (e.g. ``mp_bridge.checkpoint``).
    """

    def __init__(self, message: str, failures: Sequence[tuple[int, str, str]] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)


# ------------------------------------------------------------------------ the spec
@runtime_checkable
class AgreementSpec(Protocol):
    """A parsed, frozen argument set; ``fields()`` is what the ranks compare."""

    def fields(self) -> Mapping[str, object]: ...


class FrozenSpec:
    """Mixin for a ``@dataclass(frozen=True)`` spec: ``fields()`` are its fields, in order."""

    def fields(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def agree(
    where: str,
    group: Any,
    spec: AgreementSpec,
    *,
    identical: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    error: BaseException | None = None,
    always: bool = False,
) -> None:
    """Raise the same :class:`AgreementError` on every rank of ``group`` unless they agree.

    ``spec.fields()`` must be equal on every rank; ``identical`` tensors must be equal
    bit for bit; ``error`` is this rank's own validation error (every rank then raises,
    naming this rank). Collectives and the on/off switch: see :func:`check_agreement`.
    """
    params = getattr(spec, "__dataclass_params__", None)
    if params is not None and not params.frozen:
        raise TypeError(
            f"{where}: {type(spec).__name__} must be a frozen dataclass (frozen=True): ranks "
            "compare what the entry point parsed, which nothing may change afterwards"
        )
    fields = spec.fields()
    if not isinstance(fields, Mapping):
        raise TypeError(f"{type(spec).__name__}.fields() must return a mapping, got {fields!r}")
    check_agreement(
        where, group, fields, identical=identical, device=device, error=error, always=always
    )


# ------------------------------------------------------------------- the switches
def checks_enabled() -> bool:
    """Whether ``MP_BRIDGE_CHECK`` turns the agreement checks on (``1``/``true``/``on``)."""
    value = os.environ.get("MP_BRIDGE_CHECK", "0").strip().lower()
    return value in ("1", "true", "yes", "on")


def _timeout_s() -> float:
    raw = os.environ.get("MP_BRIDGE_CHECK_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or math.isinf(value):
        raise ValueError(f"MP_BRIDGE_CHECK_TIMEOUT={raw!r} must be a positive number of seconds")
    return value


def in_agreement_check() -> bool:
    """Whether this thread is inside an agreement check's own collectives.

    For tools that observe collectives (``mp_bridge.testing.CollectiveCounter``): a budget
    counts what an operation needs, not the debug-mode check in front of it.
    """
    return getattr(_running, "depth", 0) > 0


@contextlib.contextmanager
def _checking() -> Iterator[None]:
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        yield
    finally:
        _running.depth -= 1


# ------------------------------------------------------------------------- the row
def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """An exact int64 fingerprint (0-dim, on ``t.device``) of ``t``'s bits and order.

    ``sum_i bits_i * (i + 1)`` in wrapping int64 over the flattened tensor: integer
    arithmetic, so the same bits give the same value on every rank whatever the
    reduction order, and a permutation or a single changed element changes it.
    Costs one pass over ``t`` (and an int64 copy of it).
    """
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_floating_point() or flat.is_complex():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        flat = flat.view(bits[flat.element_size()])
    v = flat.to(torch.int64)
    w = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)
    return (v * w).sum() + v.numel()


def pack_row(codes: torch.Tensor) -> torch.Tensor:
    """The row's :data:`MAX_FIELDS` slots from one int64 code per field, in order.

    Fewer codes are padded with zeros; more keep the first ``MAX_FIELDS - 1`` as they are
    and fold the rest into the last slot by :func:`fingerprint` (order-sensitive, so a
    change in any folded field still changes the row; the message names fields from the
    readable values, not from the row). With ``MAX_FIELDS = 16``: codes ``[1, 2, 3]`` give
    ``[1, 2, 3, 0, ..., 0]``; codes ``1..18`` give ``[1, ..., 15, 107]``
    (``16*1 + 17*2 + 18*3 + 3``).
    """
    if codes.numel() <= MAX_FIELDS:
        return torch.cat([codes, codes.new_zeros(MAX_FIELDS - codes.numel())])
    keep = MAX_FIELDS - 1
    return torch.cat([codes[:keep], fingerprint(codes[keep:]).reshape(1)])


def _code(value: object) -> int:
    return zlib.crc32(repr(value).encode())


# -------------------------------------------------------------------- the exchange
def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    # torch >= 2.13 spells it all_gather_single (the old name warns FutureWarning).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _groups(group: Any) -> list[dist.ProcessGroup]:
    items = list(group) if isinstance(group, (list, tuple)) else [group]
    return [g for g in items if g is not None and dist.get_world_size(g) > 1]


def _gather_rows(row: torch.Tensor, groups: list[dist.ProcessGroup], where: str) -> list:
    """All-gather ``row`` over each group in turn (rows of the whole product of groups)."""
    for g in groups:
        n = dist.get_world_size(g)
        out = row.new_empty((n * row.shape[0], row.shape[1]))
        work = _all_gather_into(out, row.contiguous(), g)
        # Bounded only in the debug mode: an always-on check (the model step) must wait
        # for a legitimately slow rank (data loading) as long as the collective would.
        if dist.get_backend(g) == "gloo" and checks_enabled():
            timeout = _timeout_s()
            try:
                work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as exc:
                raise TimeoutError(
                    f"{where}: the ranks {dist.get_process_group_ranks(g)} of its group did "
                    f"not all join the agreement check within {timeout:.0f} s "
                    "(MP_BRIDGE_CHECK_TIMEOUT): a rank failed before it, is in another "
                    "collective, or called with a different group (e.g. group=None); see "
                    "the other ranks' errors"
                ) from exc
        else:
            work.wait()
        row = out
    return row.tolist()


def _gather_objects(obj: Any, groups: list[dist.ProcessGroup]) -> list:
    items = [obj]
    for g in groups:
        parts: list[Any] = [None] * dist.get_world_size(g)
        dist.all_gather_object(parts, items, group=g)
        items = [x for part in parts for x in part]
    return items


def _message(where: str, records: list[dict], names: list[str]) -> str:
    """The same text on every rank: the failing ranks' errors, else each differing field."""
    ranks = [r["rank"] for r in records]
    failed = [r for r in records if r["error"] is not None]
    sites = {r["where"] for r in records}
    if failed:
        lines = [f"{where}: rank {r['rank']} rejected its input: {r['error']}" for r in failed]
        lines.append(f"  (agreement check over ranks {ranks}: every rank raises this error)")
        return "\n".join(lines)
    if len(sites) > 1:
        lines = [f"{where}: ranks {ranks} are in different collective calls:"]
        lines += [f"  rank {r['rank']} is in {r['where']}" for r in records]
        lines.append("  every rank of a group must make the same collective calls in order")
        return "\n".join(lines)
    differing, lines = [], []
    for name in names:
        by_value: dict[str, list[int]] = {}
        for r in records:
            by_value.setdefault(r["fields"].get(name, "<missing>"), []).append(r["rank"])
        if len(by_value) > 1:
            differing.append(name)
            parts = "; ".join(f"ranks {rs} have {v}" for v, rs in by_value.items())
            lines.append(f"  {name}: {parts}")
    head = f"{where}: ranks disagree on {', '.join(differing)} (group ranks {ranks}):"
    tail = (
        "  pass the same values (bit-identical tensors where a fingerprint differs) on every rank"
    )
    return "\n".join([head, *lines, tail])


def check_agreement(
    where: str,
    group: dist.ProcessGroup | Sequence[dist.ProcessGroup | None] | None,
    fields: Mapping[str, object],
    *,
    identical: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    error: BaseException | None = None,
    always: bool = False,
) -> None:
    """Raise :class:`AgreementError` on every rank unless the ranks of ``group`` agree.

    ``fields``: name -> a small value (shape tuple, dtype, int, str) that must be equal on
    every rank; ``identical``: name -> a tensor whose bits must be equal on every rank
    (compared by :func:`fingerprint`); ``error``: this rank's own validation error, if
    any (every rank then raises, naming this rank and its message). ``group``: a group or
    a sequence of groups (one all-gather each, rows gathered over their product); groups
    of size 1 and ``None`` are skipped. ``device``: where the int64 row lives (default:
    this rank's GPU under NCCL, else CPU). No-op unless :func:`checks_enabled` or ``always``.
    Collectives: one all-gather of ``[n, 4 + MAX_FIELDS]`` int64 per group, however many
    fields (:func:`pack_row`); on a mismatch, one ``all_gather_object`` per group for the
    message.
    """
    groups = _groups(group)
    if not groups or not (always or checks_enabled()):
        if error is not None:
            raise error
        return
    names = list(fields) + [f"{k} (fingerprint)" for k in identical or {}]
    if device is None:  # the group's device: NCCL rows must live on this rank's GPU
        nccl = dist.get_backend(groups[0]) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    device = torch.device(device)
    header = [dist.get_rank(), _code(where), int(error is not None), len(names)]
    codes = torch.tensor([_code(v) for v in fields.values()], dtype=torch.int64, device=device)
    prints = [fingerprint(t).to(device).reshape(1) for t in (identical or {}).values()]
    head = torch.tensor(header, dtype=torch.int64, device=device)
    row = torch.cat([head, pack_row(torch.cat([codes, *prints]))]).reshape(1, -1)
    with _checking():
        rows = _gather_rows(row, groups, where)
    if all(r[1:] == rows[0][1:] for r in rows) and not any(r[2] for r in rows):
        return
    readable = {k: str(v) for k, v in fields.items()}
    for k, p in zip(identical or {}, prints):
        readable[f"{k} (fingerprint)"] = f"{int(p):#018x}"
    mine = {
        "rank": dist.get_rank(),
        "where": where,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "kind": None if error is None else type(error).__name__,
        "message": None if error is None else str(error),
        "fields": readable,
    }
    with _checking():
        records = sorted(_gather_objects(mine, groups), key=lambda r: r["rank"])
    failures = [(r["rank"], r["kind"], r["message"]) for r in records if r["error"] is not None]
    raise AgreementError(_message(where, records, names), failures) from error


def run_checked(
    where: str,
    group: Any,
    checks: Callable[[], Mapping[str, object]],
    *,
    device: torch.device | str | None = None,
    always: bool = False,
) -> Mapping[str, object]:
    """Run this rank's ``checks()`` (which returns the fields to agree on) and agree.

    A ``TypeError``/``ValueError`` raised by ``checks`` does not strand the peers: it is
    sent through the same exchange, so every rank raises :class:`AgreementError` naming
    the failing rank and its message. Returns the fields.
    """
    try:
        fields, error = checks(), None
    except (TypeError, ValueError) as exc:
        fields, error = {}, exc
    check_agreement(where, group, fields, device=device, error=error, always=always)
    return fields
