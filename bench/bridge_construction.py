"""Construction time of the colocated bridge at large world sizes, on torch's fake process group.

Rank 0's view of a world of ``N`` ranks (``torch.testing._internal.distributed.fake_pg``:
no peer exists, every collective returns at once), so the time is what one rank spends in
Python building its groups: ``new_group`` calls (every rank creates every group), the plan
and the checks. Methods, each timed in a fresh process (alternated, ``--repeats`` rounds):

- ``ours``: this tree's ``ColocatedBridgeCommunicator`` (gather and world groups; the route
  groups wait for the first ``route``);
- ``ours+route``: the same, then ``prepare_route()`` (what a routing user pays once);
- ``base``: the communicator of ``--base`` (a git revision of this repository, extracted
  with ``git archive`` into a temporary folder, or a source tree), e.g. ``3446951``, the
  last commit whose communicator made every group up front;
- ``megatron``: megatron-core's own ``ColocatedBridgeCommunicator`` (>= 0.18), whose
  hard-coded ``backend='nccl'`` is dropped so it runs on the fake backend.

Usage (the layout of the issue: tp2·dp8192 -> tp4·dp4096, 16,384 ranks)::

    python bench/bridge_construction.py --src 2x8192 --dest 4x4096 --repeats 3 \\
        --base 3446951 --python .venv-mcore019/bin/python

Prints a Markdown table (median and spread over the repeats) with the command, the Python,
megatron-core's version and the load average. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

METHODS = ("ours", "ours+route", "base", "megatron")

_CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron.core.hyper_comm_grid import HyperCommGrid

method, tp_s, dp_s, tp_d, dp_d = sys.argv[1], *map(int, sys.argv[2:6])
world = tp_s * dp_s
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
src = HyperCommGrid([tp_s, 1, 1, dp_s], ["tp", "cp", "pp", "dp"])
dest = HyperCommGrid([tp_d, 1, 1, dp_d], ["tp", "cp", "pp", "dp"])
if method == "megatron":
    import megatron.core.models.mimo.comm.colocated_communicator as mc

    real = dist.new_subgroups_by_enumeration

    def no_backend(ranks, backend=None, **kw):  # the fake world has no NCCL
        return real(ranks, **kw)

    mc.dist.new_subgroups_by_enumeration = no_backend
    cls = mc.ColocatedBridgeCommunicator
else:
    from mp_bridge.comm import ColocatedBridgeCommunicator as cls
t0 = time.perf_counter()
comm = cls(src, dest, "encoder", "llm", {"b": 0, "h": 1})
if method == "ours+route":
    comm.prepare_route()
t1 = time.perf_counter()
print(json.dumps({"s": t1 - t0}))
"""


def _layout(text: str) -> tuple[int, int]:
    tp, dp = text.lower().split("x")
    return int(tp), int(dp)


def _run(method: str, args, python: str) -> float | None:
    env = dict(os.environ)
    root = args.base if method == "base" else os.path.dirname(os.path.dirname(__file__))
    env["PYTHONPATH"] = os.path.abspath(root)
    cmd = [python, "-c", _CHILD, method, *map(str, (*args.src, *args.dest))]
    # cwd "/": ``python -c`` puts the cwd first on sys.path, ahead of PYTHONPATH.
    out = subprocess.run(
        cmd, env=env, cwd="/", capture_output=True, text=True, timeout=args.timeout
    )
    if out.returncode:
        print(f"# {method} failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["s"]


def _version(python: str) -> str:
    code = "import megatron.core as m; print(m.__version__)"
    out = subprocess.run([python, "-W", "ignore", "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "not importable"


def _extract(revision: str) -> str:
    """``mp_bridge/`` of git ``revision`` of this repository, unpacked into a temp folder."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix=f"mp_bridge_{revision}_")
    tar = subprocess.run(
        ["git", "-C", repo, "archive", revision, "mp_bridge"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", out], input=tar, check=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=_layout, default=(2, 8192), help="encoder TPxDP")
    p.add_argument("--dest", type=_layout, default=(4, 4096), help="LLM TPxDP")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--base", default=None, help="git revision or source tree for 'base'")
    p.add_argument("--python", default=sys.executable, help="interpreter of every method")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    methods = [m for m in args.methods.split(",") if m and (m != "base" or args.base)]
    if args.base and not os.path.isdir(args.base):
        args.base = _extract(args.base)
    world = args.src[0] * args.src[1]

    times: dict[str, list[float]] = {m: [] for m in methods}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):  # alternate: drifting load hits every method alike
        for m in methods:
            s = _run(m, args, args.python)
            if s is not None:
                times[m].append(s)
        load.append(os.getloadavg()[0])

    print(f"command: `{shlex.join([os.path.basename(sys.executable), *sys.argv])}`")
    print(
        f"world {world} ranks (fake process group, rank 0's view); "
        f"tp{args.src[0]}·dp{args.src[1]} -> tp{args.dest[0]}·dp{args.dest[1]}; "
        f"python {args.python}; megatron-core {_version(args.python)}; "
        f"load average (1 min) {min(load):.2f}-{max(load):.2f}; {time.strftime('%Y-%m-%d')}"
    )
    print()
    print("| method | median s | min s | max s | runs |")
    print("|---|---:|---:|---:|---:|")
    for m in methods:
        t = times[m]
        if not t:
            print(f"| {m} | failed | | | 0 |")
            continue
        print(f"| {m} | {statistics.median(t):.3f} | {min(t):.3f} | {max(t):.3f} | {len(t)} |")


if __name__ == "__main__":
    main()
