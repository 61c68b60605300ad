"""#19, silently wrong and exit codes that scripts can trust: a figure missing from a
report never passes `diff`, a malformed report is refused by `bench --add-report` and
`diff` and skipped by `dashboard`, `prepare-data` says what it replaced or skipped and
never reads its own output, and a crash is exit 3 in every subcommand, never 1."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

import harness.cli
from harness.cli import SUBCOMMANDS, main
from optimized.data.preparation import read_sidecar

ROOT = Path(__file__).resolve().parents[1]
REPORT = json.loads((ROOT / "tests" / "data" / "compare_report.json").read_text())


def _write(path: Path, document) -> str:
    path.write_text(json.dumps(document))
    return str(path)


@pytest.mark.parametrize(
    "drop, words",
    [
        (("memory",), "rank 0: memory figures are missing from the new report"),
        (("time",), "baseline time per step (median) is missing"),
        (("loss", "rel_error"), "loss relative error (max over steps) is missing"),
        (("grads", "max_one_minus_cos"), "gradient max 1-cos (max over steps) is missing"),
        (("params",), "parameter max relative error (max over steps) is missing"),
    ],
    ids=["memory", "time", "loss-error", "gradient-error", "parameter-error"],
)
def test_a_figure_the_new_report_lacks_is_a_regression(tmp_path, capsys, drop, words):
    new = copy.deepcopy(REPORT)
    holder = new
    for key in drop[:-1]:
        holder = holder[key]
    del holder[drop[-1]]
    old_path, new_path = _write(tmp_path / "old.json", REPORT), _write(tmp_path / "new.json", new)
    assert main(["diff", old_path, new_path]) == 1
    assert words in capsys.readouterr().out
    assert main(["diff", old_path, old_path]) == 0  # the same report still passes
    assert main(["diff", new_path, old_path]) == 0  # a figure added is information


def test_a_benchmark_missing_from_the_new_run_is_a_regression(tmp_path, capsys):
    bench = {"name": "test_x", "stats": {"median": 1.0}, "extra_info": {"peak_bytes": 10}}
    old = _write(tmp_path / "old.json", {"benchmarks": [bench, {**bench, "name": "test_y"}]})
    new = _write(tmp_path / "new.json", {"benchmarks": [bench]})
    assert main(["diff", old, new]) == 1
    assert "benchmark test_y is missing from the new run" in capsys.readouterr().out
    gone = _write(
        tmp_path / "gone.json",
        {"benchmarks": [{**bench, "stats": {}}, {**bench, "name": "test_y"}]},
    )
    assert main(["diff", old, gone]) == 1
    assert "test_x median time is missing from the new document" in capsys.readouterr().out


MALFORMED = [
    ("memory", "lots", "memory = 'lots': expected an object"),
    ("memory", {"ranks": [{"rank": 0, "baseline": "x"}]}, "memory.ranks[0].baseline = 'x'"),
    ("memory", {"ranks": [{"candidate": {"total": "9 GB"}}]}, "candidate.total = '9 GB'"),
    ("loss", {"rel_error": "x"}, "loss.rel_error = 'x': expected a list of numbers"),
    ("time", 5, "time = 5: expected an object"),
    ("grads", {"max_one_minus_cos": [1e-9, "nan"]}, "grads.max_one_minus_cos"),
]


@pytest.mark.parametrize("key, value, words", MALFORMED, ids=[m[2][:24] for m in MALFORMED])
def test_malformed_reports_are_refused_by_bench_and_diff(tmp_path, capsys, key, value, words):
    bad = _write(tmp_path / "bad.json", {**REPORT, key: value})
    good = _write(tmp_path / "good.json", REPORT)
    history = tmp_path / "history"
    both = ["--add-report", good, "--add-report", bad]
    assert main(["bench", *both, "--history", str(history)]) == 2
    err = capsys.readouterr().err
    assert "bad.json: malformed compare report" in err and words in err
    assert not history.exists() or not list(history.iterdir())  # not even the good one
    assert main(["diff", good, bad]) == 2
    assert words in capsys.readouterr().err


def test_malformed_reports_are_skipped_by_the_dashboard(tmp_path, capsys):
    """Each malformed report dropped into a history by hand is skipped with its own word;
    the page still renders (one render for every case: a render draws the plots)."""
    good = _write(tmp_path / "good.json", REPORT)
    history = tmp_path / "history"
    assert main(["bench", "--add-report", good, "--history", str(history)]) == 0
    for index, (key, value, _) in enumerate(MALFORMED):
        entry = {"kind": "compare", "git_commit": "x", "report": {**REPORT, key: value}}
        _write(history / f"compare-zzz{index}.json", entry)
    assert main(["dashboard", str(history), "--out", str(tmp_path / "site")]) == 0
    lines = capsys.readouterr().err.splitlines()
    for index, (_, _, words) in enumerate(MALFORMED):
        said = [line for line in lines if f"compare-zzz{index}.json" in line]
        assert len(said) == 1 and "skipping" in said[0] and words in said[0], (words, lines)
    assert (tmp_path / "site" / "index.html").is_file()


def test_prepare_data_says_what_it_replaced_and_skipped(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"caf\xe9 ok \xff\xfe text")  # 3 invalid bytes
    (corpus / "b.bin").write_bytes(bytes(range(256)) * 4)
    (corpus / "c.txt").write_text("")
    (corpus / "d.txt").write_text("fine text")
    out = corpus / "out"  # inside --input: never read back as input
    assert main(["prepare-data", "--input", str(corpus), "--out", str(out), "--quiet"]) == 0
    said = capsys.readouterr()
    assert re.search(r"a\.txt: 3 bytes of invalid UTF-8 became U\+FFFD", said.err), said.err
    assert "skipped " + str(corpus / "b.bin") + ": binary" in said.err
    assert "1 empty documents" in said.out
    index = read_sidecar(out)
    documents = {Path(s["path"]).name: s["documents"] for s in index["sources"]}
    assert documents == {"a.txt": 1, "b.bin": 0, "c.txt": 0, "d.txt": 1}
    assert index["num_documents"] == 2
    assert index["skipped"] == {"empty": 1, "bad": 0, "binary": 1}
    assert main(["prepare-data", "--input", str(corpus), "--out", str(out), "--quiet"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err  # never overwritten
    (tmp_path / "x.bin").write_bytes(b"\0\0\0")
    only_binary = str(tmp_path / "x.bin")
    assert main(["prepare-data", "--input", only_binary, "--out", str(tmp_path / "o")]) == 2
    assert "no text to prepare" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    inside = str(out / "twinpipe-data.json")  # a file of --out named as input is refused
    assert main(["prepare-data", "--input", inside, "--out", str(out)]) == 2
    assert "lies in the output folder" in capsys.readouterr().err
    assert main(["prepare-data", "--input", str(out), "--out", str(out)]) == 2
    assert "lies in the output folder" in capsys.readouterr().err


def _required_arguments(module) -> list[str]:
    """A placeholder for every required argument of a subcommand, so its parser accepts."""
    import argparse

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    argv = []
    for action in parser._actions:
        if not action.option_strings and action.nargs != 0:
            argv.append("x")
        elif action.required:
            argv += [action.option_strings[0], "1"]
    return argv


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_an_unexpected_error_is_exit_3_in_every_subcommand(monkeypatch, capsys, command):
    """The wrapper every subcommand runs in: a traceback is 3 (a crash), never 1 (which
    compare and diff use for "outside tolerance"), and Ctrl-C is 130."""
    import importlib

    module = importlib.import_module(SUBCOMMANDS[command][0])

    def crash(args):
        raise RuntimeError("an internal error")

    required = _required_arguments(module)
    monkeypatch.setattr(module, "run", crash)
    assert main([command, *required]) == harness.cli.EXIT_CRASH == 3
    err = capsys.readouterr().err
    assert "RuntimeError: an internal error" in err and "internal error (exit 3)" in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    assert main([command, *required]) == 130


def test_the_docs_give_exit_codes_for_every_subcommand():
    section = (ROOT / "docs" / "exit-codes.md").read_text()
    for command in SUBCOMMANDS:
        assert f"`{command}`" in section, command
    for code in ("0", "1", "2", "3", "143", "130"):
        assert f"| {code} " in section or f"`{code}`" in section, code
