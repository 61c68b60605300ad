"""The docs stay true: README.md and docs/*.md run only commands and flags the parsers have,
link only to files (and anchors) that exist, name only files and modules that exist,
install as `.ci/run` installs, keep their size, and the results page lists exactly the
results file. The checkers (`tests/_docs.py`) are also fed doctored text, to show that they
report a renamed flag, a broken link and a moved module."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.history import results as measured
from tests._docs import (
    ROOT,
    Parsers,
    ci_install_commands,
    command_problems,
    install_commands,
    link_problems,
    name_problems,
    section,
)

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES, DOC_MAX_LINES = 250, 400


@pytest.fixture(scope="module")
def parsers() -> Parsers:
    return Parsers()


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_documented_command_parses(page, parsers):
    problems = command_problems(page.read_text(), parsers)
    assert not problems, f"{_name(page)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page):
    problems = link_problems(page.read_text(), page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_named_file_and_module_exists(page):
    problems = name_problems(page.read_text())
    assert not problems, f"{_name(page)}:\n" + "\n".join(problems)


TEST_COMMAND = "python -m pytest -q -n 2 --dist worksteal --durations=25"


def test_readme_installs_as_ci_does_and_names_its_test_command():
    readme, ci = README.read_text(), (ROOT / ".ci" / "run").read_text()
    assert install_commands(readme) == [
        "python -m pip install torch==2.13.0",
        "python -m pip install -e .[test]",
    ]
    assert install_commands(readme) == ci_install_commands(ci)
    assert f"```bash\n{TEST_COMMAND}\n```" in section(readme, "Tests")
    assert re.search(rf"^{TEST_COMMAND}( |$)", ci, re.M), "CI runs another test command"
    # Every CI log shows the 25 slowest tests (--durations=25) and the suite's wall time.
    assert "date +%s" in ci and re.search(r"^echo .*wall time", ci, re.M)


def test_pages_keep_their_size_and_the_readme_links_every_page():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    long = {_name(p): n for p in DOCS if (n := len(p.read_text().splitlines())) > DOC_MAX_LINES}
    assert not long, f"split these pages (limit {DOC_MAX_LINES} lines): {long}"
    assert len(DOCS) >= 8, "the docs pages were not found"
    readme = README.read_text()
    unlinked = [_name(p) for p in DOCS if f"(docs/{p.name}" not in readme]
    assert not unlinked, f"README.md links no {unlinked}"


def test_the_results_page_is_generated_from_the_results_file():
    document = measured.load_results(ROOT / "docs" / "results.json")
    assert len(document["results"]) > 20
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == measured.render_markdown(document), (
        "docs/results.md is stale: run python -m harness.history.results"
    )


# ---------------------------------------------------------------------- the checkers fail


def test_a_renamed_flag_or_subcommand_or_value_is_reported(parsers):
    good = "```bash\ntwinpipe compare --pp 2 --routing pinned --json out.json\n```\n"
    assert command_problems(good, parsers) == []
    renamed = good.replace("--pp", "--pipeline-ranks")
    assert any("no option --pipeline-ranks" in p for p in command_problems(renamed, parsers))
    wrong_value = good.replace("pinned", "pinnned")
    assert any("'pinnned' is not one of" in p for p in command_problems(wrong_value, parsers))
    unknown = "```\ngit stash && twinpipe comapre --json old.json\n```\n"
    assert any("no subcommand 'comapre'" in p for p in command_problems(unknown, parsers))
    # A continued line, an inline span, a script and a torchrun launch are all checked.
    continued = "```bash\ntwinpipe train --model tiny-qwen3-moe \\\n  --stepz 3\n```\n"
    assert any("no option --stepz" in p for p in command_problems(continued, parsers))
    inline = "Run `twinpipe estimate --tpp 2` to see."
    assert any("twinpipe estimate: no option --tpp" in p for p in command_problems(inline, parsers))
    script = "```bash\npython -m benchmarks.gpu_check --only tests nonsense\n```\n"
    assert any("'nonsense' is not one of" in p for p in command_problems(script, parsers))
    nested = "```bash\npython -m benchmarks.checkpoints dry-run --modle x\n```\n"
    assert any("dry-run: no option --modle" in p for p in command_problems(nested, parsers))
    torchrun = "```bash\ntorchrun --nproc-per-node 4 -m harness.cli train --confg x.toml\n```\n"
    assert any("no option --confg" in p for p in command_problems(torchrun, parsers))
    # Output blocks and other programs are not commands of this project.
    assert command_problems("```text\ntwinpipe compare: PASSED --x\n```\n", parsers) == []
    assert command_problems("```bash\npip install --nonsense x\n```\n", parsers) == []


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The noise floor\n")
    good = "See [other](other.md#the-noise-floor), [top](#title) and [web](https://x.org).\n"
    text = "# Title\n\n" + good
    page.write_text(text)
    assert link_problems(text, page, tmp_path) == []
    for broken, why in (
        ("[gone](missing.md)", "missing.md: no such file"),
        ("[anchor](other.md#no-such-part)", "no such anchor"),
        ("[outside](../../elsewhere.md)", "leaves the repository"),
        ("[self](#nowhere)", "#nowhere: no such anchor"),
    ):
        problems = link_problems(text + broken + "\n", page, tmp_path)
        assert len(problems) == 1 and why in problems[0], (broken, problems)
    # A link inside code is not a link.
    assert link_problems(text + "`[x](missing.md)`\n", page, tmp_path) == []


def test_a_moved_file_or_module_is_reported():
    good = "See `models/hf/checkpoint.py`, `tests/test_docs.py::test_x` and `models.hf`."
    assert name_problems(good) == []
    moved = "See `models/checkpoint.py` and `models.checkpoint.validate_checkpoint`."
    assert name_problems(moved) == [
        "`models/checkpoint.py`: no such file or folder",
        "`models.checkpoint.validate_checkpoint`: no such module or name",
    ]
    assert name_problems("`models.hf.no_such_function`") == [
        "`models.hf.no_such_function`: no such module or name"
    ]


def test_an_install_block_that_differs_from_ci_is_seen():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    doctored = readme.replace("torch==2.13.0", "torch==2.12.0", 1)
    assert install_commands(doctored) != ci_install_commands(ci)


def test_a_malformed_results_file_is_refused(tmp_path):
    document = json.loads((ROOT / "docs" / "results.json").read_text())
    first = document["results"][0]
    broken = dict(first, date="27 Nov 2026", figure="fast")
    del broken["command"]
    problems = measured.result_problems({"results": [first, broken]})
    text = "\n".join(problems)
    assert "missing command" in text and "expected YYYY-MM-DD" in text
    assert "a number or a list of numbers" in text and "appears twice" in text
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": [broken]}))
    with pytest.raises(measured.ResultsError, match="malformed results file"):
        measured.load_results(path)
