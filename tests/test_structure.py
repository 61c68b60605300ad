"""The tree's shape: imports point one way (between the packages, between `optimized`'s
and `harness`'s subpackages, and from callers into a subpackage rather than its files), no
circle among the project's modules, no module importing another's private name, each
subpackage names its modules, no source file past 500 lines (no harness file past 350),
the CLI's subcommands are modules, and both stacks report the same schedule to their
observer."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "reference", "optimized", "harness")
PROJECT = (*PACKAGES, "benchmarks")
"""Every folder of the project's source (the benchmarks import the packages too)."""
MAX_LINES = 500
HARNESS_MAX_LINES = 350


def _loaded_after(statement: str) -> set[str]:
    """Top-level twinpipe packages in ``sys.modules`` after ``statement``, in a fresh process."""
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {name.split(".")[0] for name in out} & set(PACKAGES)


def _models_modules() -> list[str]:
    names = [
        _module_name(p) for p in sorted((ROOT / "models").rglob("*.py")) if p.name != "__init__.py"
    ]
    assert len(names) > 20, f"the models modules were not found: {names}"
    return names


def test_models_imports_neither_stack():
    """Every `models` module, imported in a fresh process, loads nothing of `reference`,
    `optimized` or `harness`."""
    assert _loaded_after(f"import models, {', '.join(_models_modules())}") == {"models"}


def test_the_network_loads_neither_checkpoints_nor_runtime():
    """Every module of the math, imported in a fresh process, loads no module of `models.hf`
    or `models.runtime` (the Triton switch lives in `models` itself for this reason)."""
    network = [m for m in _models_modules() if m.startswith("models.network.")]
    code = f"import sys, {', '.join(network)}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    loaded = sorted(m for m in out if m.startswith(("models.hf", "models.runtime")))
    assert len(network) >= 8 and not loaded, f"importing the math loaded {loaded}"


