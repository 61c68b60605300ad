"""#19, runs as a user runs them (`python -m harness.cli train` or `compare` in a
subprocess): a checkpoint folder belongs to one run, a rerun with nothing to do says so,
metrics never hold a step twice, SIGTERM or SIGINT to the launcher stops every rank (train
saves first) and exits 128 + the signal, a rank killed by a signal is named with it, a
checkpoint or report that cannot be written where asked goes to a rescue folder, and
exported files follow the umask.

Train's ranks run the reference stack's runner (``TWINPIPE_RUNNER``), as in test_train:
the trainer around it is the same code, and the Triton interpreter would only be slower.
Compare runs the oracle against the reference stack, the cheapest pair.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from harness.cli import SUBCOMMANDS, main
from models.runtime import describe_failure
from optimized.train import TrainConfig, apply_overrides, validate_config
from optimized.train.checkpointing import RUN_FILE, checkpoint_run, read_run, verify
from optimized.train.config import lr_at, warmup_of
from tests._cli import (
    HANG_GUARD_S,
    REFERENCE_RUNNER,
    alive,
    rank_pids,
    read_until,
    small_data,
    started,
    twinpipe,
    twinpipe_here,
)

TINY = ["--seq-len", "16", "--micro-batch-size", "1", "--micro-batches", "2",
        "--warmup-steps", "1"]  # fmt: skip
COMPARE = ["compare", "--pp", "1", "--ep", "1", "--micro-batches", "2", "--micro-batch-size",
           "1", "--seq-len", "16", "--no-memory", "--baseline", "oracle", "--candidate",
           "reference"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return small_data(tmp_path_factory.mktemp("data"))


def train(*args: str, **env: str):
    return twinpipe("train", *TINY, *args, TWINPIPE_RUNNER=REFERENCE_RUNNER, **env)


def refused_here(*args: str, **env: str):
    """`train` for a run that ends before any rank starts, in this process (`twinpipe_here`)."""
    return twinpipe_here("train", *TINY, *args, TWINPIPE_RUNNER=REFERENCE_RUNNER, **env)


def steps_recorded(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_folder_belongs_to_one_run(tmp_path, data, capsys):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = ("--data", data, "--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics),
           "--steps", "4", "--save-every", "2", "--keep-last", "0")  # fmt: skip

    # A crash at the start of step 4: steps 1-3 were recorded, step 2 was saved.
    crashed = train(*run, TWINPIPE_FAULT="crash@3:0")
    assert crashed.returncode == 3, crashed.stderr
    assert "rank 0 failed first" in crashed.stderr and "crashed at step 4" in crashed.stderr
    assert steps_recorded(metrics) == [1, 2, 3]
    # Resumed: steps 3 and 4 again, each recorded once.
    resumed = train(*run)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step-00000002" in resumed.stdout
    assert "dropped 1 records after step 2" in resumed.stderr
    assert steps_recorded(metrics) == [1, 2, 3, 4]
    owner = read_run(ckpt)["run_id"]
    assert {checkpoint_run(ckpt / f"step-0000000{s}") for s in (2, 4)} == {owner}

    # Nothing to do: a finished run, and fewer --steps than the checkpoint.
    for steps in ("4", "3"):
        again = refused_here(*run[:-4], "--steps", steps)
        assert again.returncode == 0, again.stderr
        assert "nothing to do" in again.stdout and "step 4 of run " + owner in again.stdout
        assert "step 0000" not in again.stdout

    # Another run into this folder is refused, and nothing in it changes.
    before = fingerprint(ckpt)
    other = refused_here(*run, "--no-resume", "--seed", "1")
    assert other.returncode == 2, other.stderr
    assert f"holds run {owner}'s checkpoints" in other.stderr and "--overwrite" in other.stderr
    # Another model, resumed from this folder or started from it, is refused by name.
    qwen = ["train", *TINY, "--data", data, "--model", "tiny-qwen3-moe"]
    assert main([*qwen, "--checkpoint-dir", str(ckpt)]) == 2
    assert "checkpoint.dir: checkpoint" in capsys.readouterr().err
    assert main([*qwen, "--init-from", str(ckpt), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "model.init_from: checkpoint" in err and "holds another model" in err
    assert fingerprint(ckpt) == before

    # Export: --out checked first (never into the checkpoints); the files follow the umask.
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(metrics / "x")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(ckpt / "step-00000004")]) == 2
    assert "would write into the checkpoints" in capsys.readouterr().err
    for mask in (0o022, 0o002):
        old = os.umask(mask)
        try:
            assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
        finally:
            os.umask(old)
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
        # the export is sharded: model-00001-of-00001.safetensors and its index
        assert modes["model-00001-of-00001.safetensors"] == 0o666 & ~mask, modes
        assert modes["model.safetensors.index.json"] == 0o666 & ~mask, modes
        assert modes["config.json"] == 0o666 & ~mask, modes

    # --overwrite replaces the old run: a new owner, and none of its checkpoints left.
    fresh = train(*run[:-4], "--steps", "1", "--no-resume", "--overwrite", "--seed", "1")
    assert fresh.returncode == 0, fresh.stderr
    assert read_run(ckpt)["run_id"] != owner
    assert sorted(p.name for p in ckpt.iterdir()) == [RUN_FILE, "step-00000001"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_run_never_prunes_or_restarts_over_checkpoints_it_did_not_write(tmp_path, data):
    """Checkpoints from before run ids (no run.json, no run id in the manifest) are
    resumed but never pruned; when every checkpoint is corrupt, nothing restarts over
    them."""
    ckpt = tmp_path / "ckpt"
    run = ("--data", data, "--checkpoint-dir", str(ckpt))
    assert train(*run, "--steps", "2", "--save-every", "1", "--keep-last", "0").returncode == 0
    (ckpt / RUN_FILE).unlink()
    for folder in ckpt.glob("step-*"):
        manifest = json.loads((folder / "manifest.json").read_text())
        del manifest["run_id"]
        (folder / "manifest.json").write_text(json.dumps(manifest))
    done = train(*run, "--steps", "4", "--save-every", "1", "--keep-last", "1")
    assert done.returncode == 0, done.stderr
    # Kept: the two unowned checkpoints, and only the newest of this run's two.
    assert sorted(p.name for p in ckpt.glob("step-*")) == [
        "step-00000001", "step-00000002", "step-00000004"]  # fmt: skip
    for folder in ckpt.glob("step-*"):
        (folder / "trainer_state.pt").write_bytes(b"corrupt")
    before = fingerprint(ckpt)
    corrupt = refused_here(*run, "--steps", "6")
    assert corrupt.returncode == 2, corrupt.stderr
    assert "every checkpoint is incomplete or corrupt" in corrupt.stderr
    assert corrupt.stderr.count("skipping checkpoint") == 3  # each named, with its fault
    assert fingerprint(ckpt) == before


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_rank_saves_and_exits_128_plus_it(
    tmp_path, data, signum
):
    """SIGTERM: ``kill PID``, docker stop, systemd; SIGINT: ``kill -INT PID`` (a real
    signal, not a KeyboardInterrupt raised in-process). Both reach the launcher only."""
    ckpt = tmp_path / "ckpt"
    command = ["train", *TINY, "--data", data, "--dp", "2", "--steps", "400",
               "--checkpoint-dir", str(ckpt)]  # fmt: skip
    with started(*command, TWINPIPE_RUNNER=REFERENCE_RUNNER) as launcher:
        seen = read_until(launcher.stdout, "step 00000002/")
        ranks = rank_pids(launcher)
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=HANG_GUARD_S)
    out = "".join(seen) + out
    assert launcher.returncode == 128 + signum, (out, err)
    assert len(ranks) == 2 and not any(alive(pid) for pid in ranks)
    stopped = int(re.search(rf"stopped by {signum.name} after step (\d+) of 400", err)[1])
    assert 2 <= stopped < 400
    assert [p.name for p in ckpt.glob("step-*")] == [f"step-{stopped:08d}"]
    assert verify(ckpt / f"step-{stopped:08d}") is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_killed_by_a_signal_is_named_first(data):
    done = train("--data", data, "--dp", "2", "--steps", "3", TWINPIPE_FAULT="sigkill@1:1")
    assert done.returncode == 3, done.stderr
    assert "rank 1 was killed by SIGKILL (signal 9)" in done.stderr
    assert "rank 0 failed first" not in done.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_that_cannot_be_saved_where_asked_is_rescued(tmp_path, data):
    ckpt, temporary = tmp_path / "ckpt", tmp_path / "tmp"
    temporary.mkdir()  # the rescue folder's parent (TMPDIR), so nothing is left in /tmp
    done = train("--data", data, "--steps", "2", "--checkpoint-dir", str(ckpt),
                 TWINPIPE_FAULT="ckpt-dir-gone@1:0", TMPDIR=str(temporary))  # fmt: skip
    assert done.returncode == 3, done.stderr
    rescued = Path(re.search(r"the checkpoints are in (\S+)", done.stderr)[1])
    assert rescued.is_relative_to(temporary)
    assert verify(rescued / "step-00000002") is None
    assert ckpt.is_file()  # what the fault left where the folder was


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compare_names_a_rank_killed_by_a_signal():
    with started(*COMPARE, "--dp", "2", "--steps", "400") as launcher:
        read_until(launcher.stderr, "step 1/400")
        ranks = rank_pids(launcher)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        out, err = launcher.communicate(timeout=HANG_GUARD_S)
    assert launcher.returncode == 3, (out, err)
    assert "rank 1 was killed by SIGKILL (signal 9)" in err
    assert "rank 0 failed first" not in err and "stopped by" not in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_the_compare_launcher_stops_every_rank_and_exits_143():
    with started(*COMPARE, "--dp", "2", "--steps", "400") as launcher:
        read_until(launcher.stderr, "step 1/400")
        ranks = rank_pids(launcher)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=HANG_GUARD_S)
    assert launcher.returncode == 143, (out, err)
    assert "stopped by SIGTERM" in err and "PASSED" not in out
    assert len(ranks) == 2 and not any(alive(pid) for pid in ranks)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_compare_report_that_cannot_be_written_where_asked_is_rescued(tmp_path):
    """Both outputs' folder is checked before the ranks start, then replaced by a file while
    they run (a disk that went away): the report goes to a rescue folder, named."""
    folder, temporary = tmp_path / "reports", tmp_path / "tmp"
    temporary.mkdir()  # the rescue folder's parent (TMPDIR), so nothing is left in /tmp
    outputs = ["--json", str(folder / "r.json"), "--out", str(folder / "out")]
    with started(*COMPARE, "--dp", "1", "--steps", "1", *outputs,
                 TMPDIR=str(temporary)) as launcher:  # fmt: skip
        read_until(launcher.stderr, "launching")
        shutil.rmtree(folder, ignore_errors=True)
        folder.write_text("where the folder was")
        out, err = launcher.communicate(timeout=HANG_GUARD_S)
    assert launcher.returncode == 3, (out, err)
    said = r"could not write (the report(?: JSON)?) to .*; it is at '(.+)' instead"
    found = dict(re.findall(said, err))
    assert set(found) == {"the report", "the report JSON"}, err
    rescued_json, rescued_out = Path(found["the report JSON"]), Path(found["the report"])
    assert rescued_json.name == "r.json" and json.loads(rescued_json.read_text())["passed"]
    assert {"report.json", "report.md"} <= {p.name for p in rescued_out.iterdir()}
    assert rescued_json.is_relative_to(temporary) and rescued_out.is_relative_to(temporary)


def test_describe_failure_names_the_root_cause():
    reset = (5.0, "Traceback ...\nRuntimeError: Connection reset by peer\n")
    killed = describe_failure({0: 1, 1: -9}, {0: reset}, killed_here=set())
    assert killed.startswith("rank 1 was killed by SIGKILL (signal 9)")
    assert "rank 0 failed after it: RuntimeError: Connection reset by peer" in killed
    # Ranks the launcher killed itself, after the first failure, are never the cause.
    raised = describe_failure({0: -9, 1: 1}, {1: (3.0, "ValueError: bad\n")}, killed_here={0})
    assert raised.startswith("rank 1 failed first") and "ValueError: bad" in raised
    silent = describe_failure({0: 0, 1: 7}, {}, killed_here=set())
    assert silent == "rank 1 exited with code 7 and left no traceback"


def test_warmup_clamps_to_a_short_run(capsys):
    short = validate_config(apply_overrides(TrainConfig(), ["steps=5"]))
    assert warmup_of(short) == 5 and lr_at(4, short) == short.optim.lr
    assert warmup_of(validate_config(TrainConfig())) == 10
    assert main(["train", "--steps", "5", "--print-config"]) == 0
    assert "# warmup_steps = (unset)" in capsys.readouterr().out


def _options(command: str) -> list:
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out.split("COMMAND\n", 1)[1], re.M)
    assert listed == list(SUBCOMMANDS)


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_help_documents_every_option_and_shows_every_default(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    entries = {}  # the first flag of each option -> its help entry, whitespace collapsed
    for entry in re.split(r"\n  (?=-)", out.split("options:", 1)[1]):
        if entry.split():
            entries[entry.split()[0].rstrip(",")] = " ".join(entry.split())
    for action in _options(command):
        flag = action.option_strings[0]
        entry = entries[flag]
        assert action.help and len(entry.split()) > 2, f"{command} {flag} has no help"
        if action.dest.startswith("config__"):
            assert "default" in entry, f"{command} {flag}: {entry}"
        elif action.default not in (None, False, [], argparse.SUPPRESS):
            # the default's value, after the word: "(default: 0.01)", "(default 0.1)"
            said = entry.partition("default")[2]
            assert str(action.default) in said, f"{command} {flag}: {entry}"
    if command == "train":
        assert "default: 0.0003" in entries["--lr"] and "default: 100" in entries["--steps"]
        assert "default: unset" in entries["--warmup-steps"]
