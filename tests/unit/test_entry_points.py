"""Every public callable that runs a collective is in the one table of entry points and marked.

The walk: every name in ``__all__`` of ``mp_bridge.grid``, ``.comm``, ``.layers`` and
``.models``, and the public methods (and constructors) of the classes among them that
``mp_bridge`` defines. A callable *runs a collective* (the criterion) when

- it takes a process group or a grid: a parameter named ``group``/``groups``/``grid`` or
  ending in ``_group``/``_groups``/``_grid``, or annotated ``ProcessGroup``/``HyperCommGrid``;
- or it is a method of a class whose constructor takes one (the class holds groups);
- or its own body calls ``torch.distributed`` collectives or the library's collectives.

Each such callable is either in ``mp_bridge.checks.ENTRY_POINTS`` and carries the
``@agreed`` mark with its row's name, or is in ``EXEMPT`` below with the reason it needs no
agreement. What the criterion cannot see: a callable that reaches a collective only
through a helper of another name and takes no group (none is known; a reviewer adds it to
the table by hand).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types
from collections.abc import Iterable, Mapping

import pytest
import torch.distributed as dist

from mp_bridge.checks import ENTRY_POINTS, agreed, agreed_name

PUBLIC_PACKAGES = (
    "mp_bridge.grid",
    "mp_bridge.comm",
    "mp_bridge.layers",
    "mp_bridge.models",
    "mp_bridge.checkpoint",
)

#: Table rows not marked yet (empty: every wing is wired). A row marked already must leave
#: it (the audit says so).
PENDING_MARKS: frozenset[str] = frozenset()

_PRIMITIVE = "one collective on shapes its caller (an entry point) agreed on; checking each "
_PRIMITIVE += "primitive would double the collectives the budget tests fix"
_NO_COLLECTIVE = "stores or reads groups, runs no collective"
_DELEGATES = "runs its collectives through entry points of the table, which agree"
_AGREEMENT = "is an agreement exchange itself"

#: Callables that meet the criterion but need no agreement of their own, with the reason.
EXEMPT: dict[str, str] = {
    # grid
    "mp_bridge.grid.destroy_grid": "teardown: a barrier and group destruction, no arguments",
    "mp_bridge.grid.get_pg_or_none": _NO_COLLECTIVE,
    "mp_bridge.grid.GridLayout.from_grid": "pure: reads a grid's shape, names and offset",
    # comm: the primitives under every entry point
    **{
        f"mp_bridge.comm.{name}": _PRIMITIVE
        for name in (
            "copy_to_group",
            "gather_along",
            "gather_keep_grad",
            "reduce_from_group",
            "reduce_scatter_along",
            "scatter_along",
            "all_gather_tensor",
            "all_reduce_sum",
            "reduce_scatter_tensor",
            "gather_kv",
            "seq_to_heads",
            "heads_to_seq",
        )
    },
    "mp_bridge.comm.RingStep.__init__": _PRIMITIVE + " (ring attention's send/recv step)",
    "mp_bridge.comm.RingStep.wait": _PRIMITIVE + " (waits on the step's send/recv)",
    "mp_bridge.comm.ring_neighbours": "maps group ranks to global ranks; no collective",
    "mp_bridge.comm.GatherKV.forward": _PRIMITIVE + " (gather_kv's Function)",
    "mp_bridge.comm.ReduceScatterKV.forward": _PRIMITIVE + " (gather_kv's adjoint)",
    "mp_bridge.comm.group_rank": _NO_COLLECTIVE,
    "mp_bridge.comm.group_size": _NO_COLLECTIVE,
    "mp_bridge.comm.check_agreement": _AGREEMENT,
    "mp_bridge.comm.run_checked": _AGREEMENT,
    "mp_bridge.comm.check_group_arg": "validates a group argument; no collective",
    "mp_bridge.comm.check_sample_counts": _AGREEMENT + " (carries the counts the bridge needs)",
    "mp_bridge.comm.ColocatedBridgeCommunicator.destroy": "teardown: releases its own groups",
    "mp_bridge.comm.BridgePlan.__init__": "pure plan: its gather_groups are rank lists",
    "mp_bridge.comm.BridgePlan.gather_group_of": "pure plan: rank lists",
    "mp_bridge.comm.BridgePlan.cp_group_of": "pure plan: rank lists",
    "mp_bridge.comm.BridgePlan.slot_of": "pure plan: rank lists",
    "mp_bridge.comm.BridgePlan.slice_for": "pure plan: rank lists",
    "mp_bridge.comm.BridgePlan.describe": "pure plan: rank lists",
    "mp_bridge.comm.BridgePlan.check_member": "pure plan: raises for a rank outside the grids",
    "mp_bridge.comm.BridgePlan.stage_of": "pure plan: a rank's LLM pipeline stage",
    "mp_bridge.comm.BridgePlan.consumes": "pure plan: whether a rank's stage takes encoder rows",
    "mp_bridge.comm.BridgeGroups.__init__": _NO_COLLECTIVE,
    "mp_bridge.comm.BridgeGroups.release": "teardown: frees the groups it owns, no arguments",
    "mp_bridge.comm.make_bridge_groups": "group creation from a plan that "
    "ColocatedBridgeCommunicator.__init__ agreed on; new_group takes no tensor",
    "mp_bridge.comm.ColocatedBridgeCommunicator.prepare_route": "group creation (the route "
    "groups), no arguments; the layouts were agreed at construction",
    "mp_bridge.comm.ImageBalancer.__init__": _NO_COLLECTIVE,
    "mp_bridge.comm.ImageBalancer.spec": "pure: builds the spec plan() agrees on",
    "mp_bridge.comm.PartitionAdapter.__init__": _NO_COLLECTIVE,
    "mp_bridge.comm.PartitionAdapter.local_indices": "pure: index arithmetic on the group sizes",
    "mp_bridge.comm.PartitionAdapter.layout": "pure: index arithmetic on the group sizes",
    # layers
    "mp_bridge.layers.ShardSpec.__init__": _NO_COLLECTIVE,
    "mp_bridge.layers.ShardSpec.rows": "pure: rows of a rank",
    "mp_bridge.layers.ShardSpec.full_shape": "pure: a shape",
    "mp_bridge.layers.ShardSpec.pieces": "pure: the real rows of a rank, per fused part",
    "mp_bridge.layers.ShardSpec.local_pieces": "reads the group size and rank; no collective",
    "mp_bridge.layers.mark_sharded": "attaches a ShardSpec to a tensor; no collective",
    "mp_bridge.layers.VocabParallelEmbedding.__init__": _NO_COLLECTIVE,
    "mp_bridge.layers.VocabParallelEmbedding.from_full": "copies this rank's rows; no collective",
    "mp_bridge.layers.VocabParallelEmbedding.new_rows": "allocates a local shard",
    "mp_bridge.layers.VocabParallelEmbedding.check_full": "validates a local tensor",
    "mp_bridge.layers.VocabParallelEmbedding.extra_repr": "text",
    "mp_bridge.layers.VocabParallelEmbedding.sharded_state_dict": "megatron metadata of the local "
    "shard (reads group ranks and sizes); no collective",
    "mp_bridge.layers.VocabParallelEmbedding.zero_padding_": "zeroes local rows; no collective",
    "mp_bridge.layers.VocabParallelLMHead.__init__": _NO_COLLECTIVE,
    "mp_bridge.layers.VocabParallelLMHead.from_full": "copies this rank's rows; no collective",
    "mp_bridge.layers.VocabParallelLMHead.new_rows": "allocates a local shard",
    "mp_bridge.layers.VocabParallelLMHead.check_full": "validates a local tensor",
    "mp_bridge.layers.VocabParallelLMHead.extra_repr": "text",
    "mp_bridge.layers.VocabParallelLMHead.sharded_state_dict": "megatron metadata of the local "
    "shard (reads group ranks and sizes); no collective",
    "mp_bridge.layers.VocabParallelLMHead.zero_padding_": "zeroes local rows; no collective",
    # models
    "mp_bridge.models.ColocatedMimoModel.checkpoint_grids": "returns the grids the model "
    "holds (what a checkpoint records); no collective",
    "mp_bridge.models.TPEncoder.__init__": _NO_COLLECTIVE,
    "mp_bridge.models.TPEncoder.forward": _DELEGATES + " (megatron's TP linears' mappings)",
    "mp_bridge.models.TPEncoder.from_full": "copies this rank's shards; no collective",
    "mp_bridge.models.TPEncoder.to_full": _DELEGATES + " (gather_shard)",
    "mp_bridge.models.TPProjection.__init__": _NO_COLLECTIVE,
    "mp_bridge.models.TPProjection.forward": _DELEGATES + " (megatron's TP linears' mappings)",
    "mp_bridge.models.TPProjection.from_full": "copies this rank's shards; no collective",
    "mp_bridge.models.TPProjection.to_full": _DELEGATES + " (gather_shard)",
    "mp_bridge.models.TPLLM.__init__": _NO_COLLECTIVE,
    "mp_bridge.models.TPLLM.embed_tokens": _DELEGATES + " (VocabParallelEmbedding.forward)",
    "mp_bridge.models.TPLLM.final_hidden": _DELEGATES + " (context_parallel_attention)",
    "mp_bridge.models.TPLLM.token_loss": _DELEGATES + " (the vocab-parallel losses)",
    "mp_bridge.models.TPLLM.from_full": "copies this rank's shards; no collective",
    "mp_bridge.models.TPLLM.to_full": _DELEGATES + " (gather_shard)",
    "mp_bridge.models.ColocatedMimoModel.__init__": _DELEGATES
    + " (ColocatedBridgeCommunicator.__init__)",
    "mp_bridge.models.ColocatedMimoModel.destroy": "teardown: releases its own groups",
    "mp_bridge.models.ColocatedMimoModel.from_full": _DELEGATES + " (__init__)",
    "mp_bridge.models.ColocatedMimoModel.from_groups": _DELEGATES + " (__init__)",
    "mp_bridge.models.ColocatedMimoModel.to_full": _DELEGATES + " (gather_shard)",
    "mp_bridge.models.gather_full_state": _DELEGATES + " (gather_shard)",
    "mp_bridge.models.run_parity": _DELEGATES + " (make_grid, the model's forward)",
    "mp_bridge.models.ColocatedMimoModel.parts": "returns the modules and groups; no collective",
    "mp_bridge.models.MimoGroups.local": "one process: no group, no collective",
    "mp_bridge.models.ColocatedMimoModel.gradient_buckets": "lists (group, params); no collective",
    "mp_bridge.models.MimoGroups.__init__": _NO_COLLECTIVE,
    "mp_bridge.models.MimoGroups.destroy": "teardown: releases its own groups",
    "mp_bridge.models.MimoGroups.embedding_group": "reads group ranks "
    "(get_process_group_ranks) and checks them locally; no collective",
    "mp_bridge.models.destroy_colocated_mimo": "teardown: releases groups",
}

_GROUP_PARAM = re.compile(r"^(group|groups|grid)$|_(group|groups|grid)$")
_GROUP_TYPE = re.compile(r"ProcessGroup|HyperCommGrid")
_COLLECTIVE_CALL = re.compile(
    r"\bdist\.(all_reduce|all_gather\w*|reduce_scatter\w*|all_to_all\w*|broadcast\w*|barrier"
    r"|new_group|new_subgroups\w*|send|recv|isend|irecv|gather|scatter|reduce)\("
    r"|\b(copy_to_group|reduce_from_group|gather_along|gather_keep_grad|scatter_along"
    r"|reduce_scatter_along|all_gather_tensor|all_reduce_sum|reduce_scatter_tensor"
    r"|gather_kv|gather_shard|exchange_rows)\("
)


def _takes_group(fn: object) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(_GROUP_PARAM.search(p.name) or _GROUP_TYPE.search(str(p.annotation)) for p in params)


def _calls_collective(fn: object) -> bool:
    try:
        source = inspect.getsource(inspect.unwrap(fn))
    except (TypeError, OSError):
        return False
    body = source.split(":", 1)[-1] if source.lstrip().startswith(("def", "@")) else source
    return bool(_COLLECTIVE_CALL.search(body))


def _own_methods(cls: type) -> dict[str, object]:
    """Public methods (and ``__init__``) that classes of ``cls``'s MRO defined in the library."""
    out: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith(("mp_bridge", "tests.unit.test_entry_points")):
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(raw, (staticmethod, classmethod)):
                raw = raw.__func__
            if inspect.isfunction(raw):
                out[name] = raw
    return out


