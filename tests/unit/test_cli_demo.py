"""``mp-bridge demo`` argument checks (all before any process starts), its parity table, and
the model it widens for TP sizes that do not divide 8 (literal sizes)."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from mp_bridge.cli import main
from mp_bridge.commands.demo import (
    _validate,
    default_layouts,
    demo_config,
    format_parity_table,
)
from mp_bridge.models import MimoConfig, ParityReport


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "8", "--encoder", "tp=2,dp=2"], "--encoder: .* covers 4 ranks"),
        (["--encoder", "tp=2,cp=4"], "--encoder: .* unknown axis 'cp'"),
        (["--llm", "tp=2,cp=2,dp=3"], "--llm: .* covers 12 ranks"),
        (["--steps", "0"], "--steps=0 must be an int >= 1"),
        (["--batch-size", "6"], "--batch-size 6 does not split over --encoder dp=4"),
        # TP 3 / CP 16 are no longer refused: demo_config widens the model (heads, FFN,
        # sequence) to fit; see tests/unit/test_acceptance_layers_unit.py.
        # dp 4 -> dp 3 does not nest: the bridge plan refuses it with the rank's coordinates.
        (["--world", "12", "--encoder", "tp=3,dp=4", "--llm", "tp=4,dp=3"], "divide"),
        (["--lr", "-1"], r"--lr=-1.0 must be a finite float > 0; e.g. --lr 1e-2"),
        (["--lr", "nan"], r"--lr=nan must be a finite float > 0"),
        (["--batch-size", "0"], "--batch-size=0 must be an int >= 1"),
        # Checked before training, not when the PNG is written at the end.
        (["--plot", "/nonexistent/dir/x.png"], "folder /nonexistent/dir does not exist"),
        (["--microbatches", "2"], "--microbatches 2 needs a pipelined LLM: add a pp axis"),
        (["--microbatches", "0"], "--microbatches=0 must be an int >= 1"),
        (
            ["--llm", "tp=2,pp=2,dp=2", "--microbatches", "4", "--batch-size", "12"],
            "--batch-size 12 does not split into --llm dp=2 batches of --microbatches 4; "
            "use a multiple of 8",
        ),
        (["--llm", "tp=2,pp=2,dp=2", "--fused-loss"], "--fused-loss is not supported"),
    ],
)
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mp-bridge demo: error: ")
    assert re.search(message, err), err


def _report(loss_rel: float) -> ParityReport:
    return ParityReport(
        encoder="tp=2,dp=4", llm="tp=2,cp=2,dp=2", dist_losses=[4.0, 3.9], ref_losses=[4.0, 3.9],
        loss_max_abs=4.0 * loss_rel, loss_max_rel=loss_rel, input_grad_max_abs=1e-9,
        input_grad_max_rel=1e-6, weight_max_abs=1e-6, weight_max_rel=2e-5,
        worst_weight="llm.head.weight", param_grad_max_abs=1e-9, param_grad_max_rel=1e-7,
        worst_param_grad="llm.norm.bias",
    )  # fmt: skip


def test_parity_table_marks_each_row():
    table = format_parity_table(_report(1e-7))
    lines = table.splitlines()
    assert lines[0].split() == ["quantity", "max", "abs", "max", "rel", "tolerance", "ok"]
    assert lines[2].startswith("loss (2 steps)") and lines[2].endswith("yes")
    assert "1.00e-07" in lines[2] and "rel 1e-05" in lines[2]
    assert _report(1e-7).passed()
    bad = format_parity_table(_report(1e-3))
    assert bad.splitlines()[2].endswith("NO")
    assert not _report(1e-3).passed()


def test_default_layouts_per_world_size():
    assert default_layouts(8) == ("tp=2,dp=4", "tp=2,cp=2,dp=2")  # the README's layouts
    assert default_layouts(2) == ("tp=2,dp=1", "cp=2,dp=1")
    assert default_layouts(6) == ("tp=2,dp=3", "cp=2,dp=3")
    assert default_layouts(3) == ("tp=1,dp=3", "dp=3")


def _args(**overrides) -> argparse.Namespace:
    values = dict(
        world=8, encoder=None, llm=None, steps=1, batch_size=None, lr=1e-2,
        sequence_parallel=False, fused_loss=False, plot=None,
    )  # fmt: skip
    return argparse.Namespace(**(values | overrides))


@pytest.mark.parametrize("world", range(1, 17))
def test_defaults_pass_every_check_for_any_world(world):
    args = _args(world=world, sequence_parallel=True)
    enc, llm = _validate(args)  # raises on a layout the demo cannot run
    assert (
        args.batch_size >= 8
        and args.batch_size % enc.axis_size("dp") == args.batch_size % llm.axis_size("dp") == 0
    )


def test_written_axis_order_is_the_grid_order():
    # `mp-bridge plan` and the demo read a spec the same way: first axis written = fastest.
    args = _args(world=8, encoder="dp=4,tp=2", llm="dp=4,tp=2")
    enc, llm = _validate(args)
    assert enc.axis_names[:2] == ("dp", "tp") and enc.coords(1) == {"dp": 1, "tp": 0}
    args = _args(world=8, encoder="dp=4,tp=2", llm="tp=2,cp=2,dp=2")
    with pytest.raises(ValueError, match="layouts do not nest: rank 2"):
        _validate(args)


def test_weights_pass_within_a_fraction_of_an_adam_step():
    drifted = dataclasses.replace(_report(1e-7), weight_max_abs=4e-5, weight_max_rel=1.5e-4)
    assert not drifted.passed()  # relative bound alone: fails
    assert drifted.passed(weight_atol=1e-4)  # 0.01 * lr at lr 1e-2
    table = format_parity_table(drifted, weight_atol=1e-4).splitlines()
    assert table[-1].startswith("weights") and "or abs 1e-04" in table[-1]
    assert table[-1].endswith("yes")
    assert format_parity_table(drifted).splitlines()[-1].endswith("NO")
    far = dataclasses.replace(drifted, weight_max_abs=5e-3, weight_max_rel=2e-2)
    assert not far.passed(weight_atol=1e-4)


def test_demo_config_default_unchanged_and_widened_for_tp3_5_6():
    assert demo_config(encoder_tp=2, llm_tp=8, seq_factor=8) == MimoConfig()
    for tp in (3, 5, 6):
        cfg = demo_config(encoder_tp=tp, llm_tp=tp, seq_factor=2 * 3)
        cfg.check_tp(encoder_tp=tp, llm_tp=tp)  # would raise on a misfit
        assert cfg.seq_len % 6 == 0 and cfg.llm_hidden <= 20 and cfg.enc_hidden <= 20


_TP3 = dict(enc_heads=6, enc_hidden=18, enc_ffn=33, proj_hidden=33)
_TP3.update(llm_heads=6, llm_hidden=18, llm_ffn=33, seq_len=16)
_TP6 = dict(enc_heads=6, enc_hidden=18, enc_ffn=36, proj_hidden=36)
_TP6.update(llm_heads=6, llm_hidden=18, llm_ffn=36, seq_len=16)
_CP3 = dict(enc_heads=8, enc_hidden=16, enc_ffn=32, proj_hidden=32)
_CP3.update(llm_heads=8, llm_hidden=16, llm_ffn=32, seq_len=18)


@pytest.mark.parametrize(
    "encoder, llm, want",
    [
        ("tp=3,dp=2", "tp=3,dp=2", _TP3),
        ("tp=6,dp=1", "tp=6,dp=1", _TP6),
        ("tp=1,dp=6", "cp=3,dp=2", _CP3),
    ],
)
def test_demo_widens_world6_layouts_with_tp3_tp6_cp3_to_the_written_sizes(encoder, llm, want):
    args = argparse.Namespace(
        world=6, encoder=encoder, llm=llm, steps=1, batch_size=None, lr=1e-2,
        sequence_parallel=False, fused_loss=False, plot=None,
    )  # fmt: skip
    _validate(args)  # heads 8 at encoder tp=3 must be widened, not refused
    # Widened by hand from MimoConfig() (heads 8, hidden 16, ffn / proj 32, seq 16): TP t
    # not dividing 8 takes lcm(t, 2) heads, hidden up to a multiple of the heads, ffn / proj
    # up to a multiple of t; CP 3 takes the sequence up to a multiple of 2·3.
    got = {name: getattr(args.config, name) for name in want}
    assert got == want


@pytest.mark.parametrize(
    ("llm", "microbatches", "batch_size", "llm_layers"),
    [
        ("tp=2,pp=2,dp=2", 4, 8, 2),  # 2 LLM replicas of 4 samples: 4 microbatches of 1
        ("tp=2,pp=2,dp=2", 8, 16, 2),  # the next multiple of dp 2 x 8 microbatches
        ("tp=2,pp=4", 3, 12, 4),  # lcm(encoder dp 4, 1 x 3); 4 stages need 4 layers
    ],
)
def test_a_pipelined_llm_gets_a_batch_that_splits_into_microbatches(
    llm, microbatches, batch_size, llm_layers
):
    args = argparse.Namespace(
        world=None, steps=1, lr=1e-2, encoder=None, llm=llm, batch_size=None, plot=None,
        sequence_parallel=False, microbatches=microbatches, fused_loss=False,
    )  # fmt: skip
    _validate(args)
    assert args.batch_size == batch_size
    assert args.config.llm_layers == llm_layers
