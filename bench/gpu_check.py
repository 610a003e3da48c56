"""GPU runbook for issue 24: one call on one H100/H200, under 10 minutes, no network.

Stages, each a subprocess with its own time budget (a stage that fails or runs out of
time is reported, and the next one still runs; time one stage leaves unused goes to the
next):

(a) ``install`` (30 s): ``bench/gpu/wheels.py`` installs the carried wheels the machine
    lacks (``.gpu-wheels/``, made by ``make gpu-wheels``: megatron-core, Liger-Kernel,
    Cut Cross-Entropy, einops, mp_bridge) into one folder, offline (``pip install
    --no-index --no-deps --target``); later stages put it on ``PYTHONPATH`` after the
    repository root, so the tree's ``mp_bridge`` is the one tested.
(b) ``tests`` (185 s): ``tests/unit`` as they are (CPU tensors; checks the environment:
    torch 2.11, megatron-core 0.19.2), then the CUDA subset of ``tests/functional``
    (bridge, partition, vocab layers, losses, fused losses, invariant mode, one MIMO
    oracle) with 8 gloo ranks holding their tensors on ``cuda:0``: the test kit uses CUDA
    only under NCCL (``MP_BRIDGE_BACKEND=nccl``, rank r on ``cuda:r``), and NCCL refuses
    two ranks on one GPU, so ``bench/gpu/cuda_ranks.py`` (a pytest plugin, enabled by
    ``MP_BRIDGE_TEST_DEVICE=cuda``) points ``current_device()`` at ``cuda:0`` under gloo.
(c) ``invariance`` (90 s): ``bench/gpu/invariance.py``: ``invariant=True`` bitwise
    across TP 1/2/4/8 (8 gloo ranks on ``cuda:0``), values and gradients, fp32 and bf16
    inputs, fused and materialized losses, and batch composition.
(d) ``speed`` (230 s): ``bench/gpu/speed.py``: bf16 N x H x V = 8192 x 4096 x {131072,
    262144}, TP 1, fwd+bwd time and peak memory of materialized, megatron-core, ours
    default, ours invariant, Liger-Kernel and Cut Cross-Entropy, methods in turn, best
    of several, with the issue's targets stated as met / missed with their ratios.

Every table is printed with its command and written under ``OUT_DIR`` (at most 8 files,
no sub-folders: what the device tool brings back): ``gpu_check.md`` (all of it),
``install.md``, ``tests.md``, ``tests.log``, ``invariance.md``, ``speed.md``,
``speed.json``, ``stages.log``. Without CUDA it prints one line and exits 0.

The one device call (after ``make gpu-wheels`` in the checkout the device tool sends; the
wheel folder is git-ignored, so it travels only when named in ``carry``)::

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_check.py $OUT",
        carry=[".gpu-wheels"], timeout_s=600)

Here, the same stages on CPU at toy sizes (checks the runbook itself, not the GPU)::

    PYTHONPATH=. python bench/gpu_check.py /tmp/gpu_out --smoke
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "bench" / "gpu"
sys.path.insert(0, str(HERE))

from report import markdown_table, parse_pytest_summary, split_budget  # noqa: E402

NO_CUDA = (
    "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False); "
    "nothing was run (see bench/RESULTS.md, 'GPU runbook', for the device call)"
)
STAGES = ("install", "tests", "invariance", "speed")
CAPS = {"install": 30.0, "tests": 185.0, "invariance": 90.0, "speed": 230.0}
TOTAL_S = 555.0  # under the device tool's 600 s per command, with room to write the files
FUNCTIONAL = (  # most wanted first: a run cut at its budget keeps these
    "test_invariant.py",
    "test_fused_loss.py",
    "test_losses.py",
    "test_vocab_layers.py",
    "test_bridge.py",
    "test_partition.py",
    "test_models_oracle.py",
)


@dataclass
class Step:
    """One command of a stage; ``log``: where its output goes (``stages.log`` if None)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log: str | None = None
    share: float = 1.0  # fraction of the stage's remaining time this step may take
    label: str = ""


@dataclass
class Outcome:
    status: str
    seconds: float
    output: str


