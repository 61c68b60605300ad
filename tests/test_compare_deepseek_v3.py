"""`twinpipe compare` on tiny-deepseek-v3: the correct optimized stack passes in bfloat16 with
the noise floor and the ops audit, and the planted bug of DeepSeek-V3's routing
(``group-score-from-max``: groups scored by their best expert, not their two best) fails.

Routing is pinned, so the bug moves no number of the candidate's step (it replays the
truth's experts): the replay catches it, where the candidate's group scores differ from the
truth's far beyond the noise floor. One launch runs both (the bug is planted and removed in
the ranks); the other layouts are the README's commands."""

from __future__ import annotations

import pytest

from models.network import preset
from models.runtime import ParallelConfig
from tests._compare import planted_reports

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PARALLEL = ParallelConfig(
    pp=2, dp=1, ep=1, micro_batches=4, micro_batch_size=2, seq_len=32, dtype="bfloat16"
)
PLANT = "group-score-from-max"


@pytest.fixture(scope="module")
def reports():
    model = preset("tiny-deepseek-v3")
    return planted_reports(model, PARALLEL, (PLANT,), "tiny-deepseek-v3", noise_floor=True)


def test_the_correct_stack_passes(reports):
    report = reports[None]
    assert report["passed"], report["problems"]
    assert report["noise_floor"]["steps"][0]["passed"]
    assert report["ops_audit"]["passed"], report["ops_audit"]
    assert report["routing"]["problems"] == []


def test_group_scores_from_the_max_fail_by_name(reports):
    report = reports[PLANT]
    assert not report["passed"]
    assert report["config"]["plant"] == PLANT
    assert any("(its group scores)" in p for p in report["routing"]["problems"]), report
    floor = report["noise_floor"]["steps"][0]
    assert not floor["passed"] and any("router" in p for p in floor["problems"])
    assert report["ops_audit"]["passed"]  # no op of `models.network.Ops` is wrong
