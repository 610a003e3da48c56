"""``bench/gpu/roofline.py``'s arithmetic against numbers worked out by hand (not the code
against itself): FLOPs, HBM and L2 bytes of single kernels, the L2 rule, the rates, and
the TP 8 collectives. The compiled facts are literals here, not the record."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU))  # roofline.py imports its siblings (comm_model) by name


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
    "_dhidden_kernel bf16 spec": dict(FACT, kind="wgmma", mma=["m64n256k16"], ctas_per_sm=1),
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
    # g chunk 64 * 512 * 2 (once) + h 64 * 64 * 2 (fits: once) + d W 512 * 64 * 2 written
    # in bf16 (one chunk: no fp32 accumulator)
    assert k.hbm == 65_536 + 8_192 + 65_536
    # 4 programs (512 / 128 row tiles x one 256-wide hidden tile) * 1 token step of 64
    # * (128 + 256) * 64 * 2 B
    assert k.l2 == 196_608
    assert k.times["compute"] == pytest.approx(4_194_304 / (0.8 * 786e12))
    big = rl.block_dweight_pass(rl.Shape(8192, 4096, 131072), FACTS)
    # one chunk of 8192 tokens: groups of 8 vocab tiles, the 2 GiB g read once (8 g slices
    # + one h slice between its users fit); h [8192, 4096] (64 MiB > L2) once per group of
    # 8 of the 1024 vocab tiles: 128 times; d W bf16 written, no accumulator
    assert big.hbm == 2_147_483_648 + 128 * 67_108_864 + 1_073_741_824
    tp8 = rl.block_dweight_pass(rl.Shape(8192, 4096, 131072, tp=8), FACTS)
    # one chunk of 8192 tokens: g [8192, 16384] bf16 once; h [8192, 4096] bf16 (64 MiB > L2)
    # once per group of 8 of the 128 vocab tiles: 16 times; d W bf16 [16384, 4096] written
    assert tp8.hbm == 268_435_456 + 16 * 67_108_864 + 134_217_728


def test_dhidden_by_token_row_ownership_at_a_small_shape_and_the_production_ones():
    k = rl.dhidden_pass(rl.Shape(64, 64, 512), FACTS)
    assert k.flops == 4_194_304  # 2 * 64 * 512 * 64
    # g chunk 64 * 512 * 2 (once) + W 512 * 64 * 2 (once) + the fp32 d h 64 * 64 * 4
    assert k.hbm == 65_536 + 65_536 + 16_384
    # 1 program (one 128 x 256 tile) * 512 / 64 k steps * (128 * 64 + 64 * 256) * 2 B
    assert k.l2 == 393_216
    assert k.busy == pytest.approx(1 / 132)  # one program: one SM of 132
    assert k.times["l2"] == pytest.approx(393_216 / (7e12 / 132))
    tp1 = rl.dhidden_pass(rl.Shape(8192, 4096, 131072), FACTS)
    # one chunk of 8192: 64 token tiles x 16 column tiles = 1024 programs; 132 // 64 = 2
    # tile rows in flight share g: the 2 GiB g read 16 / 2 = 8 times; W 1 GiB once; d h
    # 128 MiB fp32 out
    assert tp1.hbm == 8 * 2_147_483_648 + 1_073_741_824 + 134_217_728
    assert tp1.l2 == 1024 * 2048 * 49_152 and tp1.busy == 1.0
    tp8 = rl.dhidden_pass(rl.Shape(8192, 4096, 131072, tp=8), FACTS)
    # this rank's 1024 of the chunk's 8192 token rows over the whole vocab and all 4096
    # columns: 8 x 16 = 128 programs; its g rows [1024, 131072] bf16 once, the gathered
    # W [131072, 4096] bf16 once, its d h rows [1024, 4096] fp32 out
    assert tp8.flops == 2 * 1024 * 131072 * 4096 and tp8.busy == pytest.approx(128 / 132)
    assert tp8.hbm == 268_435_456 + 1_073_741_824 + 16_777_216
    assert tp8.l2 == 128 * 2048 * 49_152


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
    # invariant: 7 ranks' raw block statistics (64 blocks each, S = 4, fp32); d h by
    # token-row ownership, one chunk of 8192 tokens: 7 weight shards (16384 x 4096 bf16,
    # once), this rank's 1024 g rows from 7 ranks (1024 x 16384 bf16), 7 ranks' d h rows
    # (1024 x 4096 fp32)
    raw = 7 * 4 * 64 * 8192 * 4
    assert got["invariant"] == raw + 7 * (134_217_728 + 33_554_432 + 16_777_216)
    assert got["invariant"] == 1_350_565_888  # was 2 172 649 472 by column ownership
    assert rl.collective_bytes(rl.Shape(8192, 4096, 131072))["default"] == 0


def test_tp8_collective_time_by_hand():
    s = rl.Shape(8192, 4096, 131072, tp=8)
    res = rl.predict(s, FACTS)
    # at 350 GB/s: statistics 58 720 256 B (plain, forward): 0.16777 ms; weight 939 524 096
    # B: 2.68435 ms, started with the backward; g rows 234 881 024 B: 0.67109 ms, started
    # after block_grad; d h rows 117 440 512 B: 0.33554 ms, started after dhidden, waited
    # for at the end: exposed
    stats, weight, rows, dh = 0.16777e-3, 2.68435e-3, 0.67109e-3, 0.33554e-3
    assert stats + weight + rows + dh == pytest.approx(1_350_565_888 / 350e9, rel=1e-4)
    sec = {key: sum(k.seconds for k in res["invariant"] if key in k.name)
           for key in ("block_grad", "block_dweight")}  # fmt: skip
    # hidden: the all-to-all (after the weight gather and block_grad) ends before
    # block_grad + block_dweight do
    assert max(sec["block_grad"], weight) + rows < sec["block_grad"] + sec["block_dweight"]
    compute = sum(k.seconds for k in res["invariant"])
    total, own, exposed = rl.call_seconds(s, "invariant", res["invariant"])
    assert own == pytest.approx(stats + weight + rows + dh, rel=1e-4)
    assert exposed == pytest.approx(stats + dh, rel=1e-4)
    assert total == pytest.approx(compute + stats + dh, rel=1e-4)
    # default: 917 504 B of statistics + 234 881 024 B of ring all-reduce, both plain
    total, own, exposed = rl.call_seconds(s, "default", res["default"])
    assert own == pytest.approx(235_798_528 / 350e9) and exposed == pytest.approx(own)


def test_the_timeline_hides_only_what_runs_beside_a_started_collective():
    from comm_model import timeline

    # a 3 s collective started before a 1 s kernel, waited for: 2 s exposed
    assert timeline([("start", "a", 3.0), ("kernel", "k", 1.0), ("wait", "a")]) == (3.0, 2.0)
    # plain: all 3 s exposed; two started collectives run one after the other
    assert timeline([("kernel", "k", 1.0), ("sync", "a", 3.0)]) == (4.0, 3.0)
    two = [("start", "a", 1.0), ("start", "b", 1.0), ("kernel", "k", 1.5), ("wait", "b")]
    assert timeline(two) == (2.0, 0.5)


def test_block_dweight_counts_its_accumulator_and_its_zero_fill():
    s = rl.Shape(16384, 4096, 131072)
    k = rl.block_dweight_pass(s, FACTS)
    # 2 chunks of 8192 x (131072 / 128 vocab tiles x 4096 / 256 hidden tiles) = 32 768
    # programs, 8192 / 64 = 128 token steps each, (128 + 256) x 64 bf16 per step = 49 152
    # B: 206 158 430 208 B; + the fp32 [131072, 4096] accumulator (2 GiB) in and out per
    # chunk: 4 x 2 147 483 648 = 8 589 934 592 B
    assert k.l2 == 206_158_430_208 + 8_589_934_592
    assert k.seconds == pytest.approx(214_748_364_800 / 7e12)  # 30.68 ms, L2-bound
    # the 8 chunks of 1024 at 8192 x 4096 x 131072: 34.4 GB more through L2
    old = rl.block_dweight_pass(rl.Shape(65536, 4096, 131072), FACTS)  # 8 chunks of 8192
    assert old.l2 - 8 * 16384 * 128 * 49_152 == 16 * 2_147_483_648  # = 34 359 738 368
    assert not [x for x in rl.invariant_mode(rl.Shape(8192, 4096, 131072), FACTS)
                if "zero-fill" in x.name]  # fmt: skip  # one chunk: no accumulator
    zero = [x for x in rl.invariant_mode(s, FACTS) if "zero-fill" in x.name]
    assert len(zero) == 1 and zero[0].hbm == 2_147_483_648  # torch.zeros of the accumulator
    assert zero[0].seconds == pytest.approx(2_147_483_648 / 4.08e12)


def test_the_statistics_fold_is_one_launch_plus_its_bytes_per_8192_tokens():
    for tp in (1, 8):  # TP 8 folds every rank's blocks too: all K = 512
        k = rl.fold_stats_pass(rl.Shape(8192, 4096, 131072, tp=tp))
        # one group of 8192 tokens: S K N fp32 read (64 MiB), S N written (128 KiB)
        assert k.launches == 1 and k.hbm == 67_108_864 + 131_072
        assert k.seconds == pytest.approx(4e-6 + 67_239_936 / 4.08e12)  # 20.5 us, was 0.43 ms
    two = rl.fold_stats_pass(rl.Shape(16384, 4096, 1024))  # 2 groups, K = 4
    assert two.launches == 2 and two.hbm == 4 * 4 * 16384 * 4 + 4 * 16384 * 4


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
    assert [k.facts for k in ks].count("torch copy") == 0 and len(ks) == 7
    # the fp32 d h accumulator's zero-fill: [8192, 4096] fp32 written
    assert ks[2].name.startswith("bwd: zero-fill") and ks[2].hbm == 134_217_728
    dw = ks[5]
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


def test_the_invariant_modes_peak_memory_by_hand():
    mm = rl_memory()
    # 8192 x 4096 x 131072 bf16, TP 1, one chunk of 8192: d h fp32 128 MiB, d W bf16 1024
    # (written directly, no accumulator), g [8192, 131072] bf16 2048
    phases = mm.invariant_phases(8192, 4096, 131072, 1, 2)
    assert max(phases.values()) == phases["backward chunk (d h, d W, g)"]
    assert phases["backward chunk (d h, d W, g)"] == (128 + 1024 + 2048) * 2**20
    assert phases["end (d h, d W, d h copy)"] == (128 + 1024 + 64) * 2**20
    # 16384 tokens, 2 chunks: the fp32 accumulator 2048 instead of d W, then both at the end
    two = mm.invariant_phases(16384, 4096, 131072, 1, 2)
    assert two["end (d h, d W, d h copy)"] == (256 + 2048 + 1024 + 128) * 2**20
    # TP 8 per rank, one chunk of 8192 tokens: d h 128 MiB, d W bf16 [16384, 4096] 128 (no
    # accumulator), local g [8192, 16384] 256, the gathered weight [131072, 4096] 1024,
    # this rank's g rows [1024, 131072] 256 and its fp32 d h rows [1024, 4096] 16
    tp8 = mm.invariant_phases(8192, 4096, 131072, 8, 2)
    assert tp8["backward chunk (d h, d W, g)"] == (128 + 128 + 256 + 1024 + 256 + 16) * 2**20


def rl_memory():
    spec = importlib.util.spec_from_file_location("gpu_memory_model", GPU / "memory_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_states_the_memory_target(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))
    text = rl.table([rl.Shape(8192, 4096, 131072)], rl.load_facts())
    assert "- predicted default peak GiB / 1.25, 8192x4096x131072, TP 1: **met**" in text
    assert "- predicted invariant peak GiB / 4.5, 8192x4096x131072, TP 1: **met**" in text
    assert "bf16: default mode 1.219 GiB at row_grad" in text
    fp32 = rl.table([rl.Shape(8192, 4096, 131072, dtype="fp32")], rl.load_facts())
    assert "none at this dtype" in fp32 and "FMA dot (no MMA)" in fp32
