"""Stage (c) of the GPU runbook, last step: the invariant mode's bits at one fixed shape,
hashed, so that any later change to them is seen.

The triton engine with ``invariant=True``, TP 1, at ``N x H x V`` = 2048 x 2048 x 65536
(one 2048-token chunk, whole 256-row blocks: the running, 16-divisible builds), inputs
drawn on the CPU from one seed and moved to the device, bf16 / fp32 / fp16 (the table is
rewritten after each dtype: a step cut at its budget keeps what it hashed):

- ``ce``: ``fused_linear_cross_entropy`` (label smoothing 0.1, ignored tokens,
  ``reduction="none"``, per-token upstream weights): the losses, ``d hidden``, ``d weight``;
- ``lp``: ``fused_linear_logprobs`` (temperature 0.8) with its entropy: both, ``d hidden``,
  ``d weight``.

Each line is ``<key> <dtype> <check> <sha256[:16]>``; the key names what decides the bits:
the device's architecture (``sm_90``), the Triton and torch versions (bits are per
architecture and per Triton version) and the shape. ``RECORD``
(``bench/gpu/invariant_bits.txt``) holds lines from earlier runs: a line whose key and
check are recorded is ``same`` or **differs** (exit 1: a change moved the invariant bits;
if it was meant to, record the new line there with its reason); an unrecorded key is
``new`` (copy the printed lines into the record). The CPU smoke run hashes the
interpreter's bits under its own key (not recorded: ``bench/numerics_hashes.txt`` holds
the interpreter's bits).

    python bench/gpu/bits.py --out OUT/bits.md
    python bench/gpu/bits.py --device cpu --n 70 --hidden 48 --vocab 1024 --out /tmp/bits.md
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the triton engine's kernels on CPU: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mp_bridge.layers import fused_linear_cross_entropy, fused_linear_logprobs  # noqa: E402

RECORD = Path(__file__).resolve().parent / "invariant_bits.txt"
DTYPES = ("bfloat16", "float32", "float16")  # the production dtype first


def key(device: torch.device, n: int, hidden: int, vocab: int) -> str:
    import triton

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    else:
        arch = "cpu-interpreter"
    torch_v = torch.__version__.split("+")[0]
    return f"{arch} triton={triton.__version__} torch={torch_v} {n}x{hidden}x{vocab}"


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def hashes(n: int, hidden: int, vocab: int, dtype: torch.dtype, device) -> dict[str, str]:
    """``{check: digest}`` of the two invariant calls at one dtype."""
    g = torch.Generator().manual_seed(36)
    h0 = torch.randn(n, hidden, generator=g)
    w0 = torch.randn(vocab, hidden, generator=g) * hidden**-0.5 * 3
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::7] = -100
    up = torch.linspace(0.5, 1.5, n).to(device)
    t = t.to(device)
    kw = {"engine": "triton", "invariant": True}
    out = {}
    h, w = (x.to(device, dtype).requires_grad_() for x in (h0, w0))
    ce = fused_linear_cross_entropy(h, w, t, label_smoothing=0.1, reduction="none", **kw)
    (ce * up).sum().backward()
    out["ce"] = digest(ce, h.grad, w.grad)
    h, w = (x.to(device, dtype).requires_grad_() for x in (h0, w0))
    lp, ent = fused_linear_logprobs(
        h, w, t.clamp(min=0), temperature=0.8, return_entropy=True, **kw
    )
    (lp * up + ent * up.flip(0)).sum().backward()
    out["lp"] = digest(lp, ent, h.grad, w.grad)
    return out


def recorded(path: Path | None = None) -> dict[tuple[str, str, str], str]:
    """``{(key, dtype, check): digest}`` of the record (``#`` lines are comments)."""
    path = path or RECORD
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 7 and not line.startswith("#"):
            rows[(" ".join(parts[:4]), parts[4], parts[5])] = parts[6]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    p.add_argument("--out", required=True, help="markdown file to write")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    k, record = key(dev, args.n, args.hidden, args.vocab), recorded()
    lines, rows, differs = [], [], False
    for name in args.dtypes:
        for check, hx in hashes(args.n, args.hidden, args.vocab, getattr(torch, name), dev).items():
            was = record.get((k, name, check))
            state = "new" if was is None else ("same" if was == hx else f"**differs** (was {was})")
            differs |= was is not None and was != hx
            lines.append(f"{k} {name} {check} {hx}")
            rows.append((name, check, hx, state))
        text = table_text(args, k, rows, lines)
        Path(args.out).write_text(text)
    print(text)
    return 1 if differs else 0


def table_text(args, k: str, rows: list, lines: list[str]) -> str:
    from report import markdown_table

    return (
        "### Invariant bits at a fixed shape (stage c)\n\n"
        f"command: `{' '.join([os.path.basename(sys.executable), *sys.argv])}`\n\n"
        f"N x H x V = {args.n} x {args.hidden} x {args.vocab}, TP 1, triton engine, "
        f"invariant=True; key `{k}`; record `bench/gpu/invariant_bits.txt`\n\n"
        f"{markdown_table(('inputs', 'check', 'sha256[:16]', 'recorded'), rows)}\n\n"
        "Lines for the record:\n\n```\n" + "\n".join(lines) + "\n```\n"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
