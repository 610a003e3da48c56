"""The GPU runbook's CPU path and its pure helpers (bench/gpu_check.py, bench/gpu/).

The runbook itself needs a GPU; here: without CUDA it prints one line and exits 0, and
its table, verdict, budget and wheel helpers give the literal results below.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "bench" / "gpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_runbook_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = _load("report")
wheels = _load("wheels")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path needs a machine without CUDA")
def test_without_cuda_one_line_and_exit_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("gpu_check: no CUDA device on this machine")
    assert "nothing was run" in lines[0]
    assert (tmp_path / "out" / "gpu_check.md").read_text() == lines[0] + "\n"


def test_markdown_table_literal():
    text = report.markdown_table(("method", "ms"), [("liger", "1.5"), ("a|b", None)])
    assert text == "| method | ms |\n|---|---|\n| liger | 1.5 |\n| a\\|b | n/a |"


def test_markdown_table_row_width_is_checked():
    with pytest.raises(ValueError, match=r"rows \[1\] do not have 2 cells"):
        report.markdown_table(("a", "b"), [("1", "2"), ("3",)])


def _rows(ours_s: float, ours_gib: float, inv_s: float):
    gib = 2**30
    return {
        "liger": report.Measure(1.0, 10 * gib),
        "cce": report.Measure(0.8, 8 * gib),
        "ours_default": report.Measure(ours_s, int(ours_gib * gib)),
        "ours_invariant": report.Measure(inv_s, 0),
    }


def test_verdicts_against_the_faster_of_liger_and_cce():
    # CCE (0.8 s) is the faster: 0.76 / 0.8 = 0.95 <= 1, 8 / 8 GiB, 1.2 / 0.76 = 1.58 > 1.25.
    v = report.speed_verdicts(_rows(0.76, 8, 1.2))
    assert [x.status for x in v] == ["met", "met", "missed"]
    assert [round(x.ratio, 4) for x in v] == [0.95, 1.0, 1.5789]
    assert v[0].line() == (
        "- ours_default time / faster of Liger and CCE: **met** (ratio 0.95, limit 1)"
    )


def test_verdicts_missed_time_and_memory():
    # 0.9 / 0.8 = 1.125 > 1; 12 / 8 GiB = 1.5 > 1; 1.1 / 0.9 = 1.222 <= 1.25.
    v = report.speed_verdicts(_rows(0.9, 12, 1.1))
    assert [x.status for x in v] == ["missed", "missed", "met"]
    assert [round(x.ratio, 3) for x in v] == [1.125, 1.5, 1.222]


def test_verdicts_without_references_are_not_measured():
    rows = {"ours_default": report.Measure(1.0, 1), "ours_invariant": report.Measure(1.25, 1)}
    v = report.speed_verdicts(rows)
    assert [x.status for x in v] == ["not measured", "not measured", "met"]
    assert "ratio n/a" in v[0].line()


def test_parse_pytest_summary_line():
    text = "...\n==== 2 failed, 10 passed, 1 skipped, 3 errors in 12.34s ====\n"
    counts = report.parse_pytest_summary(text)
    assert counts["passed"] == 10 and counts["failed"] == 2
    assert counts["skipped"] == 1 and counts["error"] == 3


def test_parse_pytest_killed_run_counts_verbose_lines():
    text = (
        "tests/functional/test_invariant.py::test_a PASSED [ 16%]\n"
        "tests/functional/test_invariant.py::test_b FAILED [ 33%]\n"
        "tests/functional/test_invariant.py::test_c PASSED [ 50%]\n"
    )
    counts = report.parse_pytest_summary(text)
    assert (counts["passed"], counts["failed"], counts["error"]) == (2, 1, 0)


def test_per_file_counts_of_a_killed_verbose_run():
    text = (
        "tests/functional/test_b.py::test_x PASSED [  5%]\n"
        "tests/functional/test_b.py::test_y[tp2] FAILED [ 10%]\n"
        "some output line PASSED in the middle\n"
        "tests/functional/test_a.py::test_z SKIPPED (needs 6 ranks) [ 15%]\n"
        "tests/functional/test_b.py::test_w ERROR [ 20%]\n"
    )
    got = report.per_file_counts(text)
    assert list(got) == ["tests/functional/test_b.py", "tests/functional/test_a.py"]
    b, a = got["tests/functional/test_b.py"], got["tests/functional/test_a.py"]
    assert (b["passed"], b["failed"], b["error"], b["skipped"]) == (1, 1, 1, 0)
    assert (a["passed"], a["skipped"]) == (0, 1)


def test_split_budget_passes_savings_on_and_protects_later_caps():
    caps = [30, 185, 90, 230]  # 535 of 555 s
    assert report.split_budget(caps, 555, []) == 30  # 555 - 525 later caps
    assert report.split_budget(caps, 555, [5]) == 210  # 185 + the 25 s saved
    # the tests stage overran (300 s): invariance gets what is left after speed's cap
    assert report.split_budget(caps, 555, [5, 300]) == 20
    assert report.split_budget(caps, 555, [5, 300, 20]) == 230
    with pytest.raises(ValueError, match="only 4 stages"):
        report.split_budget(caps, 555, [1, 1, 1, 1])


def test_wheel_names_and_install_plan():
    mc = "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    assert wheels.wheel_name_version(mc) == ("megatron-core", "0.19.2")
    assert wheels.wheel_name_version("/x/Liger_Kernel-0.8.5-py3-none-any.whl") == (
        "liger-kernel",
        "0.8.5",
    )
    with pytest.raises(ValueError, match="is not a wheel file name"):
        wheels.wheel_name_version("einops-0.8.2.tar.gz")
    found = ["einops-0.8.2-py3-none-any.whl", mc, "liger_kernel-0.8.5-py3-none-any.whl"]
    plan = wheels.install_plan(found, {"einops": "0.8.2", "megatron-core": "0.16.1"})
    assert plan == [("liger_kernel-0.8.5-py3-none-any.whl", "missing"), (mc, "0.16.1 installed")]


def test_smoke_path_runs_the_stages_on_cpu_and_writes_each_table(tmp_path):
    """The runbook's own code path (stages, per-step appends, the summary) at toy sizes on
    CPU, so it cannot rot between GPU runs; the figures it prints are not GPU figures."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MP_BRIDGE_TEST_DEVICE": "cpu"}
    argv = [sys.executable, str(REPO / "bench" / "gpu_check.py"), str(out), "--smoke"]
    argv += ["--stages", "unit", "invariance", "speed", "attention"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "gpu_check.md").read_text()
    steps = ("unit", "unit (all)"), ("invariance", "small"), ("invariance", "invariant bits")
    for stage, step in (*steps, ("speed", "V=2048"), ("attention", "attention vs SDPA")):
        assert re.search(rf"^\| {stage} \| {re.escape(step)}[^|]* \| ok \|", summary, re.M), summary
    tests = (out / "tests.md").read_text()
    assert re.search(r"\| unit \(all\) \| [1-9]\d* \| 0 \| 0 \|", tests), tests
    invariance = (out / "invariance.md").read_text()
    assert "| fused_ce_none | float32 | bitwise | bitwise | bitwise |" in invariance, invariance
    # the invariant bits hashed at a fixed shape, the interpreter's under its own key
    assert re.search(r"^\| bfloat16 \| ce \| [0-9a-f]{16} \| new \|$", invariance, re.M), invariance
    assert "\ncpu-interpreter triton=" in invariance and " 70x48x1024 float16 lp " in invariance
    assert "ours_default" in (out / "speed.md").read_text()
    attention = (out / "speed.md").read_text()  # bench/attention.py's three sections
    assert "sdpa plain" not in attention and "| attention |" not in attention
    for row in (r"^256\s+fp32\s+plain\s", r"^512\s+2\s+ring\s", r"^2 images, T="):
        assert re.search(row, attention, re.M), attention
    assert sorted(f.name for f in out.iterdir()) == [
        "gpu_check.md",
        "invariance.md",
        "speed.json",
        "speed.md",
        "stages.log",
        "tests.log",
        "tests.md",
    ]