def collective_callables(packages: Iterable[str]) -> dict[str, object]:
    """Public dotted name -> callable, for every public callable meeting the criterion."""
    found: dict[str, object] = {}
    for package in packages:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                methods = _own_methods(obj)
                holds = "__init__" in methods and _takes_group(methods["__init__"])
                for meth, fn in methods.items():
                    if holds or _takes_group(fn) or _calls_collective(fn):
                        found[f"{package}.{name}.{meth}"] = fn
            elif callable(obj) and (_takes_group(obj) or _calls_collective(obj)):
                found[f"{package}.{name}"] = obj
    return found


def _resolve(dotted: str) -> object:
    for cut in range(1, dotted.count(".") + 1):  # the longest importable module first
        head, *attrs = dotted.rsplit(".", cut)
        try:
            obj = importlib.import_module(head)
        except ImportError:
            continue
        for attr in attrs:
            obj = inspect.getattr_static(obj, attr) if inspect.isclass(obj) else getattr(obj, attr)
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
        return obj
    raise ImportError(dotted)


def audit(
    packages: Iterable[str],
    table: Mapping[str, str],
    exempt: Mapping[str, str],
    pending: Iterable[str],
) -> list[str]:
    """Every problem with the wiring of ``packages`` (empty when all is well)."""
    pending = set(pending)
    problems = []
    candidates = collective_callables(packages)
    for name in sorted(candidates):
        if name not in table and name not in exempt:
            problems.append(
                f"{name} runs a collective but is neither in ENTRY_POINTS "
                "(mp_bridge/checks/entry_points.py) nor exempted with a reason"
            )
    in_scope = tuple(f"{p}." for p in packages)
    for name in sorted(n for n in table if n.startswith(in_scope)):
        try:
            mark = agreed_name(_resolve(name))
        except (ImportError, AttributeError):
            problems.append(f"ENTRY_POINTS row {name} names nothing importable")
            continue
        if name in pending:
            if mark == name:
                problems.append(f"{name} is marked now: remove it from PENDING_MARKS")
        elif mark != name:
            problems.append(f"{name} is in ENTRY_POINTS but lacks @agreed({name!r}) (got {mark})")
    for name in sorted(exempt):
        if name.startswith(in_scope) and name not in candidates:
            problems.append(f"EXEMPT row {name} is stale: it no longer meets the criterion")
        if name in table:
            problems.append(f"{name} is both an entry point and exempt")
    problems += [f"PENDING_MARKS row {n} is not in ENTRY_POINTS" for n in pending - set(table)]
    return problems


