"""The house rules that make the folders read as the architecture (README's layout).

Every ``import`` in ``mp_bridge`` (module level *and* inside functions) is read with
``ast``; the tests assert (1) no module imports a higher floor, (2) the module import
graph has no cycle, (3) no file is over 400 lines. Each rule has a planted-violation test
so a checker that silently accepts everything fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "mp_bridge"
MAX_LINES = 400

# Floors, lowest first. A module may import its own floor and lower ones only. Inside a
# wing the sub-floors order the subpackages (e.g. the bridge routes to sequence shards).
FLOORS: dict[str, float] = {
    "mp_bridge": 0,
    "mp_bridge.table": 0,
    "mp_bridge.deprecations": 0,
    "mp_bridge.checks": 0,
    "mp_bridge.testing": 0.5,
    "mp_bridge.grid": 1,
    "mp_bridge.comm": 2,
    "mp_bridge.comm.collectives": 2.1,
    "mp_bridge.comm.sequence": 2.2,
    "mp_bridge.comm.bridge": 2.3,
    "mp_bridge.comm.bridge.plans": 2.3,
    "mp_bridge.comm.bridge.execution": 2.4,
    "mp_bridge.layers": 3,
    "mp_bridge.layers.loss": 3.1,
    "mp_bridge.models": 4,
    "mp_bridge.checkpoint": 4,
    "mp_bridge.models.data": 4.1,
    "mp_bridge.models.reference": 4.2,
    "mp_bridge.models.parallel": 4.3,
    "mp_bridge.models.colocated": 4.4,
    "mp_bridge.models.oracle": 4.5,
    "mp_bridge.models.hf": 4.6,
    "mp_bridge.integrations": 5,
    "mp_bridge.commands": 6,
    "mp_bridge.cli": 7,
}


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def floor_of(module: str) -> float:
    """The floor of the longest prefix of ``module`` listed in FLOORS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in FLOORS:
            return FLOORS[key]
    raise KeyError(f"{module} has no floor: add its package to FLOORS")


def imports_of(source: str, module: str, package: bool, known: set[str]) -> set[str]:
    """Every ``mp_bridge`` module imported anywhere in ``source`` (lazy imports too).

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module,
    else of ``pkg`` (whose ``__init__`` runs).
    """
    base = module.split(".") if package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "mp_bridge")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mp_bridge":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    graph = {}
    for f in files:
        m = module_name(f, root)
        graph[m] = imports_of(f.read_text(), m, is_package(f), known) - {m}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            # A package's __init__ re-exports its own wing: that is not "up".
            if d.startswith(m + ".") or m.startswith(d + ".") and floor_of(d) <= floor_of(m):
                continue
            if floor_of(d) > floor_of(m):
                bad.append(f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_a_higher_floor():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_file_over_the_size_limit():
    long = {
        str(f.relative_to(ROOT.parent)): n
        for f in ROOT.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_package_has_a_floor():
    for m in import_graph():
        floor_of(m)


# ------------------------------------------------------------- the checkers have teeth
def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "mp_bridge"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_a_lazy_upward_import_is_caught(tmp_path):
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "grid/__init__.py": "",
            "grid/make.py": "def f():\n    from mp_bridge.comm import x\n",
            "comm/__init__.py": "x = 1\n",
        },
    )
    bad = upward_imports(import_graph(root))
    assert bad == ["mp_bridge.grid.make (floor 1) imports mp_bridge.comm (floor 2)"]


def test_a_relative_import_cycle_is_caught(tmp_path):
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "comm/__init__.py": "",
            "comm/a.py": "from .b import y\nx = 1\n",
            "comm/b.py": "def g():\n    from .a import x\ny = 2\n",
        },
    )
    assert cycles(import_graph(root)) == [["mp_bridge.comm.a", "mp_bridge.comm.b"]]


@pytest.mark.parametrize("module", ["mp_bridge.nowhere", "mp_bridge.models.nowhere"])
def test_floor_lookup(module):
    if module == "mp_bridge.nowhere":
        assert floor_of(module) == 0  # top-level modules sit on the ground floor
    else:
        assert floor_of(module) == 4


def test_the_bridge_plans_never_import_torch_distributed():
    # The bridge's two halves: plans are pure (no process group), execution runs them.
    plans = ROOT / "comm" / "bridge" / "plans"
    bad = []
    for f in sorted(plans.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            bad += [f"{f.name}: {n}" for n in names if n.startswith("torch.distributed")]
    assert bad == []
    graph = import_graph()
    up = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.startswith("mp_bridge.comm.bridge.plans")
        for d in deps
        if d.startswith("mp_bridge.comm.bridge.execution")
    ]
    assert up == []


