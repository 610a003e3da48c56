"""``load_hf`` per rank at TP 1 / 2 / 4 against ``from_pretrained`` in one process.

Writes one LLaVA (CLIP + Llama, ~60M parameters, fp32, random, built offline by
transformers) with ``save_pretrained``, then alternates, run by run:

- ``from_pretrained``: ``LlavaForConditionalGeneration.from_pretrained(dir)`` in one
  process (1 thread), alone and then reading every weight once (transformers may leave
  weights as views of the memory-mapped file until first use);
- ``load_hf tp=N``: ``N`` gloo ranks, encoder TP N / LLM TP N, each building its shards
  from the config (``build_colocated_mimo(cfg, ...)``) and then timing ``load_hf``.

Memory is each process's peak RSS during the call minus its RSS before it (Linux: the peak
is reset through ``/proc/self/clear_refs`` first; it counts the file's mapped pages that
safetensors reads, not only copies); time is wall time of the call. Figures
are the median over ``--repeats`` runs, with the spread (max - min). CPU only; no assert.

    PYTHONPATH=. .venv/bin/python bench/hf_load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure(fn):
    """``(seconds, peak RSS growth in MiB)`` of ``fn()``."""
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS:")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, (_rss_kib("VmHWM:") - before) / 1024


def write_model(path: str) -> None:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    text = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=512,
    )
    vision = CLIPVisionConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        image_size=224,
        patch_size=14,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=31999)
    LlavaForConditionalGeneration(config).save_pretrained(path)


def _from_pretrained(path: str, read: bool) -> tuple[float, float]:
    """In its own process (one rank), like each ``load_hf`` rank. ``read``: also touch
    every weight (``from_pretrained`` may leave them as views of the mapped file, read
    on first use; ``load_hf`` copies into parameters allocated before the call)."""
    from transformers import LlavaForConditionalGeneration

    torch.set_num_threads(1)

    def load():
        model = LlavaForConditionalGeneration.from_pretrained(path)
        if read:
            for p in model.parameters():
                float(p.detach().sum())

    return _measure(load)


def _load_rank(path: str) -> tuple[float, float]:
    from mp_bridge.grid import make_grid
    from mp_bridge.models import build_colocated_mimo, destroy_colocated_mimo
    from mp_bridge.models.hf import config_from_hf, load_hf

    torch.set_num_threads(1)
    import torch.distributed as dist

    tp = dist.get_world_size()
    cfg = config_from_hf(path, seq_len=512)
    grids = (
        make_grid(tp=tp, create=("tp", "dp")),
        make_grid(tp=tp, create=("tp", "cp", "dp", ("dp", "cp"))),
    )
    model = build_colocated_mimo(cfg, *grids)
    try:
        return _measure(lambda: load_hf(path, model))
    finally:
        destroy_colocated_mimo(model, *grids)


def main() -> None:
    from mp_bridge.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="hf-load-"), "llava")
    write_model(path)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.repeats):  # methods alternate run by run
        for read, name in ((False, "from_pretrained"), (True, "from_pretrained + read all")):
            runs.setdefault(name, []).append(run_distributed(_from_pretrained, 1, path, read)[0])
        for tp in (1, 2, 4):
            per_rank = run_distributed(_load_rank, tp, path)
            worst = (max(t for t, _ in per_rank), max(m for _, m in per_rank))
            runs.setdefault(f"load_hf tp={tp} (worst rank)", []).append(worst)
    print(
        f"# {' '.join(sys.argv)}  |  checkpoint {size:.0f} MiB  |  "
        f"load average {os.getloadavg()[0]:.2f}  |  median of {args.repeats} (spread)"
    )
    print(f"{'method':<32}{'seconds':>18}{'peak RSS growth MiB':>26}")
    for name, values in runs.items():
        t, m = [v[0] for v in values], [v[1] for v in values]
        print(
            f"{name:<32}{statistics.median(t):>10.2f} ({max(t) - min(t):.2f})"
            f"{statistics.median(m):>18.0f} ({max(m) - min(m):.0f})"
        )


if __name__ == "__main__":
    main()
