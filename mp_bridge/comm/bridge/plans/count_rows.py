"""The per-sample count rows of the bridge and their comparison: pure (no process group).

Every rank of the bridge must agree that each sample's image count equals its token count;
the collective that runs this comparison is
:func:`~mp_bridge.comm.bridge.execution.sample_counts.check_sample_counts`.

The encoder side names each sample's image tokens (``tokens_per_sample``), the LLM side
its image positions (``True`` entries of ``image_mask``); sample ``g`` (global index:
DP replicas' batches in DP order, sample order inside) must have as many of one as of the
other. A mismatch found by one group only would strand every other rank in its next
collective (e.g. the loss's DP all-reduce), so the check spans the bridge's whole world:

1. Each rank builds one fixed-size int64 row (:class:`CountRow`, ``ROW_SIZE`` entries,
   independent of any batch size, so a rank with a wrong number of samples cannot break
   the collective): its rank, its numbers of encoder and LLM samples, its encoder tokens
   and LLM image positions, and a fingerprint of each per-sample count list.
2. One all-gather of the rows over the world group (``8·ROW_SIZE`` bytes per rank).
3. Every rank compares the same rows (:func:`counts_agree`): the TP/CP ranks of each
   encoder (LLM) DP replica agree with each other, every route group's encoder and LLM
   batches have the same number of samples, and per route group the encoder fingerprints
   combine to the LLM ones (:func:`counts_fingerprint` is additive over sample blocks).
4. Only on a mismatch: one ``all_gather_object`` of the actual counts over the world
   group, and every rank raises the same ``ValueError`` (:func:`count_mismatch_message`)
   naming the first bad sample (then every bad one).

Fingerprint: ``sum_j c_j · 37^(g_j)`` mod ``2^61 − 1`` over the samples ``g_j`` of a block.
37 is a primitive root of that prime, so a single changed count, or two samples with
different counts swapped, always changes it; other changes collide only when 37 is a root
of their difference polynomial.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.route import route_groups

__all__ = [
    "ROW_SIZE",
    "CountRow",
    "count_mismatch_message",
    "count_row",
    "counts_agree",
    "counts_fingerprint",
]

PRIME = 2**61 - 1
BASE = 37  # a primitive root mod PRIME: BASE**i differ for every i < PRIME - 1
ROW_SIZE = 7
_SHOWN = 8  # mismatching samples listed in the message
_FIT = {
    "FAN_IN": "each LLM DP batch joins k equal encoder DP batches",
    "FAN_OUT": "each encoder DP batch splits into k equal LLM DP batches",
    "EQUAL": "each encoder DP batch is its LLM DP batch",
}


@dataclass(frozen=True)
class CountRow:
    """One rank's row: sizes and order-sensitive fingerprints of its per-sample counts."""

    rank: int
    encoder_samples: int
    llm_samples: int
    encoder_tokens: int
    llm_tokens: int
    encoder_print: int
    llm_print: int


def counts_fingerprint(counts: Sequence[int], first: int = 0) -> int:
    """``sum_j counts[j] · BASE^(first + j)`` mod ``PRIME`` (``first``: global index of
    ``counts[0]``). Additive: a block's fingerprint is the sum of its pieces'."""
    out, power = 0, pow(BASE, first, PRIME)
    for c in counts:
        out = (out + int(c) * power) % PRIME
        power = power * BASE % PRIME
    return out


def count_row(rank: int, encoder_counts: Sequence[int], llm_counts: Sequence[int]) -> CountRow:
    """This rank's row (fingerprints keyed by local index; shifted when compared)."""
    return CountRow(
        rank,
        len(encoder_counts),
        len(llm_counts),
        sum(encoder_counts),
        sum(llm_counts),
        counts_fingerprint(encoder_counts),
        counts_fingerprint(llm_counts),
    )


def _replicas(plan: BridgePlan, ranks, side: str) -> dict[int, list[int]]:
    """DP replica -> its ranks (ascending) on ``side`` (``'src'`` or ``'dest'``)."""
    layout = plan.src if side == "src" else plan.dest
    out: dict[int, list[int]] = {}
    for r in sorted(ranks):
        out.setdefault(layout.coords(r)["dp"], []).append(r)
    return dict(sorted(out.items()))


def _offsets(sizes: Mapping[int, int]) -> dict[int, int]:
    """Global index of each replica's first sample (replicas in DP order)."""
    out, total = {}, 0
    for dp in sorted(sizes):
        out[dp], total = total, total + sizes[dp]
    return out


def _group_replicas(plan: BridgePlan, members) -> tuple[list[int], list[int]]:
    src = sorted({plan.src.coords(m)["dp"] for m in members})
    return src, sorted({plan.dest.coords(m)["dp"] for m in members})


