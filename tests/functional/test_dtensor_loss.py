"""A ``DTensor`` weight in the fused losses (``layers/loss/dtensor_weight.py``), 4 gloo ranks.

TP 2 is the ``"tp"`` dim of a ``("dp", "tp")`` 2 x 2 mesh (``Replicate`` over ``"dp"``),
TP 4 a 1-D ``"tp"`` mesh. Shards are ``distribute_tensor``'s (``torch.chunk``): V = 9 at
TP 2 gives 5, 4 rows, V = 5 at TP 4 gives 2, 2, 1, 0 (an empty shard). The reference is
the plain-tensor call with ``tp_group`` on the padded layout of the same rows per rank
(``vocab_cut``: each rank's rows, zero padded), within the TP tests' tolerance (fp32 sums
over 16 products and the ranks: 2e-5); invariant mode bit for bit, against it and TP 1.
Every refused weight, placement and argument is matched by its message, with no
collective issued (``CommDebugMode`` sees c10d and functional collectives alike).
"""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from mp_bridge.layers import fused_linear_cross_entropy, fused_linear_logprobs
from mp_bridge.layers.loss.dtensor_weight import chunk_rows
from mp_bridge.testing import CollectiveCounter, DistributedWorld
from mp_bridge.testing.collectives import CollectiveCall
from tests.loss_refs import Checks
from tests.oracles import vocab_cut

world = DistributedWorld(4, timeout_s=240)
N, H = 13, 16
TOL = dict(rtol=2e-5, atol=2e-5)
DOORS = {"ce": fused_linear_cross_entropy, "logprob": fused_linear_logprobs}
CASES = (
    ("ce", dict(reduction="none", label_smoothing=0.1, z_loss_weight=1e-2, softcap=4.0)),
    ("ce", dict(reduction="mean")),
    ("logprob", dict(temperature=0.8, return_entropy=True, reduction="sum")),
)
#: The triton engine on these CPU meshes: its kernels under the interpreter (no CUDA; on a
#: GPU, tests/functional/test_triton_engine_tp.py runs them compiled).
HAS_TRITON = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()


@functools.cache
def _mesh(tp: int, names: tuple[str, ...] | None = ("tp",)):
    """``tp`` 4: a 1-D mesh of the 4 ranks named ``names``; 2: ``("dp", "tp")`` 2 x 2."""
    if tp == 2:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (4,), mesh_dim_names=names)


def _vocab_mesh(tp: int):
    return _mesh(tp)["tp"] if tp == 2 else _mesh(tp)


def _placements(tp: int, vocab=None):
    vocab = Shard(0) if vocab is None else vocab
    return (Replicate(), vocab) if tp == 2 else (vocab,)


def _data(vocab: int, seed: int = 0, shape=(N,)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g)
    weight = torch.randn(vocab, H, generator=g) * 0.5
    target = torch.randint(0, vocab, shape, generator=g)
    target.view(-1)[[2, 7]] = -100
    return hidden, weight, target


def _run(kind, hidden, weight, target, **kw):
    """``(outputs, d hidden, d weight)`` of one door call with a seeded upstream."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = DOORS[kind](h, w, target, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(5)
    loss = sum((o * (torch.rand(o.shape, generator=g) + 0.5)).sum() for o in outs)
    loss.backward()
    return tuple(o.detach() for o in outs), h.grad, w.grad


def _plain(kind, tp, hidden, weight, target, **kw):
    """The plain-tensor call: this rank's ``ceil(V / tp)`` rows of the padded layout."""
    rank = _vocab_mesh(tp).get_local_rank()
    w = vocab_cut(weight, chunk_rows(weight.shape[0], tp)[0], rank, 0)
    group = _vocab_mesh(tp).get_group()
    return _run(kind, hidden, w, target, tp_group=group, vocab_size=weight.shape[0], **kw)


def _dtensor(kind, tp, hidden, weight, target, **kw):
    w = weight if isinstance(weight, DTensor) else _shard(tp, weight)
    return _run(kind, hidden, w, target, **kw), w


