"""GPU runbook v2: one call on one H100/H200 (at most 8 minutes, no network) proves what
one GPU can.

Stages, each a list of subprocesses with a time budget (a step that fails, runs out of
memory or out of time is reported and the next one still runs; time a stage leaves
unused goes to the next). Every step's result is appended to its stage's file the moment
it ends, and ``gpu_check.md`` (the summary) is rewritten after every step, so a run that
is killed keeps everything it measured:

1. ``install`` (25 s): ``bench/gpu/wheels.py`` installs the carried wheels the machine
   lacks (``.gpu-wheels/`` from ``make gpu-wheels``: megatron-core, Liger-Kernel, Cut
   Cross-Entropy, einops, mp_bridge) offline into one folder, put on ``PYTHONPATH`` after
   the repository root (the tree's ``mp_bridge`` is the one tested).
2. ``kernels`` (60 s), issue 42's first check: ``bench/gpu/first_check.py`` times each
   invariant kernel for one chunk (8192 tokens, 8192 x 4096 x 131072 bf16) next to the
   roofline's *predicted* time (60 % of the stage: the JIT compiles 6 builds first); the
   default mode's four cuBLAS slab GEMMs against their predicted times and, with two or
   more GPUs, a 256 MiB NCCL all-gather's bus bandwidth against the assumed 350 GB/s (one
   GPU: it says so; half of what is left); then ``bench/gpu/bits.py`` in bf16 hashes the
   invariant bits of the statistics build the tree has (its ``k`` step is named in the
   kernels table: the 64-step variant where the tree has it) against the record.
3. ``unit`` (75 s): every unit test (``tests/unit``).
4. ``functional`` (110 s): every functional file in the **one-GPU mode**
   (``MP_BRIDGE_TEST_DEVICE=cuda``: gloo ranks, every rank's tensors on ``cuda:0``; the
   kit starts them by forkserver), most valuable first (:data:`FUNCTIONAL_ORDER`, then
   the rest), one pytest ``-v`` run whose per-test lines stream to ``tests.log``; the
   per-file pass/fail/skip table is made from those lines, so a run cut at its budget
   still counts what it ran.
5. ``invariance`` (90 s): ``bench/gpu/bits.py`` first (30 % of the stage): the
   invariant mode's outputs and gradients hashed at a fixed shape (2048 x 2048 x 65536,
   fp32 / bf16 / fp16), compared with ``bench/gpu/invariant_bits.txt`` under this
   architecture and Triton version, the lines to record printed; then
   ``bench/gpu/invariance.py``, bitwise across TP 1/2/4/8 and
   batch composition, values and gradients, at the small shape (N=1000 H=512 V=50000,
   both engines' fused losses and the materialized ones, fp32 and bf16) and at a
   production-like one (N=2048 H=4096 V=131072: the triton engine's three fused checks
   and the torch engine's cross-entropy, one call per input dtype).
6. ``speed`` (80 s): ``bench/gpu/speed.py``, the LM-head speed / memory / precision
   table (every method, measured ms next to the roofline's *predicted* ms and their
   ratio, losses and gradients against float64 on the same inputs) at
   8192 x 4096 x 131072 with the per-rank TP-8 figure (``V_local`` = 16384), then 262144.
7. ``mimo`` (30 s): ``mp-bridge demo`` in the one-GPU mode: colocated MIMO training
   steps (encoder tp=2,dp=4 -> LLM tp=2,cp=2,dp=2) with their oracle parity table and
   per-step time.

Memory with 8 ranks on one GPU (each rank a CUDA context, ~0.5 GiB): the functional
suite's tensors are tiny. Invariance at the production shape holds per rank the fp32
weight [V, H] (2 GiB at 131072 x 4096), its TP-1 gradient (2 GiB), the largest shard and
its gradient (TP 2: 1 + 1 GiB) and chunk logits (192 x V x 4 B = 96 MiB): about 6.5 GiB,
52 GiB for 8 ranks, under an H100's 78 GiB. The materialized checks would add [N, V]
logits and their gradient in fp32 (2 GiB at N=2048) and, as measured on an H200 at
N=2048, 18 GiB per rank in all: they run at the small shape only. The speed stage is one
process; its largest method (materialized, V=262144) needs 24 GiB.

Files under ``OUT_DIR`` (at most 8, no sub-folders: what the device tool brings back):
``gpu_check.md`` (summary + every table), ``tests.md``, ``tests.log``,
``invariance.md``, ``speed.md`` (the ``kernels`` stage's tables first), ``speed.json``,
``mimo.md``, ``stages.log``. Without
CUDA it prints one line and exits 0.

The one device call (after ``make gpu-wheels``; the wheel folder is git-ignored, so it
travels only when named in ``carry``)::

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_check.py $OUT",
        carry=[".gpu-wheels"], timeout_s=540)

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

from report import markdown_table, parse_pytest_summary, per_file_counts, split_budget  # noqa: E402

NO_CUDA = (
    "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False); "
    "nothing was run (see bench/RESULTS.md, 'GPU runbook', for the device call)"
)
STAGES = ("install", "kernels", "unit", "functional", "invariance", "speed", "attention", "mimo")
CAPS = {"install": 25, "kernels": 60, "unit": 75, "functional": 95, "invariance": 90,
        "speed": 65, "attention": 30, "mimo": 30}  # fmt: skip
TOTAL_S = 470.0  # 8 minutes with room to write the files
#: Functional files, most valuable on a GPU first (the rest follow in name order; the
#: test kit's own files, which test CPU process handling, come last).
FUNCTIONAL_ORDER = (
    "test_invariant.py",
    "test_fused_loss.py",
    "test_losses.py",
    "test_vocab_layers.py",
    "test_rl_head_options.py",
    "test_loss_token_options_tp.py",
    "test_bridge.py",
    "test_bridge_ragged.py",
    "test_route.py",
    "test_partition.py",
    "test_cp_attention.py",
    "test_models_oracle.py",
    "test_models_oracle_routed.py",
    "test_models_oracle_ragged.py",
)
FUNCTIONAL_LAST = (
    "test_launcher.py",
    "test_testing_kit.py",
    "test_fault_injection.py",
    "test_cli_demo.py",
    "test_example.py",
)
STAGE_FILE = {
    "unit": "tests.md",
    "functional": "tests.md",
    "install": "stages.log",
    "kernels": "speed.md",  # 8 files at most: the kernel timings beside the speed table
    "attention": "speed.md",  # bench/attention.py's tables beside the speed table
}


@dataclass
class Step:
    """One command of a stage; ``log``: where its output goes (``stages.log`` if None)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log: str | None = None
    share: float = 1.0  # fraction of the stage's remaining time this step may take
    label: str = ""
    table: str | None = None  # a markdown file the step writes; appended to the stage's


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
            start_new_session=True,  # its ranks share its group: one kill ends all
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