def counts_agree(plan: BridgePlan, rows: Sequence[CountRow]) -> bool:
    """Whether the rows (one per rank of the grids) pass every comparison of step 3."""
    by_rank = {r.rank: r for r in rows}
    sides = {"src": ("encoder_samples", "encoder_tokens", "encoder_print"),
             "dest": ("llm_samples", "llm_tokens", "llm_print")}  # fmt: skip
    first: dict[str, dict[int, CountRow]] = {}
    for side, fields in sides.items():
        first[side] = {}
        for dp, ranks in _replicas(plan, by_rank, side).items():
            rep = by_rank[ranks[0]]
            if any(getattr(by_rank[r], f) != getattr(rep, f) for r in ranks for f in fields):
                return False
            first[side][dp] = rep
    src_off = _offsets({d: r.encoder_samples for d, r in first["src"].items()})
    dest_off = _offsets({d: r.llm_samples for d, r in first["dest"].items()})
    for members in route_groups(plan):
        if not set(members) <= set(by_rank):
            continue
        s_dps, d_dps = _group_replicas(plan, members)
        src = [first["src"][d] for d in s_dps]
        dest = [first["dest"][d] for d in d_dps]
        if len({r.encoder_samples for r in src}) > 1 or len({r.llm_samples for r in dest}) > 1:
            return False
        if sum(r.encoder_samples for r in src) != sum(r.llm_samples for r in dest):
            return False
        if sum(r.encoder_tokens for r in src) != sum(r.llm_tokens for r in dest):
            return False
        a = sum(r.encoder_print * pow(BASE, src_off[d], PRIME) for d, r in zip(s_dps, src))
        b = sum(r.llm_print * pow(BASE, dest_off[d], PRIME) for d, r in zip(d_dps, dest))
        if a % PRIME != b % PRIME:
            return False
    return True


def _disagreement(plan, counts, side: str) -> str | None:
    """The first replica whose ranks pass different count lists, as a sentence."""
    idx, what, unit = (
        (0, "encoder", "tokens_per_sample") if side == "src" else (1, "LLM", "image_mask")
    )
    for dp, ranks in _replicas(plan, counts, side).items():
        ref = counts[ranks[0]][idx]
        for r in ranks[1:]:
            got = counts[r][idx]
            if got == ref:
                continue
            if len(got) != len(ref):
                detail = f"rank {ranks[0]} passes {len(ref)} samples, rank {r} {len(got)}"
            else:
                j = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
                detail = f"its sample {j} has {ref[j]} on rank {ranks[0]} but {got[j]} on rank {r}"
            return (
                f"the ranks {ranks} of {what} DP replica {dp} disagree on {unit}: {detail}; "
                f"every rank of a {what} DP replica (its TP/CP ranks) passes the same {unit}"
            )
    return None


def _size_mismatch(plan, src, dest) -> str | None:
    """The first route group whose encoder and LLM batches differ in sample numbers."""
    k, name = plan.scale, plan.direction.name
    for members in route_groups(plan):
        s_dps, d_dps = _group_replicas(plan, members)
        if any(d not in src for d in s_dps) or any(d not in dest for d in d_dps):
            continue
        n_src = {d: len(src[d][1][0]) for d in s_dps}
        n_dest = {d: len(dest[d][1][1]) for d in d_dps}
        if len(set(n_src.values())) == 1 and len(set(n_dest.values())) == 1:
            if sum(n_src.values()) == sum(n_dest.values()):
                continue
        enc = ", ".join(f"replica {d} (ranks {src[d][0]}) {n}" for d, n in n_src.items())
        llm = ", ".join(f"replica {d} (ranks {dest[d][0]}) {n}" for d, n in n_dest.items())
        return (
            f"samples per DP batch do not fit {name} with scale {k}: encoder DP {enc} samples "
            f"in tokens_per_sample; LLM DP {llm} samples in image_mask; {_FIT[name]}: pass one "
            f"count per sample of the encoder DP batch"
        )
    return None


def count_mismatch_message(
    plan: BridgePlan, counts: Mapping[int, tuple[Sequence[int], Sequence[int]]], where: str
) -> str:
    """The error every rank raises, from each rank's ``(encoder counts, llm counts)``."""
    counts = {r: (tuple(e), tuple(m)) for r, (e, m) in counts.items()}
    head = f"{where}: "
    tail = " (checked over every rank of the bridge: every rank raises this error)"
    for side in ("src", "dest"):
        problem = _disagreement(plan, counts, side)
        if problem:
            return head + problem + tail
    src = {d: (rs, counts[rs[0]]) for d, rs in _replicas(plan, counts, "src").items()}
    dest = {d: (rs, counts[rs[0]]) for d, rs in _replicas(plan, counts, "dest").items()}
    problem = _size_mismatch(plan, src, dest)
    if problem:
        return head + problem + tail
    enc = [(d, j, c) for d in src for j, c in enumerate(src[d][1][0])]
    llm = [(d, i, c) for d in dest for i, c in enumerate(dest[d][1][1])]
    bad = [(g, e, m) for g, (e, m) in enumerate(zip(enc, llm)) if e[2] != m[2]]
    if not bad:
        return head + "the sample-count fingerprints differ but the counts agree" + tail
    lines = [
        f"sample {i} of LLM DP replica {d} has {b} True entries in image_mask but {a} image "
        f"tokens in tokens_per_sample (global sample {g}; sample {j} of encoder DP replica {s})"
        for g, (s, j, a), (d, i, b) in bad[:_SHOWN]
    ]
    more = f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
    return (
        f"{head}image_mask and tokens_per_sample disagree on {len(bad)} sample(s): "
        + "; ".join(lines)
        + f"{more}. A sample's j-th True position takes its j-th image token, so the counts "
        f"must match: fix that sample's image_mask or tokens_per_sample{tail}"
    )