def test_smoke_kernels_stage_puts_each_kernel_beside_its_prediction(tmp_path):
    """Issue 42's first check (the ``kernels`` stage) at toy sizes on CPU: each invariant
    kernel timed beside its predicted time, the build whose bits are hashed, the four
    cuBLAS slab GEMMs, a 2-rank gloo all-gather (the figures are not GPU figures)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MP_BRIDGE_TEST_DEVICE": "cpu"}
    argv = [sys.executable, str(REPO / "bench" / "gpu_check.py"), str(out), "--smoke"]
    argv += ["--stages", "kernels"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "gpu_check.md").read_text()
    for step in ("invariant kernels", "cuBLAS", "invariant bits"):
        assert re.search(rf"^\| kernels \| {step}[^|]* \| ok \|", summary, re.M), summary
    speed = (out / "speed.md").read_text()
    for kernel in ("block_stats", "fold_stats", "block_grad", "dhidden", "block_dweight acc"):
        assert re.search(rf"^\| {kernel} \| \d+\.\d+ \| \d+\.\d+ \| ", speed, re.M), speed
    assert "statistics build in use (block_stats.stats_build, bf16): {" in speed
    assert len(re.findall(r"^\| (fwd|bwd): (z|dW_s|dh) ", speed, re.M)) == 4, speed
    assert re.search(r"^\| 2 \| \d+\.\d+ \| \d+\.\d+ \| 350 \| ", speed, re.M), speed
    assert re.search(r"^\| bfloat16 \| ce \| [0-9a-f]{16} \| new \|$", speed, re.M), speed


def test_the_bits_step_compares_with_the_record_and_fails_on_a_difference(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))
    bits = _load("bits")
    monkeypatch.setattr(bits, "hashes", lambda *a: {"ce": "1111222233334444", "lp": "ab" * 8})
    monkeypatch.setattr(bits, "key", lambda *a: "sm_90 triton=3.9.0 torch=2.13.0 2x3x4")
    record = tmp_path / "record.txt"
    record.write_text(
        "# a comment line\n"
        "sm_90 triton=3.9.0 torch=2.13.0 2x3x4 bfloat16 ce 1111222233334444\n"
        "sm_90 triton=3.9.0 torch=2.13.0 2x3x4 bfloat16 lp 0000000000000000\n"
        "sm_80 triton=3.9.0 torch=2.13.0 2x3x4 float32 ce 0000000000000000\n"
    )
    monkeypatch.setattr(bits, "RECORD", record)
    out = tmp_path / "bits.md"
    argv = ["--device", "cpu", "--dtypes", "bfloat16", "float32", "--out", str(out)]
    assert bits.main(argv) == 1  # bf16 lp differs
    text = out.read_text()
    assert "| bfloat16 | ce | 1111222233334444 | same |" in text
    assert "| bfloat16 | lp | abababababababab | **differs** (was 0000000000000000) |" in text
    assert "| float32 | ce | 1111222233334444 | new |" in text  # sm_80's line is not ours
    assert "sm_90 triton=3.9.0 torch=2.13.0 2x3x4 float32 lp abababababababab" in text
    record.write_text(record.read_text().replace("lp 0000000000000000", "lp " + "ab" * 8))
    assert bits.main(argv) == 0
