"""#19, work lost at the end: every output path of every command is checked (kind,
creatable, writable) before any work, and a write that fails at the end anyway goes to a
rescue folder the command names.

Permission bits say nothing to root (these tests may run as root), so "cannot be
written" is made real three ways that hold for everyone: a path under a regular file, a
regular file where a folder is expected (and the reverse), and ``/sys``, which the kernel
keeps read-only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.cli import main
from models.runtime import BadInput, check_output_dir, check_output_file, write_or_rescue
from optimized.data.preparation import prepare_data
from optimized.data.tokenizers import ByteTokenizer

TRAIN = ["train", "--seq-len", "16", "--micro-batch-size", "1", "--micro-batches", "2",
         "--steps", "2"]  # fmt: skip
COMPARE = ["compare", "--pp", "1", "--dp", "1", "--ep", "1", "--micro-batches", "2",
           "--micro-batch-size", "1", "--seq-len", "16", "--steps", "1", "--no-memory",
           "--baseline", "oracle", "--candidate", "reference"]  # fmt: skip
READ_ONLY = Path("/sys/twinpipe-cannot-write-here")


@pytest.fixture()
def where(tmp_path):
    """``file``: a regular file; ``data``: a prepared token folder; ``text``: a text file."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "text.txt").write_text("some text to tokenize. " * 100)
    prepare_data([tmp_path / "text.txt"], ByteTokenizer(), tmp_path / "data", progress=False)
    (tmp_path / "folder").mkdir()
    return tmp_path


def refused(argv, capsys, *needles):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert "step 0000" not in out and "launching" not in err and "wrote" not in out
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def bad_dirs(where):
    return [
        (where / "file" / "sub", "is a file, not a folder"),
        (where / "file", "exists and is not a folder"),
        (READ_ONLY, "cannot be created in '/sys'"),
    ]


def test_the_checks_themselves(where):
    for path, needle in bad_dirs(where):
        with pytest.raises(BadInput, match=needle):
            check_output_dir(path, "--out")
    with pytest.raises(BadInput, match="is a folder; expected a file path"):
        check_output_file(where / "folder", "--json")
    with pytest.raises(BadInput, match="cannot be created in '/sys'"):
        check_output_file(READ_ONLY / "r.json", "--json")
    # Creatable and writable paths pass, and nothing is created by checking.
    assert check_output_dir(where / "new" / "deeper", "--out") == where / "new" / "deeper"
    assert check_output_file(where / "new2" / "r.json", "--json")
    assert sorted(p.name for p in where.iterdir()) == ["data", "file", "folder", "text.txt"]


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--tensorboard-dir", "--profile"])
def test_train_checks_its_folders_before_training(where, capsys, flag):
    for path, needle in bad_dirs(where):
        refused([*TRAIN, "--data", str(where / "data"), flag, str(path)], capsys, needle)


def test_train_checks_its_metrics_file_before_training(where, capsys):
    for path, needle in [
        (where / "folder", "is a folder; expected a file path"),
        (where / "file" / "m.jsonl", "its folder"),
        (READ_ONLY / "m.jsonl", "cannot be created in '/sys'"),
    ]:
        refused([*TRAIN, "--data", str(where / "data"), "--metrics-file", str(path)], capsys,
                "logging.metrics_file", needle)  # fmt: skip


def test_compare_checks_json_and_out_before_comparing(where, capsys):
    refused([*COMPARE, "--json", str(where / "folder")], capsys, "--json", "is a folder")
    refused([*COMPARE, "--json", str(READ_ONLY / "r.json")], capsys, "--json", "/sys")
    for path, needle in bad_dirs(where):
        refused([*COMPARE, "--out", str(path)], capsys, "--out", needle)


def test_compare_json_into_a_missing_folder_is_written(where, capsys):
    """The issue's probe: ``--json missing_dir/r.json`` ran the comparison, then died."""
    target = where / "missing_dir" / "r.json"
    assert main([*COMPARE, "--json", str(target)]) == 0, capsys.readouterr()
    assert json.loads(target.read_text())["passed"] is True


def test_prepare_data_dashboard_bench_export_check_their_outputs(where, capsys):
    """(export's ``--out`` is checked in test_reliability_runs, beside a real checkpoint.)"""
    text = str(where / "text.txt")
    for path, needle in bad_dirs(where):
        refused(["prepare-data", "--input", text, "--out", str(path)], capsys, "--out", needle)
        refused(["dashboard", str(where / "folder"), "--out", str(path)], capsys, "--out", needle)
        refused(["bench", "--history", str(path), "--benchmarks", text], capsys, "--history",
                needle)  # fmt: skip
    (where / "ckpt" / "step-00000001").mkdir(parents=True)  # half-written: no manifest
    refused(["export", "--checkpoint", str(where / "ckpt"), "--out", str(where / "x")], capsys,
            "incomplete or corrupt")  # fmt: skip


def test_a_write_that_fails_at_the_end_goes_to_a_rescue_folder(where, capsys):
    def write(path):
        path.write_text("the report")
        return path

    written, rescued = write_or_rescue(READ_ONLY / "r.json", write, "the report", "compare")
    assert rescued and written.read_text() == "the report" and written.name == "r.json"
    assert f"it is at {str(written)!r} instead" in capsys.readouterr().err
    os.unlink(written)
    os.rmdir(written.parent)
    written, rescued = write_or_rescue(where / "r.json", write, "the report", "compare")
    assert not rescued and written == where / "r.json"