def _run(step: Step, timeout: float, out_dir: Path, env: dict[str, str]) -> Outcome:
    """Run one step in its own process group; kill that group at ``timeout``."""
    log_path = out_dir / (step.log or "stages.log")
    start = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(step.argv)}\n")
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(
            step.argv,
            cwd=REPO,
            env={**env, **step.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its forked ranks share its group: one kill ends all
        )
        try:
            code = proc.wait(timeout=max(1.0, timeout))
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {timeout:.0f} s"
    with open(log_path) as f:
        f.seek(offset)
        output = f.read()
    return Outcome(status, time.perf_counter() - start, output)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _steps(stage: str, args, budget: float, py: str) -> list[Step]:
    out = Path(args.out_dir)
    if stage == "install":
        return [Step([py, str(HERE / "wheels.py"), args.wheels, args.site])]
    if stage == "tests":
        unit = ["tests/unit/test_vocab_shards.py"] if args.smoke else ["tests/unit"]
        func = ["tests/functional/test_invariant.py"] if args.smoke else FUNCTIONAL
        func = [f if f.startswith("tests/") else f"tests/functional/{f}" for f in func]
        common = [py, "-m", "pytest", "-p", "no:cacheprovider", "-rfE"]
        device = {} if args.smoke else {"MP_BRIDGE_TEST_DEVICE": "cuda"}
        return [
            Step([*common, "-q", *unit], log="tests.log", share=0.35, label="unit (CPU tensors)"),
            Step(
                [*common, "-v", "-p", "cuda_ranks", *func],
                env=device,
                log="tests.log",
                label="functional, gloo ranks, tensors on " + ("CPU" if args.smoke else "cuda:0"),
            ),
        ]
    if stage == "invariance":
        cmd = [py, str(HERE / "invariance.py"), "--out", str(out / "invariance.md")]
        cmd += ["--timeout", f"{max(10.0, budget - 10):.0f}"]
        if args.smoke:
            cmd += ["--device", "cpu", "--n", "150", "--hidden", "32", "--vocab", "3000"]
        return [Step(cmd)]
    cmd = [py, str(HERE / "speed.py"), "--out", str(out / "speed.md")]
    cmd += ["--json", str(out / "speed.json"), "--budget", f"{max(10.0, budget - 30):.0f}"]
    if args.smoke:
        cmd += ["--device", "cpu", "--dtype", "float32", "--n", "256", "--hidden", "64"]
        cmd += ["--vocab", "4096", "8192"]
    return [Step(cmd)]


def _stage_text(stage: str, steps: list[Step], outcomes: list[Outcome], out: Path) -> str:
    """The stage's markdown: its own file's tables, or its commands and output tails."""
    title = f"### Stage {stage}\n"
    own = out / f"{stage}.md"
    if stage in ("invariance", "speed") and own.exists():
        text = own.read_text()
        if any(o.status != "ok" for o in outcomes):
            text += f"\n(stage {outcomes[-1].status}; output tail)\n\n```\n"
            text += _tail(outcomes[-1].output) + "\n```\n"
        return text
    parts = [title]
    if stage == "tests":
        rows = []
        for step, o in zip(steps, outcomes):
            c = parse_pytest_summary(o.output)
            rows.append((step.label, c["passed"], c["failed"], c["error"], c["skipped"], o.status))
        header = ("suite", "passed", "failed", "errors", "skipped", "status")
        parts.append(markdown_table(header, rows) + "\n")
    for step, o in zip(steps, outcomes):
        env = " ".join(f"{k}={v}" for k, v in step.env.items())
        parts.append(f"command: `{(env + ' ') if env else ''}{' '.join(step.argv)}`\n")
        parts.append(
            f"{o.status}, {o.seconds:.0f} s; output tail:\n\n```\n{_tail(o.output)}\n```\n"
        )
    text = "\n".join(parts)
    own.write_text(text)
    return text


def _header(args, torch_mod) -> str:
    import platform

    dev = "CPU (smoke run)" if args.smoke else torch_mod.cuda.get_device_name(0)
    return (
        "## GPU runbook (bench/gpu_check.py)\n\n"
        f"command: `{' '.join([os.path.basename(sys.executable), *sys.argv])}`\n\n"
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {dev}; Python {platform.python_version()}, "
        f"torch {torch_mod.__version__}\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="folder for the markdown tables and logs (created)")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--total", type=float, default=TOTAL_S, help="seconds for all stages")
    p.add_argument("--wheels", default=str(REPO / ".gpu-wheels"), help="carried wheels")
    p.add_argument("--site", default="/tmp/mp_bridge_gpu_site", help="where they install")
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU (checks the runbook)")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        torch, has_cuda = None, False
    if not has_cuda and not args.smoke:
        print(NO_CUDA)
        (out / "gpu_check.md").write_text(NO_CUDA + "\n")
        return 0
    for name in ("stages.log", "tests.log", "invariance.md", "speed.md", "speed.json"):
        (out / name).unlink(missing_ok=True)
    paths = [str(REPO), str(HERE), args.site, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in paths if x)}
    env["PYTHONUNBUFFERED"] = "1"
    summary, texts, used = [], [], []
    caps = [CAPS[s] for s in args.stages]
    for stage in args.stages:
        budget = split_budget(caps, args.total, used)
        stage_end = time.perf_counter() + budget
        steps = _steps(stage, args, budget, sys.executable)
        print(f"== stage {stage}: budget {budget:.0f} s", flush=True)
        outcomes, start = [], time.perf_counter()
        for step in steps:
            left = stage_end - time.perf_counter()
            outcomes.append(_run(step, left * step.share, out, env))
        used.append(time.perf_counter() - start)
        status = "; ".join(o.status for o in outcomes)
        summary.append((stage, status, f"{used[-1]:.0f}", f"{budget:.0f}"))
        texts.append(_stage_text(stage, steps, outcomes, out))
        print(texts[-1], flush=True)
    table = markdown_table(("stage", "status", "seconds", "budget s"), summary)
    print(table)
    full = "\n".join([_header(args, torch), table, "", *texts])
    (out / "gpu_check.md").write_text(full)
    print(f"\nwritten: {', '.join(sorted(f.name for f in out.iterdir()))} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
