"""Multi-token prediction's planted bugs (`harness.compare.planted_mtp`) fail `twinpipe
compare` in float32, each named by what the verdict judges (the MTP losses beside the main
loss, `harness.compare.mtp`, or a gradient); the correct stack passes. One launch runs the
correct stack and every bug, on a tiny DeepSeek-V3 with two MTP depths, on one rank with two
micro-batches (PP 2 with four before: the MTP stage and the embedding it shares sit on one
rank there too, DualPipeV's rank 0 holding the first and the last chunk, so each bug is the
same; each was seen failing at PP 1 when it was cut. MTP across the pipeline's layouts is
tests/test_mtp_layouts.py's)."""

from __future__ import annotations

import pytest

from harness.compare.planted import PLANTS
from harness.compare.planted_balancing import plant_problem
from harness.compare.planted_mtp import MTP_PLANTS
from models.network import preset
from models.runtime import ParallelConfig
from tests._compare import planted_reports

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MODEL = preset("tiny-deepseek-v3", num_mtp_layers=2, mtp_loss_coef=0.3)
LAYOUT = ParallelConfig(
    pp=1, dp=1, ep=1, micro_batches=2, micro_batch_size=1, seq_len=16, dtype="float32"
)
CAUGHT_BY = {
    "mtp-depth-one-short": "the MTP loss of depth 1 differs",
    "mtp-concat-swapped": "the MTP loss of depth 1 differs",
    "mtp-embedding-detached": "gradient model.embed_tokens.weight relative error",
    "mtp-loss-not-divided-by-d": "relative error",
    "mtp-labels-wrapped": "the MTP loss of depth 1 differs",
}
"""What names each bug in the verdict's problems."""

_REPORTS: dict = {}


def _reports() -> dict:
    if not _REPORTS:
        _REPORTS.update(planted_reports(MODEL, LAYOUT, tuple(CAUGHT_BY), "tiny-deepseek-v3"))
    return _REPORTS


def test_every_mtp_plant_is_listed_and_shows_here():
    assert set(CAUGHT_BY) == set(MTP_PLANTS) and set(MTP_PLANTS) <= set(PLANTS)
    for plant in MTP_PLANTS:
        assert plant_problem(plant, MODEL, LAYOUT, None) is None, plant
    plain = preset("tiny-deepseek-v3")
    assert "add --mtp-layers" in plant_problem("mtp-concat-swapped", plain, LAYOUT, None)


def test_the_correct_stack_passes_and_reports_the_mtp_losses():
    report = _reports()[None]
    assert report["passed"], report["problems"]
    mtp = report["mtp"]
    assert mtp["depths"] == 2 and len(mtp["baseline"]["loss"][0]) == 2
    assert max(mtp["rel_error"][0]) <= report["tolerance"]["loss_rel"]


@pytest.mark.parametrize("plant", list(CAUGHT_BY))
def test_a_planted_mtp_bug_fails(plant):
    report = _reports()[plant]
    assert not report["passed"]
    assert report["config"]["plant"] == plant
    assert any(CAUGHT_BY[plant] in p for p in report["problems"]), report["problems"]
    # The main loss is untouched: only the MTP's figures and gradients show the bug.
    assert report["loss"]["rel_error"][0] <= report["tolerance"]["loss_rel"]
