"""One builder for the colocated model: the seven build options are written once
(``MimoOptions``); ``build_colocated_mimo`` and ``ColocatedMimoModel.from_groups`` /
``from_full`` take them through it (one process, no group)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from mp_bridge.models import ColocatedMimoModel, MimoConfig, ReferenceMimo, build_colocated_mimo
from mp_bridge.models.colocated import MimoGroups, MimoOptions
from mp_bridge.models.colocated.build import MimoBuildSpec

OPTIONS = (
    "sequence_parallel", "fused_loss", "device", "flow", "microbatches", "schedule", "balance",
    "cp_comm",
)  # fmt: skip


def test_the_options_are_written_once():
    assert tuple(f.name for f in dataclasses.fields(MimoOptions)) == OPTIONS
    for door in (build_colocated_mimo, ColocatedMimoModel.from_groups):
        params = inspect.signature(door).parameters
        assert not set(OPTIONS) & set(params), door  # no second copy of the keywords
        assert any(p.kind is p.VAR_KEYWORD for p in params.values()), door


def test_from_groups_takes_the_options_and_names_an_unknown_one():
    model = ColocatedMimoModel.from_groups(
        ReferenceMimo(MimoConfig()), MimoGroups.local(), flow="routed", schedule="auto"
    )
    assert type(model.flow).__name__ == "RoutedFlow" and model.microbatches == 1
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'flows'"):
        ColocatedMimoModel.from_groups(
            ReferenceMimo(MimoConfig()), MimoGroups.local(), flows="routed"
        )


def test_the_agreed_options_are_validated_and_named():
    opts = MimoOptions(flow="routed", microbatches=2)
    spec = MimoBuildSpec(grids=None, options=opts.agreed())
    assert list(spec.fields()) == ["grids", *(n for n in OPTIONS if n != "device")]
    assert spec.fields()["flow"] == "routed"
    with pytest.raises(ValueError, match=r"microbatches"):
        MimoOptions(microbatches=0).agreed()
    with pytest.raises(TypeError, match=r"sequence_parallel"):
        MimoOptions(sequence_parallel="yes").agreed()