def test_no_module_imports_a_private_name_of_another():
    # A name with a leading underscore is its module's own; another module that needs it
    # gets a public name (e.g. routed.encoder_image_rows, once routed._image_rows).
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("mp_bridge")
            ):
                bad += [
                    f"{f.relative_to(ROOT.parent)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert bad == []


def repeated_file_names(paths: list[str]) -> dict[str, list[str]]:
    """The module file names (``__init__.py`` aside) that ``paths`` repeat beyond what
    DESIGN.md allows: one name in two folders, when the folders have different names (the
    folder names the idea: ``plans/route.py`` beside ``execution/route.py``). Three files
    of one name, or two in folders of the same name, are reported."""
    files: dict[str, list[str]] = {}
    for rel in paths:
        name = rel.rsplit("/", 1)[-1]
        if name != "__init__.py":
            files.setdefault(name, []).append(rel)
    bad = {}
    for name, where in files.items():
        folders = {rel.rsplit("/", 2)[-2] for rel in where}
        if len(where) > 2 or len(folders) < len(where):
            bad[name] = where
    return bad


def test_one_name_per_thing():
    # A file name at most twice, in differently named folders (repeated_file_names), and no
    # two classes a name (e.g. the bridge's CommunicatorSpec, the model's MimoBuildSpec, the
    # layers' ShardSpec and the partition's PartitionShardSpec were two BuildSpec and two
    # ShardSpec).
    paths: list[str] = []
    classes: dict[str, list[str]] = {}
    for f in sorted(ROOT.rglob("*.py")):
        rel = str(f.relative_to(ROOT.parent))
        paths.append(rel)
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(rel)
    assert repeated_file_names(paths) == {}
    assert {n: p for n, p in classes.items() if len(p) > 1} == {}


# The checkpoint wing: three floors, each module importing only floors below its own (no
# sibling import, no back arrow), so save, load and describe (inspect) stand as peers.
CHECKPOINT_WING: dict[str, int] = {
    "keys": 0, "locate": 0, "ranks": 0, "dcp_adapter": 0, "rng": 0, "arguments": 0,
    "dtensor_place": 0,
    "entries": 1, "info": 1, "publish": 1, "background": 1, "staging": 1, "hf_record": 1,
    "save": 2, "load": 2, "describe": 2,
}  # fmt: skip


def wing_arrows(graph: dict[str, set[str]], wing: str, floors: dict[str, int]) -> list[str]:
    """Imports inside ``wing`` (its ``__init__`` aside) that do not go strictly down
    ``floors`` (module short name -> floor), and wing modules ``floors`` does not place."""
    bad = []
    for m, deps in sorted(graph.items()):
        if not m.startswith(wing + "."):
            continue
        short = m[len(wing) + 1 :]
        if short not in floors:
            bad.append(f"{m} has no floor in the wing")
            continue
        for d in sorted(deps):
            if d.startswith(wing + ".") and floors.get(d[len(wing) + 1 :], 99) >= floors[short]:
                bad.append(f"{m} (floor {floors[short]}) imports {d}")
    return bad


def test_the_checkpoint_wing_has_three_floors_and_no_back_arrow():
    assert max(CHECKPOINT_WING.values()) <= 2
    assert wing_arrows(import_graph(), "mp_bridge.checkpoint", CHECKPOINT_WING) == []


def test_a_sibling_import_in_the_checkpoint_wing_is_caught(tmp_path):
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "checkpoint/__init__.py": "",
            "checkpoint/keys.py": "",
            "checkpoint/save.py": "from mp_bridge.checkpoint import keys\n",
            "checkpoint/load.py": "def f():\n    from mp_bridge.checkpoint.save import g\n",
            "checkpoint/extra.py": "",
        },
    )
    floors = {"keys": 0, "save": 2, "load": 2}
    assert wing_arrows(import_graph(root), "mp_bridge.checkpoint", floors) == [
        "mp_bridge.checkpoint.extra has no floor in the wing",
        "mp_bridge.checkpoint.load (floor 2) imports mp_bridge.checkpoint.save",
    ]


def test_a_file_name_may_repeat_only_where_the_folder_names_the_idea():
    ok = ["m/plans/route.py", "m/execution/route.py", "m/a/__init__.py", "m/b/__init__.py"]
    assert repeated_file_names(ok) == {}
    same_folder_name = ["m/x/plans/route.py", "m/y/plans/route.py"]
    assert repeated_file_names(same_folder_name) == {"route.py": same_folder_name}
    three = ["m/a/engine.py", "m/b/engine.py", "m/c/engine.py"]
    assert repeated_file_names(three) == {"engine.py": three}
