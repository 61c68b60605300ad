"""The tree's shape: imports point one way, no source file past 500 lines, and both
stacks report the same schedule to their observer."""

from __future__ import annotations

import subprocess
import sys
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
    assert _loaded_after("import models; import models.training, models.routing") == {"models"}


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


def test_every_subpackage_says_what_it_may_import():
    for package in ("ops", "pipeline", "estimator", "train"):
        package = f"optimized/{package}"
        text = (ROOT / package / "__init__.py").read_text()
        assert text.startswith('"""'), f"{package}/__init__.py has no docstring"
        assert "May import" in text.split('"""')[1], f"{package}: its docstring names no imports"


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