def _shard(tp, weight):
    return distribute_tensor(weight, _mesh(tp), _placements(tp))


def _compare(checks, what, ours, plain, weight_dt, exact=False):
    (outs, gh, gw), (p_outs, p_gh, p_gw) = ours, plain
    same = checks.equal if exact else functools.partial(checks.close, **TOL)
    for a, b in zip(outs, p_outs, strict=True):
        same(a, b, f"{what} value")
    same(gh.full_tensor() if isinstance(gh, DTensor) else gh, p_gh, f"{what} d hidden")
    if not isinstance(gw, DTensor) or gw.placements != weight_dt.placements:
        checks.failures.append(f"{what}: d weight {type(gw).__name__} is not a DTensor of "
                               f"{weight_dt.placements}")  # fmt: skip
        return
    local = gw.to_local()
    same(local, p_gw[: local.shape[0]], f"{what} d weight")
    if p_gw[local.shape[0] :].any():
        checks.failures.append(f"{what}: the plain call's padding rows got a gradient")


def _values_match_plain(engine: str, cases, shapes) -> None:
    checks = Checks()
    for tp, vocab in shapes:
        hidden, weight, target = _data(vocab)
        for kind, kw in cases:
            kw = dict(kw, engine=engine, chunk_size=8)
            ours, w = _dtensor(kind, tp, hidden, weight, target, **kw)
            plain = _plain(kind, tp, hidden, weight, target, **kw)
            what = f"{engine} {kind} {kw} tp={tp} V={vocab} {chunk_rows(vocab, tp)}"
            _compare(checks, what, ours, plain, w)
    checks.done()


@world.case
def test_torch_engine_uneven_and_empty_shards_equal_the_plain_call():
    _values_match_plain("torch", CASES, ((2, 9), (4, 5), (4, 7)))


@world.case
def test_ce_weight_with_uneven_and_empty_shards():
    """Per-class weights ``[V]`` (``class_weights``) over the ``torch.chunk`` shards."""
    checks = Checks()
    for tp, vocab in ((2, 9), (4, 5)):
        hidden, weight, target = _data(vocab)
        ce_weight = torch.rand(vocab, generator=torch.Generator().manual_seed(3)) + 0.5
        for reduction in ("mean", "none"):
            kw = dict(reduction=reduction, ce_weight=ce_weight, engine="torch", chunk_size=8)
            ours, w = _dtensor("ce", tp, hidden, weight, target, **kw)
            plain = _plain("ce", tp, hidden, weight, target, **kw)
            _compare(checks, f"ce_weight {reduction} tp={tp} V={vocab}", ours, plain, w)
    checks.done()


@world.case
def test_triton_engine_uneven_and_empty_shards_equal_the_plain_call():
    if not HAS_TRITON:
        pytest.skip("triton is not installed, or CUDA is (these meshes are CPU)")
    _values_match_plain("triton", CASES[::2], ((2, 9), (4, 5)))


@world.case
def test_invariant_bits_equal_the_plain_call_and_tp_1():
    """Shards of 256, 255 (V = 511, TP 2) and 256 x 3, 253 (V = 1021, TP 4): block aligned
    starts, a short last shard."""
    checks = Checks()
    engines = ("torch", "triton") if HAS_TRITON else ("torch",)
    for engine, (tp, vocab) in [(e, s) for e in engines for s in ((2, 511), (4, 1021))]:
        if engine == "triton" and tp == 4:
            continue  # the interpreter's time: TP 2 covers the short shard
        hidden, weight, target = _data(vocab, seed=1)
        kind, kw = CASES[0]
        kw = dict(kw, engine=engine, invariant=True, chunk_size=8)
        ours, w = _dtensor(kind, tp, hidden, weight, target, **kw)
        plain = _plain(kind, tp, hidden, weight, target, **kw)
        what = f"{engine} invariant tp={tp} V={vocab}"
        _compare(checks, f"{what} vs plain", ours, plain, w, exact=True)
        o1, gh1, gw1 = _run(kind, hidden, weight, target, **kw)  # TP 1: the whole weight
        rank, rows = _vocab_mesh(tp).get_local_rank(), chunk_rows(vocab, tp)[0]
        full = (o1, gh1, vocab_cut(gw1, rows, rank, 0))  # this rank's rows, zero padded
        _compare(checks, f"{what} vs TP 1", ours, full, w, exact=True)
    checks.done()


