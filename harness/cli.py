"""The `twinpipe` command line: one entry point, one subcommand per job.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)``
and ``run(args) -> int``. Modules are imported only when their subcommand runs,
so `twinpipe --help` stays fast and a missing optional dependency of one
subcommand never breaks the others.

Exit codes are the same for every subcommand, so scripts can trust them:

- 0: done, or within tolerance;
- 1: outside tolerance or a regression (`compare`, `diff` only);
- 2: bad input, reported before any work or process group starts (argparse's own
  errors are 2 as well);
- 3: a crash or internal error. An exception no subcommand expected ends here, with
  its traceback, and never as 1, which a script would read as "regressed";
- 128 + N: stopped by signal N before the work was done (143 for SIGTERM, 130 for
  Ctrl-C), after saving what could be saved.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import traceback

EXIT_OK, EXIT_OUTSIDE_TOLERANCE, EXIT_BAD_INPUT, EXIT_CRASH = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT
# name -> (module, one-line help). Order is the order `--help` lists them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("harness.compare.cli", "run two stacks side by side and compare them"),
    "diff": ("harness.history.diff", "compare two compare/bench reports; exit 1 on a regression"),
    "bench": ("harness.history.bench", "run the benchmarks and append the results to a history"),
    "dashboard": ("harness.history.dashboard", "render a static HTML dashboard from a history"),
    "estimate": ("optimized.estimator.cli", "estimate per-rank memory from the configs alone"),
    "plan": ("optimized.estimator.plan_cli", "list the DualPipeV layouts that fit the GPUs"),
    "train": ("optimized.train.cli", "train a model on the optimized stack"),
    "prepare-data": ("optimized.data.data_cli", "tokenize a corpus into Megatron .bin/.idx"),
    "export": (
        "optimized.train.export",
        "export a training checkpoint as a Hugging Face checkpoint",
    ),
}


def _available() -> dict[str, tuple[str, str]]:
    """Subcommands whose module exists in this installation."""
    found = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = (
            "default" not in text.lower()
            and action.option_strings
            and default is not argparse.SUPPRESS
            and default is not None
            and not (isinstance(action, argparse._StoreTrueAction) and default is False)
            and not isinstance(action, argparse._HelpAction)
        )
        return f"{text} (default: %(default)s)" if shown else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twinpipe",
        description="Train MoE models with DualPipeV and prove every optimization it uses.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available().items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module)
        # Arguments are added lazily in main() for the chosen command only.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    name = argv[0]
    available = _available()
    if name not in available:
        parser.print_usage(sys.stderr)
        valid = ", ".join(available)
        print(
            f"twinpipe: error: unknown command {name!r}; valid commands: {valid}", file=sys.stderr
        )
        return 2
    module_name, help_text = available[name]
    module = importlib.import_module(module_name)
    sub_parser = argparse.ArgumentParser(
        prog=f"twinpipe {name}", description=help_text, formatter_class=DefaultsHelpFormatter
    )
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"twinpipe {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - the one place an unexpected error becomes exit 3
        traceback.print_exc()
        print(
            f"twinpipe {name}: internal error (exit {EXIT_CRASH}); the traceback above says "
            "where. Please report it with the command line.",
            file=sys.stderr,
        )
        return EXIT_CRASH


def entry() -> int:
    """The `twinpipe` command: `main` in a process of its own, which may fork its ranks
    (`models.runtime.fork_is_safe`). A caller of `main` in its own process (a test) keeps
    the rank server."""
    from models.runtime import allow_forked_ranks  # noqa: PLC0415  (torch: not for --help)

    allow_forked_ranks()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
