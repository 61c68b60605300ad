"""The GPU check's plumbing, on a machine without a GPU: each part runs in its own process,
a part that cannot run is recorded as failed with its output, and the JSON and the table
are written all the same (`benchmarks/gpu_check.py`)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks a machine without a GPU")
def test_a_part_that_cannot_run_is_recorded_and_the_table_is_written(tmp_path):
    code = gpu_check.main(["--out", str(tmp_path), "--only", "compare"])
    assert code == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    compare = summary["parts"]["compare"]
    assert compare["exit_code"] == 2 and not compare["passed"] and not compare["timed_out"]
    assert "no usable CUDA device" in compare["tail"], compare["tail"]
    assert summary["machine"]["torch"] == torch.__version__
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| compare mid-qwen3-moe PP1 bf16 | FAIL |" in table, table
    assert "no GPU" in table


def test_an_unwritable_output_folder_is_bad_input(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert gpu_check.main(["--out", str(blocker / "sub"), "--only", "compare"]) == 2


def test_benchmark_rows_and_train_rates(tmp_path):
    document = {
        "benchmarks": [
            {
                "group": "attention",
                "name": "test_attention[optimized]",
                "stats": {"median": 0.0032},
                "extra_info": {"op": "attention", "implementation": "optimized",
                               "tflops_per_s": 152.0, "peak_bytes": 1024},
            }
        ]
    }  # fmt: skip
    rows = gpu_check.summarize_benchmarks(document)
    assert rows == [{"op": "attention", "implementation": "optimized", "shape": None,
                     "median_ms": 3.2, "tflops": 152.0, "peak_bytes": 1024,
                     "logits_multiple": None}]  # fmt: skip
    metrics = tmp_path / "m.jsonl"
    records = [
        {"step": s, "tokens_per_second": 1000.0 * s, "tflops": 100.0 + s, "mfu": None,
         "peak_memory_bytes": 10 * s}
        for s in range(1, 6)
    ]  # fmt: skip
    metrics.write_text("\n".join(json.dumps(r) for r in records))
    rates = gpu_check.train_rates(metrics)
    assert rates["steps_measured"] == [3, 4, 5]
    assert rates["tokens_per_second"] == 4000.0 and rates["tflops"] == 104.0
    assert rates["mfu"] is None and rates["peak_memory_bytes"] == 50
