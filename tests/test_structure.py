"""The tree's shape: imports point one way (between the packages, between `optimized`'s
subpackages, and from callers into a subpackage rather than its files), each subpackage
names its modules, no source file past 500 lines, and both stacks report the same schedule
to their observer."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "reference", "optimized", "harness")
MAX_LINES = 500


def _loaded_after(statement: str) -> set[str]:
    """Top-level twinpipe packages in ``sys.modules`` after ``statement``, in a fresh process."""
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {name.split(".")[0] for name in out} & set(PACKAGES)


def test_models_imports_neither_stack():
    """Every `models` module, imported in a fresh process, loads nothing of `reference`,
    `optimized` or `harness`."""
    names = [m.name for m in pkgutil.walk_packages([str(ROOT / "models")], "models.")]
    assert len(names) > 15, f"the models modules were not found: {names}"
    assert _loaded_after(f"import models, {', '.join(names)}") == {"models"}


def test_optimized_does_not_import_reference_or_harness():
    loaded = _loaded_after(
        "import optimized.ops, optimized.estimator, optimized.pipeline, optimized.train; "
        "import optimized.estimator.cli, optimized.train.cli, optimized.train.data_cli"
    )
    assert loaded == {"models", "optimized"}


def test_reference_imports_only_models():
    loaded = _loaded_after("import reference.pipeline, reference.oracle, reference.ops")
    assert loaded == {"models", "reference"}


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_source_file_over_500_lines():
    files = source_files()
    assert len(files) > 40, "the source files were not found"
    long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these at their seams (limit {MAX_LINES} lines): {long}"


SUBPACKAGES = ("ops", "estimator", "pipeline", "train")
MAY_IMPORT = {
    "ops": set(),
    "estimator": set(),
    "pipeline": {"ops", "estimator"},
    "train": {"ops", "estimator", "pipeline"},
}
"""The other `optimized` subpackages each one may import anywhere, as its docstring says."""
LAZY_ONLY = {"estimator": {"optimized.pipeline.partition", "optimized.train.sizing"}}
"""Modules a subpackage may import only inside a function: the estimator asks the pipeline
which partition a run would use, and its commands ask the trainer what a run of its config
holds (the cycles `optimized`'s docstring states)."""
NEVER = ("reference", "harness")


def _docstring(path: Path) -> str:
    text = ast.get_docstring(ast.parse(path.read_text()))
    assert text, f"{path.relative_to(ROOT)} has no docstring"
    return text


def _bound_by_init(folder: Path) -> set[str]:
    """The names a package's ``__init__`` binds itself (its re-exports shadow the modules
    of the same name: ``from optimized.ops import cross_entropy`` is the function)."""
    names = set()
    for node in ast.parse((folder / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _module_of(package: str, name: str) -> str:
    """``package.name`` where ``from package import name`` imports a module, else ``package``."""
    folder = ROOT.joinpath(*package.split("."))
    if not (folder / "__init__.py").exists() or name in _bound_by_init(folder):
        return package
    is_module = (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists()
    return f"{package}.{name}" if is_module else package


def imports_of(path: Path) -> Iterator[tuple[str, int, bool]]:
    """(module, line, inside a function) for every import in ``path``, at any depth, and every
    ``"module:name"`` string (what `importlib` loads: the trainer's runner)."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, in_function
            elif isinstance(child, ast.ImportFrom):
                where = f"{path.relative_to(ROOT)}:{child.lineno}"
                assert child.level == 0 and child.module, f"{where}: a relative import"
                for alias in child.names:
                    yield _module_of(child.module, alias.name), child.lineno, in_function
            elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                if re.fullmatch(r"\w+(\.\w+)*:\w+", child.value):
                    yield child.value.split(":")[0], child.lineno, in_function
            functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            yield from visit(child, in_function or isinstance(child, functions))

    yield from visit(ast.parse(path.read_text()), False)


def test_every_subpackage_says_what_it_may_import():
    """Each docstring's "May import" names exactly the `optimized` modules of the table above,
    and every module file of the subpackage."""
    for package in SUBPACKAGES:
        text = _docstring(ROOT / "optimized" / package / "__init__.py")
        assert "May import" in text, f"optimized.{package}: its docstring names no imports"
        allowed = text.split("May import")[1].split("; never")[0]
        named = set(re.findall(r"`(optimized\.[\w.]+)`", allowed))
        expected = {f"optimized.{other}" for other in MAY_IMPORT[package]}
        expected |= LAZY_ONLY.get(package, set())
        assert named == expected, f"optimized.{package}: docstring {named}, table {expected}"
        modules = [p.stem for p in (ROOT / "optimized" / package).glob("*.py")]
        unnamed = sorted(m for m in modules if m != "__init__" and f"`{m}`" not in text)
        assert not unnamed, f"optimized.{package}'s docstring does not name {unnamed}"


def test_every_optimized_import_follows_the_subpackage_edges():
    """Every import in `optimized/<sub>/*.py`, function-level ones included, of another
    subpackage is an edge its docstring allows; none reaches `reference` or `harness`."""
    wrong = []
    for package in SUBPACKAGES:
        files = sorted((ROOT / "optimized" / package).glob("*.py"))
        assert len(files) > 1, f"optimized.{package}: no modules found"
        for path in files:
            for module, line, in_function in imports_of(path):
                parts = module.split(".")
                where = f"{path.relative_to(ROOT)}:{line} imports {module}"
                if parts[0] in NEVER:
                    wrong.append(where)
                if parts[0] != "optimized" or len(parts) < 2 or parts[1] == package:
                    continue
                lazy = in_function and module in LAZY_ONLY.get(package, set())
                if parts[1] not in MAY_IMPORT[package] and not lazy:
                    wrong.append(where + (" (allowed only in a function)" * (not in_function)))
    assert not wrong, "imports against optimized's edges:\n" + "\n".join(wrong)


DEEP_IMPORTS_ALLOWED = {
    ("harness/planted.py", "optimized.pipeline.dualpipev"): (
        "a planted bug patches the module's own `linear_cross_entropy` name"
    ),
}
"""(file, module; None: any) -> why it may import a file inside an `optimized` subpackage."""


def test_callers_import_optimized_subpackages_not_their_files():
    """`harness` and `benchmarks` import `optimized.train`, never `optimized.train.export`:
    the subpackages' public names are re-exported by their ``__init__``."""
    wrong = []
    files = sorted(p for folder in ("harness", "benchmarks") for p in (ROOT / folder).glob("*.py"))
    assert len(files) > 20, "the harness and benchmark files were not found"
    for path in files:
        name = str(path.relative_to(ROOT))
        for module, line, _ in imports_of(path):
            parts = module.split(".")
            if parts[0] != "optimized" or len(parts) < 3:
                continue
            if (name, module) in DEEP_IMPORTS_ALLOWED or (name, None) in DEEP_IMPORTS_ALLOWED:
                continue
            wrong.append(f"{name}:{line} imports {module}")
    assert not wrong, "import these from the subpackage:\n" + "\n".join(wrong)


def test_a_model_without_ops_refuses_to_run_and_says_how():
    from models import build_model, preset

    model = build_model(preset("tiny-qwen3-moe"))
    with pytest.raises(RuntimeError, match="ReferenceOps"):
        model(torch.zeros(1, 4, dtype=torch.long))


def _marks_worker(names):
    from models import SeededWeights, preset
    from models.distributed import ParallelConfig, make_layout
    from models.training import OptimizerConfig, synthetic_batch
    from optimized.pipeline import OptimizedPipeline
    from reference.pipeline import ReferencePipeline

    del names
    model = preset("tiny-deepseek-v2")
    parallel = ParallelConfig(pp=2, dp=1, ep=1, micro_batches=5, micro_batch_size=1, seq_len=16)
    layout = make_layout(parallel)
    state = SeededWeights(model, seed=0)
    marks = {}
    for name, cls in (("reference", ReferencePipeline), ("optimized", OptimizedPipeline)):
        pipeline = cls(model, parallel, layout, state, OptimizerConfig())
        seen: list[str] = []
        pipeline.observer = lambda moment, micro_batch, seen=seen: seen.append(moment)
        pipeline.forward_backward(*synthetic_batch(model, parallel, 0))
        marks[name] = seen
    return marks


@pytest.mark.multiprocess
def test_both_stacks_mark_the_same_schedule():
    """Every action, W included, reports itself to the observer in both stacks. The
    optimized stack marks an overlapped pair once (``F0&B1``), the reference its F, then
    its B: expanded, the two sequences are equal."""
    from models.distributed import launch

    results = launch(_marks_worker, 2, (None,))
    for rank, marks in enumerate(results):
        expanded = []
        for moment in marks["optimized"]:
            phase, action = moment.split(":")
            expanded += [f"{phase}:{part}" for part in action.split("&")]
        assert any(m.endswith(":W") for m in marks["reference"]), f"rank {rank}: no W marked"
        assert marks["reference"] == expanded, f"rank {rank}"
