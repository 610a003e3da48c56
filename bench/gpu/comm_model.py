"""The TP collectives of the triton engine's two modes as time, *predicted* (no GPU or
NVLink measured it), and the order the code runs them against its kernels.

A collective takes the bytes each rank receives over ``LINK_BPS``: 350 GB/s, an all-gather
or reduce-scatter's bus bandwidth over NVLink at TP 8 (NCCL's ``busbw``: the bytes a rank
receives per second), assumed until the runbook's ``nccl`` check measures it; the ring
all-reduce (``2 (TP - 1) / TP`` of the buffer received) and the all-to-all are counted at
the same rate per received byte. Overlap counts only where the code overlaps: a
collective issued ``async_op=True`` (NCCL runs it on its own stream, ordered after the
work queued before it by an event; ``Work.wait`` makes the compute stream wait for it)
runs beside the kernels queued until the code waits for it; a plain collective is waited
for at once. Collectives run one after another (one NCCL communicator per group); the
SMs and HBM bandwidth NCCL's kernels take from an overlapped kernel are not counted.

``timeline`` plays a schedule: ``("kernel", name, seconds)`` on the compute stream,
``("start", name, seconds)`` a collective enqueued on the communication stream,
``("wait", name)`` the compute stream waiting for it, ``("sync", name, seconds)`` both.
"""

from __future__ import annotations

import math

LINK_BPS = 350e9
F32 = 4
STATS = 4  # S of a plain cross-entropy
VOCAB_BLOCK = 256


def link_seconds(received: float) -> float:
    """Seconds of a collective in which each rank receives ``received`` bytes."""
    return received / LINK_BPS


def collectives(s, c: int) -> dict[str, dict[str, float]]:
    """``{mode: {collective: bytes each rank receives in one call}}`` at roofline ``Shape``
    ``s`` with invariant chunks of ``c`` tokens (none at TP 1). The invariant ``d h`` by
    token-row ownership: the whole weight once, per chunk ``1 / TP`` of the chunk's ``g``
    rows from every peer, and the ``d h`` rows back."""
    if s.tp == 1:
        return {"default": {}, "invariant": {}}
    peers, n = s.tp - 1, s.n
    piece = s.v_local  # Kmax * 256: every rank's real blocks (the shapes here are even)
    full, last = divmod(n, c)
    rows = full * math.ceil(c / s.tp) + (math.ceil(last / s.tp) if last else 0)  # per rank
    return {
        "default": {
            "stats all-gather [tp, S, N]": peers * STATS * n * F32,
            "d h all-reduce [N, H] fp32 (ring)": 2 * peers / s.tp * n * s.h * F32,
        },
        "invariant": {
            "raw block statistics all-gather": peers * STATS * (s.v_local // VOCAB_BLOCK) * n * F32,
            "weight shards all-gather (once)": peers * piece * s.h * s.elt,
            "g token rows all-to-all": peers * rows * piece * s.elt,
            "d h token rows all-gather": peers * rows * s.h * F32,
        },
    }


def timeline(steps) -> tuple[float, float]:
    """``(seconds, exposed)`` of a schedule (the module docstring): when the compute stream
    and the last collective are done, and the time the compute stream spent waiting."""
    t_c = t_m = waited = 0.0
    ends: dict[str, float] = {}
    for step in steps:
        kind, name = step[0], step[1]
        if kind == "kernel":
            t_c += step[2]
            continue
        if kind in ("start", "sync"):
            t_m = max(t_c, t_m) + step[2]
            ends[name] = t_m
        if kind in ("wait", "sync"):
            waited += max(0.0, ends[name] - t_c)
            t_c = max(t_c, ends[name])
    end = max([t_c, *ends.values()])
    return end, waited + (end - t_c)


def _kernel(kernels, key: str, share: float = 1.0) -> list[tuple]:
    """The kernels whose name holds ``key``, at ``share`` of their call's time."""
    return [("kernel", k.name, share * k.seconds) for k in kernels if key in k.name]


def default_schedule(s, kernels, c: int) -> list[tuple]:
    """``triton_ops.default``: the kernels in call order, its two collectives plain (waited
    for at once): the forward statistics all-gather, the backward ``d h`` all-reduce."""
    coll = collectives(s, c)["default"]
    fwd = [k for k in kernels if k.name.startswith("fwd")]
    bwd = [k for k in kernels if not k.name.startswith("fwd")]
    steps = [("kernel", k.name, k.seconds) for k in fwd]
    steps += [("sync", name, link_seconds(b)) for name, b in coll.items() if "stats" in name]
    steps += [("kernel", k.name, k.seconds) for k in bwd]
    steps += [("sync", name, link_seconds(b)) for name, b in coll.items() if "d h" in name]
    return steps


def invariant_schedule(s, kernels, c: int) -> list[tuple]:
    """``triton_ops.invariant`` as the code runs it. Forward: ``block_stats``, the raw block
    statistics all-gather (plain), ``fold_stats``. Backward (``grads``): the accumulator's
    zero-fill; the weight-shard all-gather started (``async_op``), first waited for before
    the first ``dhidden``; per chunk ``block_grad``, the ``g`` token-row all-to-all started,
    ``block_dweight`` beside it, both waited for, ``dhidden``, the ``d h`` token-row
    all-gather started; the accumulator's rounding copy; the row all-gathers waited for."""
    coll = collectives(s, c)["invariant"]
    chunks = math.ceil(s.n / c)
    per = 1.0 / chunks
    steps = _kernel(kernels, "block_stats")
    steps += [("sync", name, link_seconds(b)) for name, b in coll.items() if "statistics" in name]
    steps += _kernel(kernels, "fold_stats") + _kernel(kernels, "zero-fill")
    if coll:
        steps.append(("start", "w", link_seconds(coll["weight shards all-gather (once)"])))
    for i in range(chunks):
        steps += _kernel(kernels, "block_grad", per)
        if coll:
            steps.append(("start", f"g{i}", per * link_seconds(coll["g token rows all-to-all"])))
        steps += _kernel(kernels, "block_dweight", per)
        steps += [("wait", "w"), ("wait", f"g{i}")] if coll else []
        steps += _kernel(kernels, "dhidden", per)
        if coll:
            rows = coll["d h token rows all-gather"]
            steps.append(("start", f"dh{i}", per * link_seconds(rows)))
    steps += _kernel(kernels, "acc -> bf16")
    return steps + [("wait", f"dh{i}") for i in range(chunks) if coll]


SCHEDULES = {"default": default_schedule, "invariant": invariant_schedule}
