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
    # N x H x V = 64 x 64 x 512: one chunk of 64 tokens, K = 2 blocks, one 128-row tile
    # (block_stats.TILE_M) x 2 blocks = 2 programs
    k = rl.block_logits_pass(rl.Shape(64, 64, 512), FACTS, "_block_stats_kernel", "s", 2048)
    assert k.flops == 4_194_304  # 2 * 64 * 512 * 64
    # W once (512 * 64 * 2) + h chunk once (64 * 64 * 2, fits in L2) + the 2048 B stats
    assert k.hbm == 65_536 + 8_192 + 2_048
    assert k.l2 == 98_304  # 2 programs (one 128-row tile x 2 blocks) * (128 + 256) * 64 * 2 B
    assert k.kind == "mma.sync"
    assert k.times["compute"] == pytest.approx(4_194_304 / 353.7e12)  # 45 % of 786
    assert k.times["l2"] == pytest.approx(98_304 / 7e12)
    assert k.times["hbm"] == pytest.approx(75_776 / 4.08e12)  # 4.8 TB/s * 85 %
    # 75 776 B / 4.08 TB/s = 18.57 ns > L2 14.04 ns > compute 11.86 ns
    assert k.bound == "hbm" and k.seconds == pytest.approx(1.857255e-8, rel=1e-5)


def test_block_dweight_at_a_small_shape_and_its_g_reads_at_the_production_one():
    k = rl.block_dweight_pass(rl.Shape(64, 64, 512), FACTS)
    # g chunk 64 * 512 * 2 (once) + h 64 * 64 * 2 (fits: once) + the fp32 acc 512 * 64 * 4
    # in and out
    assert k.hbm == 65_536 + 8_192 + 2 * 131_072
    # 4 programs (512 / 128 row tiles x one 128-wide hidden tile) * 2 token steps of 32
    # * (128 + 128) * 32 * 2 B
    assert k.l2 == 131_072
    assert k.times["compute"] == pytest.approx(4_194_304 / (0.8 * 786e12))
    big = rl.block_dweight_pass(rl.Shape(8192, 4096, 131072), FACTS)
    # hidden tiles fastest: each 256 MiB g chunk read once (its 32 hidden-tile users run
    # together), 8 chunks; h chunk 8 MiB + one g slice fits: once per chunk; + acc in, out
    assert big.hbm == 8 * 268_435_456 + 8 * 8_388_608 + 8 * 2 * 2_147_483_648


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


def test_the_default_modes_d_w_comes_out_of_cublas_in_bf16_with_no_copy():
    ks = rl.default_mode(rl.Shape(8192, 4096, 131072), FACTS)
    assert [k.facts for k in ks].count("torch copy") == 0 and len(ks) == 6
    dw = ks[4]
    assert dw.name.startswith("bwd: dW_s") and dw.kind == "cublas_bf16"
    # h (64 MiB > L2) per slab, W once, per slab g bf16 (32 MiB) in and d W_s bf16 (16 MiB) out
    assert dw.hbm == 64 * 67_108_864 + 1_073_741_824 + 64 * (33_554_432 + 16_777_216)
    assert dw.seconds == pytest.approx(8_796_093_022_208 / 786e12)  # 11.19 ms, was 11.65


def test_fp32_inputs_run_sgemm_and_fma_tiles():
    fma = {"kind": "none", "mma": [], "stages": 3, "ctas_per_sm": 1}
    facts = {f"{k.split()[0]} fp32 spec": fma for k in FACTS}
    s = rl.Shape(64, 64, 512, dtype="fp32")
    z = rl.default_mode(s, facts)[0]
    assert z.kind == "cublas_fp32" and z.times["compute"] == pytest.approx(4_194_304 / 53.6e12)
    k = rl.block_logits_pass(s, facts, "_block_stats_kernel", "s", 2048)
    # W (512 * 64 * 4) + h (64 * 64 * 4) + stats; 32-row tiles: 2 tiles x 2 blocks = 4
    # programs * (32 + 256) rows * 64 * 4 B
    assert k.hbm == 131_072 + 16_384 + 2_048 and k.l2 == 294_912
    assert k.kind == "fma" and k.times["compute"] == pytest.approx(4_194_304 / (0.45 * 53.6e12))
    assert not any("copy" in x.facts for x in rl.invariant_mode(s, facts))  # acc is d W


def test_the_default_modes_peak_memory_by_hand():
    mm = rl_memory()
    # 8192 x 4096 x 131072 bf16, Vs 2048: d W 1024 MiB + d h acc 128 + z 64 + g 32 at row_grad
    phase, peak = mm.default_peak(8192, 4096, 131072, 2, 2048)
    assert phase.startswith("row_grad") and peak == 1248 * 2**20
    phases = mm.default_phases(8192, 4096, 131072, 2, 2048, fp32_dw_product=True)
    assert phases["d W_s (d W, d h acc, g)"] == (1024 + 128 + 32 + 32) * 2**20  # was; now - 32
    assert mm.floor_bytes(8192, 4096, 131072, 2) == (1024 + 64) * 2**20


def rl_memory():
    spec = importlib.util.spec_from_file_location("gpu_memory_model", GPU / "memory_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_states_the_memory_target(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))
    text = rl.table([rl.Shape(8192, 4096, 131072)], rl.load_facts())
    assert "- predicted default peak GiB / 1.25, 8192x4096x131072, TP 1: **met**" in text
    assert "bf16: default mode 1.219 GiB at row_grad" in text
    fp32 = rl.table([rl.Shape(8192, 4096, 131072, dtype="fp32")], rl.load_facts())
    assert "none at this dtype" in fp32 and "FMA dot (no MMA)" in fp32
