"""Pure helpers of the GPU runbook (``bench/gpu_check.py``): tables, verdicts, budgets.

No torch, no CUDA, no I/O: the runbook's stages format their results with these, and
``tests/unit/test_gpu_check.py`` checks them on literal numbers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Measure",
    "Verdict",
    "markdown_table",
    "parse_pytest_summary",
    "per_file_counts",
    "speed_verdicts",
    "split_budget",
    "verdict_lines",
]

#: The LM-head issue's targets: ours default at most the time of the faster of Liger and
#: CCE and at most that one's memory; the invariant mode within 1.25x of ours default.
DEFAULT_VS_FASTEST = 1.0
INVARIANT_VS_DEFAULT = 1.25


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are ``str()``-ed, ``None`` shows as ``n/a``."""
    if not header:
        raise ValueError("header is empty; pass the column names")
    bad = [i for i, row in enumerate(rows) if len(row) != len(header)]
    if bad:
        raise ValueError(f"rows {bad} do not have {len(header)} cells like {list(header)}")

    def line(cells: Sequence[object]) -> str:
        text = ["n/a" if c is None else str(c).replace("|", "\\|") for c in cells]
        return "| " + " | ".join(text) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(r) for r in rows)])


@dataclass(frozen=True)
class Measure:
    """One method's best fwd+bwd time (seconds) and peak extra memory (bytes)."""

    seconds: float
    peak_bytes: int


@dataclass(frozen=True)
class Verdict:
    """A target stated as ``met`` / ``missed`` (or ``not measured``) with its ratio."""

    target: str
    ratio: float | None
    limit: float

    @property
    def status(self) -> str:
        if self.ratio is None:
            return "not measured"
        return "met" if self.ratio <= self.limit else "missed"

    def line(self) -> str:
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.2f}"
        return f"- {self.target}: **{self.status}** (ratio {ratio}, limit {self.limit:g})"


def speed_verdicts(
    rows: dict[str, Measure], *, ours: str = "ours_default", invariant: str = "ours_invariant"
) -> list[Verdict]:
    """Issue 24's three targets from ``{method: Measure}`` of one shape.

    The reference is the faster of ``liger`` and ``cce`` (whichever were measured): time
    ratio ``ours / fastest``, memory ratio ``ours / fastest``'s peak; then ``invariant /
    ours`` time. A missing method makes its verdicts ``not measured``.
    """
    refs = [rows[m] for m in ("liger", "cce") if m in rows]
    fastest = min(refs, key=lambda m: m.seconds) if refs else None
    mine, inv = rows.get(ours), rows.get(invariant)
    time_ratio = mine.seconds / fastest.seconds if mine and fastest else None
    mem_ratio = (
        mine.peak_bytes / fastest.peak_bytes if mine and fastest and fastest.peak_bytes else None
    )
    inv_ratio = inv.seconds / mine.seconds if inv and mine else None
    return [
        Verdict(f"{ours} time / faster of Liger and CCE", time_ratio, DEFAULT_VS_FASTEST),
        Verdict(f"{ours} peak memory / the faster one's", mem_ratio, 1.0),
        Verdict(f"{invariant} time / {ours} time", inv_ratio, INVARIANT_VS_DEFAULT),
    ]


def verdict_lines(verdicts: Sequence[Verdict]) -> str:
    return "\n".join(v.line() for v in verdicts)


_VERBOSE = re.compile(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAILED|XPASSED)\b")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def parse_pytest_summary(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line (``= 3 failed, 10 passed in 2.0s =``).

    Keys: passed, failed, error, skipped, xfailed, xpassed, deselected (0 when absent).
    Without a summary line (the run was killed), the per-test lines of ``-v``
    (``path::test PASSED [ 16%]``) are counted instead.
    """
    counts = dict.fromkeys(
        ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "deselected"), 0
    )
    lines = text.splitlines()
    summary = [ln for ln in lines if re.search(r"\b(passed|failed|error)", ln)]
    summary = [ln for ln in summary if re.search(r" in [\d.]+s", ln)]
    if summary:
        for n, key in _COUNT.findall(summary[-1]):
            counts["error" if key.startswith("error") else key] = int(n)
        return counts
    for ln in lines:
        found = _VERBOSE.search(ln)
        if found:
            counts[found[1].lower()] += 1
    return counts


_PER_TEST = re.compile(
    r"^(?P<file>[^\s:]+\.py)::\S+ (?P<status>PASSED|FAILED|ERROR|SKIPPED|XFAILED|XPASSED)\b"
)


def per_file_counts(text: str) -> dict[str, dict[str, int]]:
    """Per test file, in the order first seen, the counts of pytest ``-v`` result lines
    (``path::test PASSED [ 16%]``): keys passed, failed, error, skipped, xfailed, xpassed.
    Works on a run that was killed: only the lines it printed are counted."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        found = _PER_TEST.match(line.strip())
        if found:
            counts = out.setdefault(
                found["file"],
                dict.fromkeys(("passed", "failed", "error", "skipped", "xfailed", "xpassed"), 0),
            )
            counts[found["status"].lower()] += 1
    return out


def split_budget(caps: Sequence[float], total: float, used: Sequence[float]) -> float:
    """Seconds for the next stage, given each stage's cap, the whole run's ``total`` and
    the seconds ``used`` by the stages already run.

    The next stage (index ``len(used)``) gets its cap plus what earlier stages left
    unused, but never so much that the stages after it lose their caps, and never more
    than what is left of ``total``: ``min(cap + saved, total - spent - later caps)``.
    """
    i = len(used)
    if i >= len(caps):
        raise ValueError(f"used has {i} entries but there are only {len(caps)} stages")
    spent = sum(used)
    saved = max(0.0, sum(caps[:i]) - spent)
    later = sum(caps[i + 1 :])
    return max(0.0, min(caps[i] + saved, total - spent - later))
