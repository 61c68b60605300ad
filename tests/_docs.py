"""Checkers that keep the docs true (`tests/test_docs.py` runs them on README.md and docs/).

- `command_problems`: every command a reader would copy, in a shell block (a fenced block
  marked ``bash``, ``sh``, ``shell``, ``console`` or unmarked) or an inline code span, names a
  subcommand and flags its parser has, and a value among a flag's choices;
- `link_problems`: every relative link names a file of the repository (inside it: a clone
  has nothing beside it), and an anchor, when given, a heading or ``<a id>`` of that page;
- `name_problems`: every repository path (``tests/test_x.py``, ``models/hf/``) and dotted
  project name (``models.hf.from_pretrained``) in an inline code span exists;
- `install_commands` / `ci_install_commands`: the README's install block and what `.ci/run`
  runs, to be held equal.

The parsers are the real ones: each `twinpipe` subcommand's ``add_arguments`` (the CLI's
`SUBCOMMANDS` table), and the ``main`` of each script the docs run (`parser_of_main` stops it
at ``parse_args`` and keeps the parser it built).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
SEPARATORS = {"&&", "||", ";", "|"}
PASS_THROUGH = {"time", "nohup", "sudo", "exec", "env"}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of_main(main: Callable[..., Any], *argv: list[str]) -> argparse.ArgumentParser:
    """The parser a script's ``main`` builds, stopped before it parses anything (``parse_args``
    and ``parse_known_args`` both go through ``parse_known_args``)."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        main(*argv)
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    raise AssertionError(f"{main.__module__}.main built no parser")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommand parsers by name (empty when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def twinpipe_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each `twinpipe` subcommand's parser, built as `harness.cli.main` builds it."""
    from harness.cli import SUBCOMMANDS

    parsers = {}
    for name, (module, _) in SUBCOMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"twinpipe {name}")
        importlib.import_module(module).add_arguments(parser)
        parsers[name] = parser
    return parsers


def script_parsers() -> dict[str, argparse.ArgumentParser]:
    """The scripts the docs run, by how they are run (``python -m MODULE`` or ``python
    PATH``): each one's parser (`parser_of_main`)."""
    spec = importlib.util.spec_from_file_location("plant_round", ROOT / "tools" / "plant_round.py")
    plant_round = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plant_round)
    found = {"tools/plant_round.py": parser_of_main(plant_round.main)}
    for module in ("benchmarks.gpu_check", "benchmarks.checkpoints", "harness.history.results"):
        found[module] = parser_of_main(importlib.import_module(module).main, [])
    return found


class Parsers:
    """Every parser a documented command can reach."""

    def __init__(self) -> None:
        self.twinpipe = twinpipe_parsers()
        self.scripts = script_parsers()


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _is_placeholder(token: str) -> bool:
    """A value the reader fills in (``N``, ``DIR``, ``<path>``, ``{a,b}``, ``...``)."""
    return bool(re.fullmatch(r"[A-Z][A-Z0-9_]*|<.*>|\{.*\}|\.\.\.", token))


def flag_problems(parser: argparse.ArgumentParser, words: list[str], name: str) -> list[str]:
    """The flags of ``words`` that ``parser`` lacks, and values outside a flag's choices."""
    problems, options = [], _options(parser)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-") or word in ("-", "--"):
            continue
        flag, _, inline = word.partition("=")
        action = options.get(flag)
        if action is None:
            problems.append(f"{name}: no option {flag}")
            continue
        values = [inline] if inline else []
        if not inline and action.nargs != 0:
            many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
            while i < len(words) and not words[i].startswith("-"):
                values.append(words[i])
                i += 1
                if not many:
                    break
        if action.choices is None:
            continue
        for value in values:
            for choice in value.split("|"):  # `on|off`: both meant
                if not _is_placeholder(choice) and choice not in action.choices:
                    valid = ", ".join(map(str, action.choices))
                    problems.append(f"{name}: {flag} {choice!r} is not one of {valid}")
    return problems


def segment_problems(words: list[str], parsers: Parsers) -> list[str]:
    """What is wrong with one simple command (its words), or nothing when it is no command
    of this project."""
    while words and (re.fullmatch(r"\w+=.*", words[0]) or words[0] in PASS_THROUGH):
        words = words[1:]
    if not words:
        return []
    if words[0] == "torchrun" and "-m" in words:
        words = ["python", *words[words.index("-m") :]]
    if words[0] == "twinpipe":
        rest = words[1:]
    elif words[0].startswith("python") and words[1:2] == ["-m"] and len(words) > 2:
        module, rest = words[2], words[3:]
        if module != "harness.cli":
            parser = parsers.scripts.get(module)
            return [] if parser is None else _script_problems(parser, rest, module)
    elif words[0].startswith("python") and len(words) > 1 and words[1].endswith(".py"):
        path = words[1].removeprefix("./")
        parser = parsers.scripts.get(path)
        return [] if parser is None else _script_problems(parser, words[2:], path)
    else:
        return []
    if not rest or rest[0].startswith("-"):
        return []
    parser = parsers.twinpipe.get(rest[0])
    if parser is None:
        return [f"twinpipe: no subcommand {rest[0]!r}; valid: {', '.join(parsers.twinpipe)}"]
    return flag_problems(parser, rest[1:], f"twinpipe {rest[0]}")