def _functional_files(smoke: bool) -> list[str]:
    if smoke:
        return ["tests/functional/test_invariant.py"]
    found = sorted(p.name for p in (REPO / "tests" / "functional").glob("test_*.py"))
    first = [f for f in FUNCTIONAL_ORDER if f in found]
    last = [f for f in FUNCTIONAL_LAST if f in found]
    middle = [f for f in found if f not in first and f not in last]
    return [f"tests/functional/{f}" for f in first + middle + last]


def _steps(stage: str, args, py: str) -> list[Step]:
    out = Path(args.out_dir)
    common = [py, "-m", "pytest", "-p", "no:cacheprovider", "-rfE"]
    if stage == "install":
        return [Step([py, str(HERE / "wheels.py"), args.wheels, args.site], label="wheels")]
    if stage == "kernels":
        first = [py, str(HERE / "first_check.py")]
        bits = [py, str(HERE / "bits.py"), "--dtypes", "bfloat16"]
        if args.smoke:  # the interpreter: toy sizes, one timed call, gloo ranks on CPU
            first += ["--device", "cpu", "--n", "16", "--hidden", "16", "--vocab", "256"]
            first += ["--reps", "1", "--backend", "gloo", "--ranks", "2", "--mib", "1"]
            bits += ["--device", "cpu", "--n", "16", "--hidden", "16", "--vocab", "256"]
        steps = [
            # the JIT compiles 6 kernel builds first (unmeasured: the share is a guess)
            Step([*first, "--parts", "kernels"], share=0.6, label="invariant kernels, one chunk"),
            Step([*first, "--parts", "cublas", "nccl"], share=0.5, label="cuBLAS, NCCL"),
            Step(bits, label="invariant bits of the build in use, bf16"),
        ]
        for i, step in enumerate(steps):
            step.table = str(out / f"kernels_part{i}.tmp")
            step.argv += ["--out", step.table]
        return steps
    if stage == "unit":
        unit = ["tests/unit/test_vocab_shards.py"] if args.smoke else ["tests/unit"]
        return [Step([*common, "-q", *unit], log="tests.log", label="unit (all)")]
    if stage == "functional":
        device = {} if args.smoke else {"MP_BRIDGE_TEST_DEVICE": "cuda"}
        where = "CPU" if args.smoke else "cuda:0"
        return [
            Step(
                [*common, "-v", *_functional_files(args.smoke)],
                env=device,
                log="tests.log",
                label=f"functional, gloo ranks, tensors on {where}",
            )
        ]
    if stage == "invariance":
        inv = [py, str(HERE / "invariance.py"), "--timeout", "200"]
        if args.smoke:
            small = ["--device", "cpu", "--n", "150", "--hidden", "32", "--vocab", "3000"]
            # the torch engine only: 8 ranks of interpreted triton kernels take minutes here
            # (their TP bits are CI's tests/functional/test_triton_engine_tp.py)
            small += ["--checks", "fused_ce_none", "fused_lp", "mat_lp"]
            prod = []  # the production-like calls are GPU-only
        else:
            small = ["--n", "1000", "--hidden", "512", "--vocab", "50000"]
            prod = ["--n", "2048", "--hidden", "4096", "--vocab", "131072"]
        fused = ["--checks", "triton_ce_none", "triton_ce_mean", "triton_lp", "fused_ce_none"]
        bits = [py, str(HERE / "bits.py")]
        bits += ["--device", "cpu", "--n", "70", "--hidden", "48", "--vocab", "1024"] * args.smoke
        steps = [Step(bits, share=0.3, label="invariant bits hash, fixed shape")]
        steps.append(Step([*inv, *small], share=0.35, label="small, fp32 + bf16"))
        for i, dtype in enumerate(() if args.smoke else ("float32", "bfloat16")):
            argv = [*inv, *prod, *fused, "--dtypes", dtype]
            steps.append(Step(argv, share=0.5 if i == 0 else 1.0, label=f"production, {dtype}"))
        for i, step in enumerate(steps):
            step.table = str(out / f"invariance_part{i}.tmp")
            step.argv += ["--out", step.table]
        return steps
    if stage == "speed":
        sp = [py, str(HERE / "speed.py")]
        if args.smoke:  # the triton engine runs under the interpreter here: tiny and once
            sp += ["--device", "cpu", "--dtype", "float32", "--n", "96", "--hidden", "64"]
            sp += ["--methods", "materialized", "ours_default", "ours_invariant", "torch_default"]
            sp += ["--rounds", "1", "--no-tp8"]
            shapes = [("2048", 1.0, "V=2048")]
        else:  # the first shape also measures one rank's work at TP 8 (V_local = V / 8)
            shapes = [
                ("131072", 0.55, "8192 x 4096 x 131072 (and per rank at TP 8)"),
                ("262144", 1.0, "8192 x 4096 x 262144"),
            ]
        steps = []
        for i, (vocab, share, label) in enumerate(shapes):
            table = str(out / f"speed_part{i}.tmp")
            argv = [*sp, "--vocab", vocab, "--out", table, "--json", str(out / "speed.json")]
            argv += ["--no-tp8"] if vocab == "262144" else []
            steps.append(Step(argv, share=share, label=label, table=table))
        return steps
    if stage == "attention":  # bench/attention.py: one process, CP ranks on cuda:0, encoder
        att = [py, str(REPO / "bench" / "attention.py"), "--out", str(out / "attention.tmp")]
        if args.smoke:
            att += ["--sizes", "256", "--dtypes", "fp32", "--reps", "1"]
            att += ["--cp-sizes", "2", "--cp-lengths", "512", "--images", "2"]
        else:
            att += ["--device", "cuda", "--reps", "2", "--cp-lengths", "16384,65536"]
        return [Step(att, label="attention vs SDPA", table=str(out / "attention.tmp"))]
    device = {} if args.smoke else {"MP_BRIDGE_TEST_DEVICE": "cuda"}
    demo = [py, "-m", "mp_bridge.cli", "demo", "--steps", "3" if args.smoke else "10"]
    return [Step(demo, env=device, label="colocated MIMO steps, one-GPU mode")]