def test_optimized_does_not_import_reference_or_harness():
    loaded = _loaded_after(
        "import optimized.ops, optimized.estimator, optimized.pipeline, optimized.train; "
        "import optimized.estimator.cli, optimized.train.cli, optimized.data.data_cli"
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


SUBPACKAGES = ("ops", "estimator", "pipeline", "data", "train")
MAY_IMPORT = {
    "ops": set(),
    "estimator": set(),
    "pipeline": {"ops", "estimator"},
    "data": set(),
    "train": {"ops", "estimator", "pipeline", "data"},
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
                where = f"{path}:{child.lineno}"
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
        modules = [p.stem for p in (ROOT / "optimized" / package).rglob("*.py")]
        unnamed = sorted(m for m in modules if m != "__init__" and f"`{m}`" not in text)
        assert not unnamed, f"optimized.{package}'s docstring does not name {unnamed}"


def test_every_optimized_import_follows_the_subpackage_edges():
    """Every import in `optimized/<sub>/*.py`, function-level ones included, of another
    subpackage is an edge its docstring allows; none reaches `reference` or `harness`."""
    wrong = []
    for package in SUBPACKAGES:
        files = sorted((ROOT / "optimized" / package).rglob("*.py"))
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


HARNESS_MAY_IMPORT = {
    "compare": {"memory", "report"},
    "memory": set(),
    "report": set(),
    "history": {"report"},
}
"""The other `harness` subpackages each one may import anywhere, as its docstring says."""


def _may_import(path: Path) -> tuple[set[str], str]:
    """The modules a subpackage's docstring allows (its "May import" names, up to
    "; never"), and the docstring."""
    text = _docstring(path)
    assert "May import" in text, f"{path.relative_to(ROOT)}: its docstring names no imports"
    allowed = re.split(r";\s+never", text.split("May import")[1])[0]
    return set(re.findall(r"`([\w.]+)`", allowed)), text


def test_every_harness_subpackage_says_what_it_may_import():
    """Each `harness` subpackage's docstring names exactly the `harness` subpackages of the
    table above, and every module file of the subpackage; the harness's top level holds
    only its package file and the CLI."""
    for package, others in HARNESS_MAY_IMPORT.items():
        named, text = _may_import(ROOT / "harness" / package / "__init__.py")
        mine = {n for n in named if n.startswith("harness.")}
        expected = {f"harness.{other}" for other in others}
        assert mine == expected, f"harness.{package}: docstring {mine}, table {expected}"
        modules = [p.stem for p in (ROOT / "harness" / package).rglob("*.py")]
        unnamed = sorted(m for m in modules if m != "__init__" and f"`{m}`" not in text)
        assert not unnamed, f"harness.{package}'s docstring does not name {unnamed}"
    top = sorted(p.name for p in (ROOT / "harness").glob("*.py"))
    assert top == ["__init__.py", "cli.py"], f"harness/ holds {top}: put them in a subpackage"
    folders = sorted(p.name for p in (ROOT / "harness").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(HARNESS_MAY_IMPORT), f"harness's subpackages: {folders}"


def test_every_harness_import_follows_the_subpackage_edges():
    """Every import in `harness/<sub>/`, function-level ones and ``module:name`` strings
    included, of another subpackage or another project package is one its docstring
    allows."""
    wrong = []
    for package in HARNESS_MAY_IMPORT:
        named, _ = _may_import(ROOT / "harness" / package / "__init__.py")
        files = sorted((ROOT / "harness" / package).rglob("*.py"))
        assert len(files) > 1, f"harness.{package}: no modules found"
        for path in files:
            for module, line, _ in imports_of(path):
                parts = module.split(".")
                if parts[0] not in PROJECT:
                    continue
                where = f"{path.relative_to(ROOT)}:{line} imports {module}"
                if parts[0] != "harness":
                    if parts[0] not in named:
                        wrong.append(where)
                elif len(parts) < 2 or parts[1] not in HARNESS_MAY_IMPORT:
                    wrong.append(where + " (the harness's top level)")
                elif parts[1] != package and f"harness.{parts[1]}" not in named:
                    wrong.append(where)
    assert not wrong, "imports against harness's edges:\n" + "\n".join(wrong)


def test_no_harness_file_over_350_lines():
    files = sorted((ROOT / "harness").rglob("*.py"))
    long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > HARNESS_MAX_LINES
    }
    assert not long, f"split these at their seams (limit {HARNESS_MAX_LINES} lines): {long}"


def test_every_subcommand_is_a_module_with_a_command():
    """Each module string of the CLI's table imports, and has the command's two
    functions (`harness.cli` imports it only when its subcommand runs)."""
    from harness.cli import SUBCOMMANDS

    for name, (module, _) in SUBCOMMANDS.items():
        loaded = importlib.import_module(module)
        for function in ("add_arguments", "run"):
            assert callable(getattr(loaded, function, None)), f"{name}: {module}.{function}"


PRIVATE_IMPORTS_ALLOWED = {
    ("optimized/ops/__init__.py", "optimized.ops", "_triton"): (
        "the Triton switch, a module imported first so that the interpreter is on before "
        "any kernel module imports triton"
    ),
}
"""(file, module, name) -> why it may import a private name of another module."""


def _project_files() -> list[Path]:
    return sorted(p for folder in PROJECT for p in (ROOT / folder).rglob("*.py"))


def test_no_module_imports_another_modules_private_name():
    """``from X import _name`` with X a project module, anywhere (function-level too): a
    name several modules share belongs in a small public module."""
    wrong = []
    for path in _project_files():
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.split(".")[0] not in PROJECT:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and (name, node.module, alias.name) not in PRIVATE_IMPORTS_ALLOWED:
                    wrong.append(f"{name}:{node.lineno} imports {alias.name} from {node.module}")
    assert not wrong, "private names imported across modules:\n" + "\n".join(wrong)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported project module: where (file:line)}, every import counted
    (function-level ones and ``module:name`` strings included). An import names the module
    it loads (``from package import name`` the package, unless ``name`` is a submodule its
    ``__init__`` does not bind); a package's ``__init__`` running first is not an edge."""
    files = {_module_name(p): p for p in _project_files()}
    graph: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for target, line, _ in imports_of(path):
            parts = target.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            found = ".".join(parts)
            if parts and found != module:
                edges.setdefault(found, f"{path.relative_to(ROOT)}:{line}")
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:  # a shortest way back to the first member
        start = min(component)
        paths = {start: [start]}
        queue = [start]
        while queue:
            node = queue.pop(0)
            for target in sorted(graph[node]):
                if target == start:
                    queue, cycle = [], paths[node] + [start]
                    break
                if target in component and target not in paths:
                    paths[target] = paths[node] + [target]
                    queue.append(target)
        cycles.append(cycle)
    return cycles


def test_no_import_circle_between_modules():
    """No circle among the project's modules, function-level imports included: a circle
    means two modules are one cut in two, or an import order that works by luck."""
    graph = import_graph()
    assert len(graph) > 100, "the project's modules were not found"
    found = []
    for cycle in _cycles(graph):
        steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        found.append("\n  ".join(steps))
    assert not found, "import circles:\n  " + "\n\n  ".join(found)


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {"a": "c.py:1"}, "d": {"a": "x"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": "a.py:1"}, "b": {}}) == []


DEEP_IMPORTS_ALLOWED = {
    ("harness/compare/planted.py", "optimized.pipeline.dualpipev"): (
        "a planted bug patches the module's own `linear_cross_entropy` name"
    ),
    ("harness/compare/planted.py", "optimized.pipeline.runner"): (
        "a planted bug patches the module's own `build_part` name: the optimized stack's "
        "routers, and only theirs, get its group score"
    ),
    ("harness/compare/bisect.py", "optimized.pipeline.dualpipev"): (
        "the bisection's loss stage calls the optimized schedule's own loss object "
        "(`SummedLinearCrossEntropy`), so a bug in it, planted or not, is found"
    ),
}
"""(file, module; None: any) -> why it may import a file inside an `optimized` subpackage."""


def test_callers_import_optimized_subpackages_not_their_files():
    """`harness` and `benchmarks` import `optimized.train`, never `optimized.train.export`:
    the subpackages' public names are re-exported by their ``__init__``."""
    wrong = []
    files = sorted(p for folder in ("harness", "benchmarks") for p in (ROOT / folder).rglob("*.py"))
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


MODELS_MAY_IMPORT = {"network": set(), "hf": {"network", "runtime"}, "runtime": {"network"}}
"""The other `models` subpackages each one may import anywhere, as its docstring says (all
may import `models` itself, which holds only the Triton switch)."""


def test_every_models_subpackage_says_what_it_may_import():
    """Each `models` subpackage's docstring names exactly the subpackages of the table above
    and every module file it holds; `models/` holds only its package file and the three."""
    for package, others in MODELS_MAY_IMPORT.items():
        named, text = _may_import(ROOT / "models" / package / "__init__.py")
        mine = {n for n in named if n.startswith("models.")}
        expected = {f"models.{other}" for other in others}
        assert mine == expected, f"models.{package}: docstring {mine}, table {expected}"
        modules = [p.stem for p in (ROOT / "models" / package).rglob("*.py")]
        unnamed = sorted(m for m in modules if m != "__init__" and f"`{m}`" not in text)
        assert not unnamed, f"models.{package}'s docstring does not name {unnamed}"
    top = sorted(p.name for p in (ROOT / "models").glob("*.py"))
    assert top == ["__init__.py"], f"models/ holds {top}: put them in a subpackage"
    folders = sorted(p.name for p in (ROOT / "models").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(MODELS_MAY_IMPORT), f"models' subpackages: {folders}"


def models_edge_violations(files: list[Path], root: Path = ROOT) -> list[str]:
    """Imports in ``files`` (each in `models/<sub>/` under ``root``) against the table."""
    wrong = []
    for path in files:
        package = path.relative_to(root).parts[1]
        for module, line, _ in imports_of(path):
            parts = module.split(".")
            where = f"{path.relative_to(root)}:{line} imports {module}"
            if parts[0] in ("reference", "optimized", "harness", "benchmarks"):
                wrong.append(where)
            elif parts[0] == "models" and len(parts) > 1 and parts[1] != package:
                if parts[1] not in MODELS_MAY_IMPORT[package]:
                    wrong.append(where)
    return wrong


def test_every_models_import_follows_the_subpackage_edges():
    """Every import in `models/<sub>/`, function-level ones included: the math imports
    neither the checkpoints nor the runtime; the runtime never the checkpoints."""
    files = sorted(p for sub in MODELS_MAY_IMPORT for p in (ROOT / "models" / sub).rglob("*.py"))
    assert len(files) > 20, "the models files were not found"
    wrong = models_edge_violations(files)
    assert not wrong, "imports against models' edges:\n" + "\n".join(wrong)


def test_the_models_edge_check_finds_a_wrong_edge(tmp_path):
    """A math module importing the runtime, or a stack, is reported (the check can fail)."""
    bad = tmp_path / "models" / "network" / "probe.py"
    bad.parent.mkdir(parents=True)
    bad.write_text('"""probe"""\n\nfrom models.runtime import launch\nimport optimized.ops\n')
    assert models_edge_violations([bad], root=tmp_path) == [
        "models/network/probe.py:3 imports models.runtime",
        "models/network/probe.py:4 imports optimized.ops",
    ]


MODELS_DEEP_IMPORTS_ALLOWED = {
    ("tests/test_checkpoint_read.py", "models.hf.checkpoint"): (
        "the test shrinks the module's read buffer (`READ_BUFFER_BYTES`) to exercise it"
    ),
    ("tests/test_mxfp4.py", "models.hf.checkpoint"): (
        "the test replaces the module's `safe_open` to prove a load maps no checkpoint file"
    ),
    ("tests/test_fp8.py", "models.hf.checkpoint"): (
        "the test replaces the module's `safe_open` to prove a load maps no checkpoint file"
    ),
    ("tests/test_mtp_copies.py", "models.hf.checkpoint"): (
        "the test counts the module's `read_rows` calls to prove each block is read once"
    ),
    ("tests/test_mtp_copies.py", "models.hf.mtp_copies"): (
        "the test shrinks the module's compared block (`BLOCK_BYTES`) to exercise it"
    ),
}
"""(file, module) -> why it may import a file inside a `models` subpackage."""


def test_callers_import_models_subpackages_not_their_files():
    """Outside `models`, code and tests import `models.network`, never
    `models.network.config`: each subpackage re-exports its public names."""
    wrong = []
    folders = ("reference", "optimized", "harness", "benchmarks", "tests", "tools")
    files = sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))
    assert len(files) > 100, "the callers were not found"
    for path in files:
        name = str(path.relative_to(ROOT))
        for module, line, _ in imports_of(path):
            parts = module.split(".")
            if parts[0] == "models" and len(parts) > 2:
                if (name, module) not in MODELS_DEEP_IMPORTS_ALLOWED:
                    wrong.append(f"{name}:{line} imports {module}")
    assert not wrong, "import these from the subpackage:\n" + "\n".join(wrong)


def test_a_model_without_ops_refuses_to_run_and_says_how():
    from models.network import build_model, preset

    model = build_model(preset("tiny-qwen3-moe"))
    with pytest.raises(RuntimeError, match="ReferenceOps"):
        model(torch.zeros(1, 4, dtype=torch.long))


def _marks_worker(names):
    from models.network import SeededWeights, preset
    from models.runtime import OptimizerConfig, ParallelConfig, make_layout, synthetic_batch
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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_both_stacks_mark_the_same_schedule():
    """Every action, W included, reports itself to the observer in both stacks. The
    optimized stack marks an overlapped pair once (``F0&B1``), the reference its F, then
    its B: expanded, the two sequences are equal."""
    from models.runtime import launch

    results = launch(_marks_worker, 2, (None,))
    for rank, marks in enumerate(results):
        expanded = []
        for moment in marks["optimized"]:
            phase, action = moment.split(":")
            expanded += [f"{phase}:{part}" for part in action.split("&")]
        assert any(m.endswith(":W") for m in marks["reference"]), f"rank {rank}: no W marked"
        assert marks["reference"] == expanded, f"rank {rank}"
