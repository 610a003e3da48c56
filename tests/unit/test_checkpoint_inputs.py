"""Checkpoints in one process: the inputs a save or load meets at its edges (damaged files
of the right size, paths that hold something else, bad ``extra``, back-to-back async saves).

Each expected message is written out here; a model round-trips through ``Toy`` of
``test_checkpoint.py`` (a padded vocab layer, a fused weight, a norm).
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from mp_bridge.checkpoint import load, save
from tests.unit.test_checkpoint import Toy, _trained


def test_a_damaged_data_file_of_the_right_size_names_the_checkpoint(tmp_path):
    model, opt = _trained()
    save(tmp_path / "ck", model, opt)
    data = glob.glob(str(tmp_path / "ck" / "*.distcp"))[0]
    raw = bytearray(open(data, "rb").read())
    raw[::7] = bytes(b ^ 0xFF for b in raw[::7])  # same size: only DCP's read can tell
    open(data, "wb").write(bytes(raw))
    other = Toy()
    before = [p.clone() for p in other.parameters()]
    # DCP's CheckpointException is a BaseException: it must not pass unnamed.
    with pytest.raises(RuntimeError, match=r"damaged checkpoint at '.*ck': reading it failed \("
                       r"rank 0: UnpicklingError"):  # fmt: skip
        load(tmp_path / "ck", other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"lr": float("nan")}, r"Out of range float"),
        ({"x": object()}, r"not JSON serializable"),
        ({"shape": (1, 2)}, r"JSON gives back another value"),
        ({1: "a", "b": 2}, r"not supported between"),  # wrote nothing, then hung the others
    ],
)
def test_extra_that_is_not_json_is_a_value_error_before_anything_is_written(tmp_path, extra, why):
    with pytest.raises(ValueError, match=rf"extra must hold JSON values .*: .*{why}"):
        save(tmp_path / "ck", Toy(), extra=extra)
    assert os.listdir(tmp_path) == []


def test_save_never_replaces_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes").write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "data.bin").write_text("keep")
    for path, what in (
        (tmp_path / "notes", r"it is a file \(no mp_bridge\.json\)"),
        (tmp_path / "run", r"it is a directory that is not a checkpoint"),
        (tmp_path / "notes" / "ck", r"'.*notes' is a file"),
    ):
        where = re.escape(str(path))
        with pytest.raises(ValueError, match=rf"cannot save a checkpoint at '{where}': {what}"):
            save(path, Toy())
    assert (tmp_path / "notes").read_text() == (tmp_path / "run" / "data.bin").read_text()
    assert sorted(os.listdir(tmp_path)) == ["notes", "run"]  # nothing written beside them
    (tmp_path / "empty").mkdir()
    save(tmp_path / "empty", Toy(), step=4)  # an empty directory is fine
    assert load(tmp_path / "empty", Toy()).step == 4
    with pytest.raises(ValueError, match=r"'.*notes' is not a checkpoint: it is a file"):
        load(tmp_path / "notes", Toy())


def test_async_saves_in_a_row_to_one_path_both_publish(tmp_path):
    model, opt = _trained()
    first = save(tmp_path / "ck", model, opt, step=1, async_save=True)
    second = save(tmp_path / "ck", model, opt, step=2, async_save=True)  # no wait() between
    first.wait()
    second.wait()
    assert load(tmp_path / "ck", Toy()).step == 2
    third = save(tmp_path / "ck", model, opt, step=3, async_save=True)
    assert load(tmp_path / "ck", Toy()).step == 3  # a load waits for the save before it
    third.wait()
    assert os.listdir(tmp_path) == ["ck"]