def _step_text(stage: str, step: Step, o: Outcome) -> str:
    """A step's markdown: the table it wrote, or pytest's counts, or its output tail."""
    env = " ".join(f"{k}={v}" for k, v in step.env.items())
    head = f"#### {stage}: {step.label}\n\ncommand: `{(env + ' ') if env else ''}"
    head += f"{' '.join(step.argv)}`\n\n{o.status}, {o.seconds:.0f} s\n"
    if step.table and Path(step.table).exists():
        text = Path(step.table).read_text()
        Path(step.table).unlink()
        return head + "\n" + text + ("" if o.status == "ok" else f"\n```\n{_tail(o.output)}\n```\n")
    if stage in ("unit", "functional"):
        c = parse_pytest_summary(o.output)
        row = (step.label, c["passed"], c["failed"], c["error"], c["skipped"], o.status)
        parts = [
            head,
            markdown_table(("suite", "passed", "failed", "errors", "skipped", "status"), [row]),
        ]
        if stage == "functional":
            files = per_file_counts(o.output)
            rows = [
                (f, n["passed"], n["failed"], n["error"], n["skipped"]) for f, n in files.items()
            ]
            ran = set(files)
            rows += [
                (f, "not reached", "", "", "")
                for f in step.argv
                if f.endswith(".py") and f not in ran
            ]
            parts += [
                "\nper file:\n",
                markdown_table(("file", "passed", "failed", "errors", "skipped"), rows),
            ]
        failed = [ln for ln in o.output.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        if failed:
            parts.append("\n```\n" + "\n".join(failed[:40]) + "\n```")
        return "\n".join(parts) + "\n"
    return head + f"\n```\n{_tail(o.output, 40)}\n```\n"


def _header(args, torch_mod) -> str:
    import platform

    dev = "CPU (smoke run)" if args.smoke else torch_mod.cuda.get_device_name(0)
    return (
        "## GPU runbook v2 (bench/gpu_check.py)\n\n"
        f"command: `{' '.join([os.path.basename(sys.executable), *sys.argv])}`\n\n"
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {dev}; Python {platform.python_version()}, "
        f"torch {torch_mod.__version__}; load average {os.getloadavg()[0]:.2f}\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="folder for the markdown tables and logs (created)")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--total", type=float, default=None, help="seconds for all stages")
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
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    paths = [str(REPO), args.site, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in paths if x)}
    env["PYTHONUNBUFFERED"] = "1"
    header, summary, texts, used = _header(args, torch), [], [], []
    # Smoke runs on a CPU (toy sizes; a loaded CI machine): five times the GPU budgets.
    scale = 5.0 if args.smoke else 1.0
    caps = [CAPS[s] * scale for s in args.stages]
    if args.total is None:
        args.total = TOTAL_S * scale

    def write_summary() -> None:
        table = markdown_table(("stage", "step", "status", "seconds", "budget s"), summary)
        (out / "gpu_check.md").write_text("\n".join([header, table, "", *texts]))

    for stage in args.stages:
        budget = split_budget(caps, args.total, used)
        stage_end = time.perf_counter() + budget
        print(f"== stage {stage}: budget {budget:.0f} s", flush=True)
        start = time.perf_counter()
        for step in _steps(stage, args, sys.executable):
            if args.smoke:  # toy sizes: a step may use all the stage has left
                step.share = 1.0
            left = stage_end - time.perf_counter()
            o = _run(step, left * step.share, out, env)
            text = _step_text(stage, step, o)
            own = out / STAGE_FILE.get(stage, f"{stage}.md")
            with open(own, "a") as f:  # appended the moment the step ends
                f.write(text + "\n")
            texts.append(text)
            summary.append((stage, step.label, o.status, f"{o.seconds:.0f}", f"{budget:.0f}"))
            write_summary()
            print(text, flush=True)
        used.append(time.perf_counter() - start)
    print(markdown_table(("stage", "step", "status", "seconds", "budget s"), summary))
    print(f"\nwritten: {', '.join(sorted(f.name for f in out.iterdir()))} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