def test_every_public_collective_is_wired():
    assert audit(PUBLIC_PACKAGES, ENTRY_POINTS, EXEMPT, PENDING_MARKS) == []


def test_the_table_names_public_names_with_a_wing():
    wings = {"grid", "collectives", "bridge", "sequence", "layers", "loss", "models"}
    assert set(ENTRY_POINTS.values()) <= wings
    assert all(n.startswith(PUBLIC_PACKAGES) for n in ENTRY_POINTS)


def test_agreed_refuses_a_name_outside_the_table():
    with pytest.raises(KeyError, match=r"not in mp_bridge.checks.entry_points.ENTRY_POINTS"):
        agreed("mp_bridge.comm.no_such_entry")


# ----------------------------------------------------------------- planted wiring faults
def _plant(monkeypatch, *, mark_reduce: bool) -> str:
    """A fake public package with one marked entry point, one a decorator was removed from
    (optionally), an unlisted collective function and a class holding a group."""
    name = "tests.unit.test_entry_points_fake"
    fake = types.ModuleType(name)
    table = {f"{name}.reduce": "layers", f"{name}.Holder.run": "layers"}
    for row in table:
        monkeypatch.setitem(ENTRY_POINTS, row, "layers")

    def reduce(x, group: dist.ProcessGroup | None = None):
        return x

    def unlisted(x, tp_group=None):
        return x

    class Holder:
        def __init__(self, cp_group):
            self.cp_group = cp_group

        @agreed(f"{name}.Holder.run")
        def run(self, x):
            return x

    fake.reduce = agreed(f"{name}.reduce")(reduce) if mark_reduce else reduce
    fake.unlisted, fake.Holder = unlisted, Holder
    Holder.__module__ = name
    fake.__all__ = ["reduce", "unlisted", "Holder"]
    monkeypatch.setitem(sys.modules, name, fake)
    return name