def _script_problems(parser: argparse.ArgumentParser, words: list[str], name: str) -> list[str]:
    commands = subcommands(parser)
    if not commands:
        return flag_problems(parser, words, name)
    if not words or words[0].startswith("-"):
        return []
    if words[0] not in commands:
        return [f"{name}: no subcommand {words[0]!r}; valid: {', '.join(commands)}"]
    return flag_problems(commands[words[0]], words[1:], f"{name} {words[0]}")


def _unbracket(word: str) -> str:
    """``[--flag`` -> ``--flag``, ``value]`` -> ``value``; ``.[test]`` stays."""
    if word.startswith("[-"):
        word = word[1:]
    if word.endswith("]") and "[" not in word:
        word = word[:-1]
    return word


def split_commands(text: str) -> list[list[str]]:
    """The simple commands of shell text: continuation lines joined, comments dropped, split
    at ``&&``, ``||``, ``;`` and ``|``; an optional part written ``[--flag value]`` counts."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: prose, not a command
            continue
        words = [_unbracket(word) for word in words]
        current: list[str] = []
        for word in words:
            if word in SEPARATORS or word.endswith(";"):
                if word.endswith(";") and word != ";":
                    current.append(word[:-1])
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
    return [c for c in commands if c]


FENCE = re.compile(r"^(```+|~~~+)[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(2).lower(), m.group(3)) for m in FENCE.finditer(text)]


def command_problems(text: str, parsers: Parsers) -> list[str]:
    """Every documented command of a Markdown text that its parser would not take."""
    problems = []
    for language, body in fenced_blocks(text):
        if language in SHELL_LANGUAGES:
            for words in split_commands(body):
                where = " ".join(words)
                problems += [f"{p}  (in `{where}`)" for p in segment_problems(words, parsers)]
    for match in INLINE.finditer(FENCE.sub("", text)):
        span = match.group(2).strip()
        if span.startswith(("twinpipe ", "python -m ", "python tools/", "torchrun ")):
            for words in split_commands(span):
                problems += [f"{p}  (in `{span}`)" for p in segment_problems(words, parsers)]
    return problems


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\W)|(?<=\W)_|\[|\]\([^)]*\)", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown page: its headings' (duplicates numbered as GitHub numbers
    them) and every ``<a id>`` / ``<a name>``."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", text), re.M):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def link_problems(text: str, page: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of ``page``'s text (outside code) that names no file of the
    repository, or an anchor that page does not have."""
    prose = INLINE.sub("", FENCE.sub("", text))
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page.resolve()
        if path_part and not destination.is_relative_to(root.resolve()):
            problems.append(f"{page.name}: link {target} leaves the repository")
        elif not destination.exists():
            problems.append(f"{page.name}: link {target}: no such file")
        elif anchor and destination.suffix == ".md":
            other = text if destination == page.resolve() else destination.read_text()
            if anchor not in anchors(other):
                problems.append(f"{page.name}: link {target}: no such anchor")
    return problems


def section(text: str, title: str) -> str:
    """The text under a level-2 heading, up to the next one."""
    match = re.search(rf"^## {re.escape(title)}\s*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {title}' section"
    return match.group(1)


def install_commands(readme: str) -> list[str]:
    """The commands of the first shell block of README's Install section."""
    language, body = fenced_blocks(section(readme, "Install"))[0]
    assert language in SHELL_LANGUAGES, language
    return [" ".join(words) for words in split_commands(body)]


def ci_install_commands(ci_script: str) -> list[str]:
    """The ``python -m pip install`` lines `.ci/run` runs for the project (its pip upgrade
    aside)."""
    return [
        " ".join(words)
        for words in split_commands(ci_script)
        if words[:4] == ["python", "-m", "pip", "install"] and "--upgrade" not in words
    ]


TOP_FOLDERS = ("models", "reference", "optimized", "harness", "benchmarks", "tests", "tools",
               "examples", "docs", ".ci")  # fmt: skip
PACKAGES = ("models", "reference", "optimized", "harness", "benchmarks")


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute path of the longest module it starts
    with."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        try:
            for attribute in parts[end:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def name_problems(text: str, root: Path = ROOT) -> list[str]:
    """Every repository path or dotted project name in an inline code span that does not
    exist (``tests/test_x.py::test_y`` names the file)."""
    problems = []
    for match in INLINE.finditer(FENCE.sub("", text)):
        span = match.group(2).strip()
        if " " in span:
            continue
        path = span.split("::")[0]
        if path.split("/")[0] in TOP_FOLDERS and "/" in path:
            if not ((root / path).exists() or ("*" in path and any(root.glob(path)))):
                problems.append(f"`{span}`: no such file or folder")
        elif re.fullmatch(r"[a-z_]+(\.[A-Za-z_]\w*)+", span) and span.split(".")[0] in PACKAGES:
            if not _resolves(span):
                problems.append(f"`{span}`: no such module or name")
    return problems
