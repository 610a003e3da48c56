"""No mp_bridge module uses megatron's global ``parallel_state`` (groups are passed in).

Replaces the old in-world checks that ``model_parallel_is_initialized()`` stayed false,
which could not fail (nothing they ran went near megatron's initializer). The scan reads
every module's source, so a new import or use of ``parallel_state`` anywhere fails here.
"""

from __future__ import annotations

import ast
import pathlib

import mp_bridge

ROOT = pathlib.Path(mp_bridge.__file__).parent


def _uses_of_parallel_state(source: str) -> list[str]:
    """``import`` / ``from`` statements naming ``parallel_state`` and ``parallel_state.x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if "parallel_state" in a.name]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
            found += [f"from {node.module}" for n in names if "parallel_state" in n][:1]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "parallel_state":
                found.append(f"parallel_state.{node.attr}")
    return found


def test_the_scan_finds_each_form_of_use():
    assert _uses_of_parallel_state("from megatron.core import parallel_state") != []
    assert _uses_of_parallel_state("import megatron.core.parallel_state as ps") != []
    assert _uses_of_parallel_state("from megatron.core.parallel_state import get_tp_group")
    assert _uses_of_parallel_state("parallel_state.initialize_model_parallel(2)") == [
        "parallel_state.initialize_model_parallel"
    ]
    assert _uses_of_parallel_state('"""docstrings may name parallel_state"""') == []


def test_no_module_uses_megatron_parallel_state():
    modules = sorted(ROOT.rglob("*.py"))
    assert len(modules) > 20  # the scan really sees the package
    uses = {}
    for path in modules:
        found = _uses_of_parallel_state(path.read_text())
        if found:
            uses[str(path.relative_to(ROOT))] = found
    assert uses == {}, f"modules using megatron's global parallel_state: {uses}"
