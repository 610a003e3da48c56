"""The triton engine's kernels for sm_90 (H100 / H200), compiled here without a GPU.

1. Every kernel compiles (``tests/triton_compile.py``: all six, every option flag on, bf16
   and fp32): the GPU-only branch of ``tiles.dot_acc``, which the CPU interpreter never
   lowers, is valid Triton for the GPU the runbook uses.
2. The GEMM-like kernels *as launched* (``tests/triton_facts.py``: the wrappers' own
   arguments and options, specialized as the JIT specializes them, at the production shape
   and at an odd one, for mean CE, ``ce_weight``, every RL option and every CE option, in
   bf16 and fp32, fp16 in mean CE) compile to what ``bench/gpu/compiled_facts.json``
   records: the MMA instructions (which decide the bits: identical in every build of a
   kernel and dtype), tensor-core kind, pipelining, tiles and ``k`` step, spills (none in
   any build), shared memory, CTAs per SM. A Triton upgrade that moves any of them fails
   here, naming the re-record command and the GPU bits check.
3. Nothing outside the code changes a bit: every launch pins ``num_warps``, ``num_stages``
   and ``enable_fp_fusion`` (``False``, which ``TRITON_FORCE_DISABLE_FP_FUSION`` cannot
   override), every ``tl.dot`` names its ``input_precision``, and fp32 builds never touch
   tensor cores or TF32.

``PENDING_WGMMA`` names kernels still on ``mma.sync`` (Triton uses wgmma from 64-row
tiles); the test asserts that they are, so rewriting one fails here until it leaves the
set. Empty since issue 36's 64-row tiles: every GEMM-like kernel is on wgmma.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "bench" / "gpu" / "compiled_facts.json"
ARCH = "sm_90"
#: Kernels still on ``mma.sync`` (Ampere path); the wgmma rewrite empties this set.
PENDING_WGMMA: frozenset[str] = frozenset()
SMEM_LIMIT = 227 * 1024
RERECORD = (
    "re-record with `python -m tests.triton_facts --record` (no TRITON_INTERPRET), then "
    "re-check the invariant bits on a GPU (bench/gpu_check.py --stages invariance): the MMA "
    "shapes and the build decide them"
)


def _run(module: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_every_kernel_compiles_for_sm90():
    lines = _run("tests.triton_compile").stdout.strip().splitlines()
    assert len(lines) == 12, lines  # 6 kernels x (bf16, fp32)
    assert all("REG:" in line for line in lines), lines


@pytest.fixture(scope="module")
def facts() -> dict[str, dict]:
    return json.loads(_run("tests.triton_facts").stdout)


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict]:
    return json.loads(RECORD.read_text())[ARCH]["builds"]


def _gemm_builds(facts, dtypes=("bf16", "fp16")):
    return {k: f for k, f in facts.items() if k.split()[1] in dtypes}


def test_the_record_covers_every_build(facts, recorded):
    assert sorted(facts) == sorted(recorded), RERECORD
    kernels = {k.split()[0] for k in facts}
    assert kernels == {"_block_stats_kernel", "_block_grad_kernel", "_dhidden_kernel",
                       "_block_dweight_kernel"}  # fmt: skip


def test_the_matrix_is_every_build_a_user_can_launch(facts):
    # written out, not derived from tests.triton_facts: both chunks, every option of the
    # two option-dependent kernels in bf16 and fp32, the option-free kernels once
    for dt in ("bf16", "fp32"):
        for build in ("spec", "odd"):
            for name in ("_block_stats_kernel", "_block_grad_kernel"):
                for option in ("", " ce_weight", " rl", " ce"):
                    assert f"{name} {dt} {build}{option}" in facts
            for name in ("_dhidden_kernel", "_block_dweight_kernel"):
                assert f"{name} {dt} {build}" in facts
    assert len(facts) == 48  # + fp16's 8 mean-CE builds


def test_mma_shapes_are_the_same_in_every_build_and_as_recorded(facts, recorded):
    for key, f in _gemm_builds(facts).items():
        name, dt = key.split()[:2]
        assert f["mma"], f"{key}: no tensor-core instruction"
        assert f["mma"] == facts[f"{name} {dt} spec"]["mma"], f"{key}: MMA differs from spec's"
        assert f["mma"] == recorded[key]["mma"], (
            f"{key}: MMA {f['mma']} != recorded {recorded[key]['mma']}; {RERECORD}"
        )


def test_every_build_records_its_tiles_k_step_registers_and_stages(facts):
    for key, f in facts.items():
        assert f["k_step"] in (16, 32, 64, 128), key
        assert f["tiles"]["TILE_M"] in (32, 64, 128), key
        assert 0 < f["regs"] <= 255 and f["stages"] >= 1, key


def test_every_build_has_its_recorded_facts(facts, recorded):
    for key, f in facts.items():
        moved = {k: (recorded[key].get(k), v) for k, v in f.items() if k != "regs"}
        moved = {k: ab for k, ab in moved.items() if ab[0] != ab[1]}
        assert not moved, f"{key}: (recorded, now) {moved}; {RERECORD}"


def test_fp32_builds_never_use_tensor_cores_or_tf32(facts):
    fp32 = _gemm_builds(facts, ("fp32",))
    assert len(fp32) == 20
    for key, f in fp32.items():
        assert f["kind"] == "none" and not f["mma"] and not f["tf32"], key


def test_no_spills_and_shared_memory_fits(facts):
    # every build a user can launch: no LDL / STL in the SASS and a zero stack
    for key, f in facts.items():
        assert f["stack"] == 0 and f["ldl_stl"] == 0, f"{key} spills: {f}"
        assert f["shared"] <= SMEM_LIMIT, f"{key}: {f['shared']} B of shared memory"


def test_the_running_build_is_software_pipelined(facts):
    for key, f in _gemm_builds(facts).items():
        if key.split()[2] == "spec":
            assert f["stages"] >= 3 and f["cp_async"], f"{key} is not pipelined: {f}"


def test_tensor_cores_through_wgmma_except_the_pending_kernels(facts):
    for key, f in _gemm_builds(facts).items():
        name = key.split()[0]
        if name in PENDING_WGMMA:  # today's fact; the rewrite removes the kernel here
            assert f["kind"] == "mma.sync", f"{key} is {f['kind']}: remove it from PENDING_WGMMA"
        else:
            assert f["kind"] == "wgmma", f"{key}: {f['kind']}, not wgmma"


def test_launches_pin_their_options_and_fusion_off(facts):
    for key, f in facts.items():
        assert set(f["options"]) == {"num_warps", "num_stages", "enable_fp_fusion"}, key
        assert f["options"]["enable_fp_fusion"] is False and f["fp_fusion"] is False, key
        if key.split()[1] != "fp32":  # fp32's dot lowers to fma; bf16 / fp16: no contraction
            assert f["fma"] == 0, f"{key}: {f['fma']} fma.rn in the PTX"


def test_a_pinned_false_fusion_is_beyond_every_variable(monkeypatch):
    from triton import knobs

    for force in ("0", "1"):
        for default in ("0", "1"):
            monkeypatch.setenv("TRITON_FORCE_DISABLE_FP_FUSION", force)
            monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", default)
            assert knobs.language.fp_fusion_enabled(False) is False
    monkeypatch.setenv("TRITON_FORCE_DISABLE_FP_FUSION", "1")
    assert knobs.language.fp_fusion_enabled(True) is False  # why True is not pinned


# --- source scans: every launch and every tl.dot in mp_bridge --------------------------

LAUNCH_PINS = {"num_warps", "num_stages", "enable_fp_fusion"}


def unpinned(source: str) -> list[str]:
    """``kernel[grid](...)`` launches missing a pin and ``tl.dot`` calls without
    ``input_precision``, as ``"line: what"``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        kws = {k.arg for k in node.keywords}
        if isinstance(node.func, ast.Subscript):
            missing = LAUNCH_PINS - kws
            if missing:
                bad.append(f"{node.lineno}: launch without {sorted(missing)}")
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "dot":
            if getattr(node.func.value, "id", None) == "tl" and "input_precision" not in kws:
                bad.append(f"{node.lineno}: tl.dot without input_precision")
    return bad


def test_every_launch_and_dot_is_pinned():
    files = [p for p in (ROOT / "mp_bridge").rglob("*.py") if "triton" in p.read_text()]
    found = {str(p.relative_to(ROOT)): unpinned(p.read_text()) for p in files}
    assert any("tl.dot(" in p.read_text() for p in files)  # the scan sees the kernels
    assert not {k: v for k, v in found.items() if v}


def test_the_scan_catches_an_unpinned_launch_and_dot():
    src = "k[(1,)](x, num_warps=4)\ny = tl.dot(a, b)\nz = tl.dot(a, b, input_precision='ieee')\n"
    assert unpinned(src) == [
        "1: launch without ['enable_fp_fusion', 'num_stages']",
        "2: tl.dot without input_precision",
    ]
