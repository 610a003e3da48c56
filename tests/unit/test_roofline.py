"""``bench/gpu/roofline.py``'s arithmetic against numbers worked out by hand (not the code
against itself): FLOPs, HBM and L2 bytes of single kernels, the L2 rule, the rates, and
the TP 8 collectives. The compiled facts are literals here, not the record."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_roofline", GPU / "roofline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rl = _load()
FACT = {"kind": "mma.sync", "mma": ["m16n8k16.row.col.f32.bf16.bf16.f32"], "stages": 3}
FACTS = {
    "_block_stats_kernel bf16 spec": dict(FACT, ctas_per_sm=2),
    "_block_grad_kernel bf16 spec": dict(FACT, ctas_per_sm=2),
    "_block_dhidden_kernel bf16 spec": dict(FACT, ctas_per_sm=4),
    "_block_dweight_kernel bf16 spec": dict(FACT, kind="wgmma", mma=["m64n32k16"], ctas_per_sm=4),
}


def test_block_stats_at_a_small_shape():
    # N x H x V = 64 x 64 x 512: one chunk of 64 tokens, K = 2 blocks, 2 x 2 = 4 programs
    k = rl.block_logits_pass(rl.Shape(64, 64, 512), FACTS, "_block_stats_kernel", "s", 2048)
    assert k.flops == 4_194_304  # 2 * 64 * 512 * 64
    # W once (512 * 64 * 2) + h chunk once (64 * 64 * 2, fits in L2) + the 2048 B stats
    assert k.hbm == 65_536 + 8_192 + 2_048
    assert k.l2 == 147_456  # 4 programs * (32 + 256) rows * 64 * 2 B
    assert k.kind == "mma.sync"
    assert k.times["compute"] == pytest.approx(4_194_304 / 353.7e12)  # 45 % of 786
    assert k.times["l2"] == pytest.approx(147_456 / 7e12)
    assert k.times["hbm"] == pytest.approx(75_776 / 4.08e12)  # 4.8 TB/s * 85 %
    assert k.bound == "l2" and k.seconds == pytest.approx(2.10651e-8, rel=1e-5)


def test_block_dweight_at_a_small_shape_and_its_g_rereads_at_the_production_one():
    k = rl.block_dweight_pass(rl.Shape(64, 64, 512), FACTS)
    # g chunk 64 * 512 * 2 (fits: once) + h 64 * 64 * 2 + the fp32 acc 512 * 64 * 4 in and out
    assert k.hbm == 65_536 + 8_192 + 2 * 131_072
    assert k.l2 == 131_072  # 8 programs * 2 token tiles * (64 + 64) * 32 * 2 B
    assert k.times["compute"] == pytest.approx(4_194_304 / (0.8 * 786e12))
    big = rl.block_dweight_pass(rl.Shape(8192, 4096, 131072), FACTS)
    # 256 MiB g chunk > 50 MB: read by each of the 64 column tiles, 8 chunks; + h; + acc
    assert big.hbm == 8 * 64 * 268_435_456 + 8 * 8_388_608 + 8 * 2 * 2_147_483_648


def test_the_default_modes_first_gemm():
    k = rl.default_mode(rl.Shape(8192, 4096, 131072), FACTS)[0]
    assert k.flops == 8_796_093_022_208  # 2 * 8192 * 4096 * 131072
    # 64 slabs of 2048 rows: h (64 MiB > L2) re-read per slab, W once, fp32 z written
    assert k.hbm == 64 * 67_108_864 + 1_073_741_824 + 64 * 67_108_864
    assert k.l2 == 0 and k.seconds == pytest.approx(8_796_093_022_208 / 755e12)


def test_tp8_collectives_per_rank():
    got = rl.collective_bytes(rl.Shape(8192, 4096, 131072, tp=8))
    stats = 7 * 4 * 8192 * 4
    assert got["default"] == stats + 234_881_024  # ring all-reduce: 2 * 7 / 8 * 128 MiB
    assert got["invariant"] == stats + 7 * 134_217_728  # all-gather of 7 ranks' d h
    assert rl.collective_bytes(rl.Shape(8192, 4096, 131072))["default"] == 0


def test_a_kernel_takes_the_longest_of_its_times():
    k = rl.Kernel("m", "k", "wgmma", flops=628.8e12, hbm=4.08e12 * 2, l2=7e12 * 0.5)
    assert k.times["compute"] == pytest.approx(1.0) and k.seconds == pytest.approx(2.0)
    assert k.bound == "hbm"


def test_the_speed_table_puts_measured_next_to_predicted(monkeypatch):
    from argparse import Namespace

    monkeypatch.syspath_prepend(str(GPU))  # speed.py imports its siblings by name
    spec = importlib.util.spec_from_file_location("gpu_speed", GPU / "speed.py")
    speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speed)
    pred = rl.predicted_ms(8192, 4096, 131072)
    res = {
        m: {"seconds": sec, "peak": 2**30, "runs": 1, "error": None, "precision": None}
        for m, sec in (("ours_default", 2 * pred["ours_default"] / 1e3), ("liger", 0.05))
    }
    args = Namespace(n=8192, hidden=4096, dtype="bfloat16")
    text = speed.shape_report(args, 131072, res)
    row = next(line for line in text.splitlines() if line.startswith("| ours_default"))
    assert f"| {pred['ours_default']:.1f} | 2.00 |" in row
    assert "| liger | 50.0 | n/a | n/a |" in text
    assert "*predicted*" in text