def test_audit_fails_when_a_decorator_is_removed(monkeypatch):
    name = _plant(monkeypatch, mark_reduce=False)
    exempt = {f"{name}.unlisted": "planted", f"{name}.Holder.__init__": "stores the group"}
    assert audit([name], ENTRY_POINTS, exempt, ()) == [
        f"{name}.reduce is in ENTRY_POINTS but lacks @agreed('{name}.reduce') (got None)"
    ]


def test_audit_names_an_unlisted_collective_and_passes_when_wired(monkeypatch):
    name = _plant(monkeypatch, mark_reduce=True)
    problems = audit([name], ENTRY_POINTS, {}, ())
    assert problems == [
        f"{name}.Holder.__init__ runs a collective but is neither in ENTRY_POINTS "
        "(mp_bridge/checks/entry_points.py) nor exempted with a reason",
        f"{name}.unlisted runs a collective but is neither in ENTRY_POINTS "
        "(mp_bridge/checks/entry_points.py) nor exempted with a reason",
    ]
    exempt = {f"{name}.unlisted": "planted", f"{name}.Holder.__init__": "stores the group"}
    assert audit([name], ENTRY_POINTS, exempt, ()) == []
    assert audit([name], ENTRY_POINTS, exempt, [f"{name}.reduce"]) == [
        f"{name}.reduce is marked now: remove it from PENDING_MARKS"
    ]
