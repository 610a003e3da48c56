"""Stage (a) of the GPU runbook: install the carried wheels that the machine lacks.

The GPU machine has no network; ``make gpu-wheels`` puts the wheels in ``.gpu-wheels/``
(carried with the call). A wheel is installed only when its distribution is missing or at
another version; everything goes into one ``--target`` folder (``pip install --no-index
--no-deps``), which the later stages put on ``PYTHONPATH`` after the repository root (the
tree's ``mp_bridge`` is the one tested; its wheel proves the package installs).

    python bench/gpu/wheels.py WHEEL_DIR TARGET_DIR
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["install_plan", "wheel_name_version"]

_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def _canonical(name: str) -> str:
    """PEP 503 normal form (``Liger_Kernel`` -> ``liger-kernel``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """``(canonical distribution name, version)`` of a wheel file name (PEP 427)."""
    match = _WHEEL.match(Path(filename).name)
    if match is None:
        raise ValueError(f"{filename!r} is not a wheel file name (name-version-py-abi-plat.whl)")
    return _canonical(match["name"]), match["version"]


def install_plan(wheels: list[str], installed: dict[str, str]) -> list[tuple[str, str]]:
    """``[(wheel, reason)]`` to install: those whose distribution is absent from
    ``installed`` (``{canonical name: version}``) or there at another version."""
    plan = []
    for wheel in sorted(wheels):
        name, version = wheel_name_version(wheel)
        have = installed.get(name)
        if have != version:
            reason = "missing" if have is None else f"{have} installed"
            plan.append((wheel, reason))
    return plan


def _installed() -> dict[str, str]:
    return {_canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel_dir")
    p.add_argument("target_dir")
    args = p.parse_args(argv)
    wheels = sorted(str(w) for w in Path(args.wheel_dir).glob("*.whl"))
    if not wheels:
        print(f"no wheels in {args.wheel_dir}/ (run `make gpu-wheels` and carry it)")
        return 1
    plan = install_plan(wheels, _installed())
    from report import markdown_table

    rows = [(Path(w).name, reason, "install") for w, reason in plan]
    chosen = {w for w, _ in plan}
    rows += [(Path(w).name, "same version installed", "skip") for w in wheels if w not in chosen]
    print(markdown_table(("wheel", "found", "action"), rows))
    if not plan:
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", args.target_dir]
    cmd += [w for w, _ in plan]
    print("\ncommand: `" + " ".join(cmd) + "`")
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