@world.case
def test_dtensor_hidden_sharded_over_tokens_is_gathered_once():
    """torchtitan's sequence parallel: hidden ``[B, S, H]`` ``Shard(1)`` over ``"tp"``."""
    checks = Checks()
    for tp in (2, 4):
        hidden, weight, target = _data(9, seed=2, shape=(2, 8))
        h = distribute_tensor(hidden, _mesh(tp), _placements(tp, Shard(1)))
        for kind, kw in CASES[1:]:
            ours, w = _dtensor(kind, tp, h, weight, target, **kw)
            plain = _plain(kind, tp, hidden, weight, target, **kw)
            _compare(checks, f"hidden Shard(1) {kind} tp={tp}", ours, plain, w)
            if not isinstance(ours[1], DTensor) or ours[1].placements != h.placements:
                checks.failures.append(f"tp={tp}: d hidden is not a DTensor of {h.placements}")
    checks.done()


def _collectives(fn):
    with CommDebugMode() as mode, CollectiveCounter() as counter:
        fn()
    counts = {str(op): n for op, n in mode.get_comm_counts().items() if n}
    return counts, counter.calls + counter.check_calls


@world.case
def test_dtensor_weight_issues_the_plain_paths_collectives():
    """Forward and backward, both modes (TRL #6172's regression for our doors: no gather of
    the weight); a ``Shard(1)`` hidden adds exactly its one all-gather."""
    checks = Checks()
    for tp, vocab, invariant in ((4, 5, False), (2, 9, False), (2, 511, True)):
        hidden, weight, target = _data(vocab, shape=(2, 8))
        kw = dict(reduction="none", invariant=invariant, engine="torch", chunk_size=8)
        for kind in DOORS:
            w = _shard(tp, weight)
            plain = _collectives(functools.partial(_plain, kind, tp, hidden, weight, target, **kw))
            ours = _collectives(functools.partial(_dtensor, kind, tp, hidden, w, target, **kw))
            what = f"{kind} tp={tp} V={vocab} invariant={invariant}"
            if not plain[0] or ours != plain:
                checks.failures.append(f"{what}: DTensor {ours} != plain {plain}")
    hidden, weight, target = _data(9, shape=(2, 8))
    h = distribute_tensor(hidden, _mesh(4), [Shard(1)])
    w = distribute_tensor(weight, _mesh(4), [Shard(0)])
    plain = _collectives(lambda: _plain("ce", 4, hidden, weight, target))
    ours = _collectives(lambda: _run("ce", h, w, target))
    gathered = {k: n - plain[0].get(k, 0) for k, n in ours[0].items()}
    gathered = {k: n for k, n in gathered.items() if n}
    if len(gathered) != 1 or "all_gather" not in next(iter(gathered)) or 1 not in gathered.values():
        checks.failures.append(f"hidden Shard(1): {ours[0]} against plain {plain[0]}")
    extra = list(ours[1])  # CollectiveCounter sees functional collectives too
    for call in plain[1]:
        if call in extra:
            extra.remove(call)
    hidden_gather = CollectiveCall("all_gather", 4, hidden.numel() * 4 * 3 // 4)
    if extra != [hidden_gather] or len(ours[1]) != len(plain[1]) + 1:
        checks.failures.append(f"hidden Shard(1): calls {ours[1]} against plain {plain[1]}")
    checks.done()


def _refused(checks, what, pattern, fn) -> None:
    """``fn()`` raises ``ValueError`` matching ``pattern`` and issues no collective."""
    with CommDebugMode() as mode, CollectiveCounter() as counter:
        try:
            fn()
        except ValueError as exc:
            if not re.search(pattern, str(exc)):
                checks.failures.append(f"{what}: message {exc} does not match {pattern!r}")
        else:
            checks.failures.append(f"{what}: not refused")
    if mode.get_total_counts() or counter.calls or counter.check_calls:
        checks.failures.append(f"{what}: a collective ran before the refusal")


@world.case
def test_every_undeclared_dtensor_weight_is_refused_by_name():
    checks = Checks()
    hidden, weight, target = _data(9)

    def call(w, door=fused_linear_cross_entropy, h=hidden, t=target, **kw):
        return lambda: door(h, w, t, **kw)

    fsdp_fix = r"inside that FSDP unit's forward.*weight\.full_tensor\(\)"
    unnamed, dp = _mesh(4, None), _mesh(4, ("dp",))
    for mesh, name in ((unnamed, "unnamed"), (dp, r"named \('dp',\)")):
        w = distribute_tensor(weight, mesh, [Shard(0)])
        for door in DOORS.values():
            checks_what = f"{door.__name__} Shard(0) on a {name} mesh"
            _refused(checks, checks_what, rf"Shard\(dim=0\).*{name}.*{fsdp_fix}", call(w, door))
    w2 = distribute_tensor(weight, _mesh(2), [Shard(0), Shard(0)])  # FSDP x TP outside forward
    _refused(checks, "2-D Shard(0), Shard(0)", rf"mesh dim 'dp'.*{fsdp_fix}", call(w2))
    accepted = r"accepted: Shard\(dim=0\)"
    bad = {
        "Partial": DTensor.from_local(weight, _mesh(4), [Partial()]),
        "Shard(dim=1)": distribute_tensor(weight, _mesh(4), [Shard(1)]),
        "Replicate": distribute_tensor(weight, _mesh(4), [Replicate()]),
    }
    for label, w in bad.items():
        for door in DOORS.values():
            pattern = rf"placement {re.escape(label)}.*'tp'.*{accepted}"
            _refused(checks, f"{door.__name__} {label} on 'tp'", pattern, call(w, door))
    w = distribute_tensor(weight, _mesh(4), [Shard(0)])
    _refused(checks, "tp_group of other ranks", r"tp_group holds ranks \[\d, \d\]",
             call(w, tp_group=_vocab_mesh(2).get_group()))  # fmt: skip
    _refused(checks, "vocab_size", r"vocab_size=8, but the DTensor weight holds 9",
             call(w, vocab_size=8))  # fmt: skip
    _refused(checks, "invariant, unaligned", r"shards hold \(3, 3, 3, 0\) rows",
             call(w, invariant=True))  # fmt: skip
    _refused(checks, "vocab_mesh_dim not on the mesh", r"vocab_mesh_dim='model'",
             call(w, vocab_mesh_dim="model"))  # fmt: skip
    _refused(checks, "vocab_mesh_dim, plain weight", r"weight is a plain tensor",
             call(weight, vocab_mesh_dim="tp"))  # fmt: skip
    t_dt = distribute_tensor(target, _mesh(4), [Replicate()])
    _refused(checks, "DTensor target", r"target is a DTensor", call(w, t=t_dt))
    h_dt = distribute_tensor(hidden, _mesh(4), [Shard(1)])
    _refused(checks, "hidden sharded over H", r"placement Shard\(dim=1\).*token dim",
             call(w, h=h_dt))  # fmt: skip
    _refused(checks, "DTensor hidden, plain weight", r"hidden is a DTensor.*weight is not",
             call(weight, h=h_dt))  # fmt: skip
    checks.done()


@world.case
def test_vocab_mesh_dim_declares_another_name():
    checks = Checks()
    hidden, weight, target = _data(7)
    w = distribute_tensor(weight, _mesh(4, ("model",)), [Shard(0)])
    plain = _plain("ce", 4, hidden, weight, target)
    ours = _run("ce", hidden, w, target, vocab_mesh_dim="model")
    _compare(checks, "vocab_mesh_dim='model'", ours, plain, w)
    # a tp_group of the mesh dim's own ranks is accepted
    ours = _run("ce", hidden, w, target, vocab_mesh_dim="model", tp_group=w.device_mesh.get_group())
    _compare(checks, "vocab_mesh_dim='model' with its tp_group", ours, plain, w)
    checks.done()
