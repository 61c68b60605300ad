"""The safety nets tested directly: code whose whole job is to catch someone else's bug.

A stack-against-stack test cannot see a broken guard (both sides pass through it, or
neither does), so each guard gets a planted case it must catch:

- the early-free guard (`FreedStorageRead`): backward reading a saved tensor whose
  storage was freed must raise, and a saved storage must never be freeable;
- the RNG state a checkpoint carries: restoring it must make the next draws of torch,
  Python and numpy equal the uninterrupted ones, on every rank;
- the routing replay's bounds: a swap must satisfy ``0 <= gap <= drift``; a baseline choice
  that is not its own top-k (gap beyond the drift) and a candidate choice that is not its
  own top-k (negative gap) must both be reported.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from models.network import RoutingTape
from optimized.pipeline import ExecutionContext, FreedStorageRead
from optimized.train.checkpointing import rng_state, set_rng_state

# ----------------------------------------------------------------- early frees


def test_backward_reading_a_freed_saved_tensor_raises():
    context = ExecutionContext()
    x = torch.randn(8, 4, requires_grad=True)
    with context.stage():
        hidden = x * 2.0  # not saved: the backward of a scalar product needs no input
        out = hidden.sigmoid()  # sigmoid saves its output for the backward
    assert context.is_saved(out) and not context.is_saved(hidden)
    assert not context.can_free(out), "a storage autograd saved must never be freed"
    out.untyped_storage().resize_(0)  # what a wrong free rule would do
    # The unpack hook itself first: with the guard broken, backward would read freed
    # memory (a segfault that ends the whole pytest run, naming no test).
    with pytest.raises(FreedStorageRead):
        ExecutionContext._unpack(out)
    with pytest.raises(FreedStorageRead, match=r"\(8, 4\)"):
        out.backward(torch.ones(8, 4))


def test_freeing_an_unsaved_stage_buffer_leaves_backward_intact():
    context = ExecutionContext(record_frees=True)
    x = torch.randn(8, 4, requires_grad=True)
    with context.stage():
        hidden = x * 3.0
        out = hidden.sigmoid()
    context.free_now("hidden", hidden)
    assert hidden.untyped_storage().nbytes() == 0
    assert [what for what, _ in context.freed] == ["hidden"]
    out.backward(torch.ones(8, 4))
    s = torch.sigmoid(x.detach() * 3.0)
    torch.testing.assert_close(x.grad, 3.0 * s * (1 - s))


def test_an_empty_saved_tensor_is_not_taken_for_a_freed_one():
    context = ExecutionContext()
    x = torch.randn(0, 4, requires_grad=True)
    with context.stage():
        out = x.sigmoid()
    out.backward(torch.ones(0, 4))  # numel 0: nothing was freed, nothing may raise
    assert x.grad.shape == (0, 4)


# ----------------------------------------------------------------- RNG state


def _draws() -> tuple:
    return (torch.rand(5).tolist(), random.random(), np.random.random_sample(3).tolist())


def test_restored_rng_state_repeats_every_generator():
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    _draws()
    state = rng_state()
    expected = _draws()
    torch.manual_seed(9), random.seed(9), np.random.seed(9)  # another history
    set_rng_state(state)
    assert _draws() == expected


@pytest.mark.parametrize("generator", ["torch", "python", "numpy"])
def test_each_generator_is_restored(generator):
    """One generator at a time: skipping any single restore fails one of these."""
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    state = rng_state()
    expected = _draws()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    set_rng_state(state)
    got = _draws()
    index = ("torch", "python", "numpy").index(generator)
    assert got[index] == expected[index]


def _resume_worker(cfg, history_seed: int):
    """Seed Python and numpy per rank (a history the trainer does not control), train,
    then report this rank's next draws."""
    import torch.distributed as dist

    from optimized.train import train

    rank = dist.get_rank()
    random.seed(history_seed + rank)
    np.random.seed(history_seed + rank)
    random.random(), np.random.random_sample()
    result = train(cfg)
    return {"start": result["start"], "draws": _draws()}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_restores_each_ranks_rng_state(tmp_path, monkeypatch):
    """After a resume the next torch, Python and numpy draws on every rank equal those of
    an uninterrupted run: the checkpoint restored each rank's own state, not rank 0's and
    not a fresh one."""
    from models.runtime import launch
    from tests.test_train import REFERENCE_RUNNER, config

    monkeypatch.setenv("TWINPIPE_RUNNER", REFERENCE_RUNNER)
    common = (
        "steps=2", "parallel.dp=2", "parallel.ep=2", "checkpoint.save_every=1",
        "optim.warmup_steps=0",
    )  # fmt: skip
    whole = launch(_resume_worker, 2, (config(*common, f"checkpoint.dir={tmp_path / 'a'}"), 100))
    part = config(*common[1:], "steps=1", f"checkpoint.dir={tmp_path / 'b'}")
    launch(_resume_worker, 2, (part, 100))
    # The resumed processes start from another history: only the checkpoint can align them.
    resumed = launch(_resume_worker, 2, (config(*common, f"checkpoint.dir={tmp_path / 'b'}"), 555))
    assert [r["start"] for r in resumed] == [1, 1]
    assert whole[0]["draws"] != whole[1]["draws"], "ranks must hold different states"
    for rank in range(2):
        assert resumed[rank]["draws"] == whole[rank]["draws"], f"rank {rank}"


# ----------------------------------------------------------------- routing replay


def _replayed(baseline_choice: list[int], baseline_scores, candidate_scores, candidate_own):
    """One router call of one token: the baseline records ``baseline_choice``; the candidate
    computes ``candidate_scores``, would choose ``candidate_own``, and replays."""
    tape = RoutingTape()
    base = torch.tensor([baseline_scores])
    tape.route("r", base, torch.tensor([baseline_choice]), torch.float32)
    replay = tape.replay()
    cand = torch.tensor([candidate_scores])
    replay.route("r", cand, torch.tensor([candidate_own]), torch.float32)
    return replay.result()


def test_a_baseline_choice_that_is_not_its_top_k_is_reported():
    # Identical scores; the baseline took expert 2 although expert 0 scores higher: the gap
    # (0.6 of the top-1 score) is not explained by any score difference (drift 0).
    result = _replayed([2], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0])
    assert len(result.swaps) == 1 and result.swaps[0].gap > 0.5 and result.swaps[0].drift == 0
    with pytest.raises(AssertionError, match="more than the scores' difference explains"):
        result.check()


def test_a_candidate_choice_that_is_not_its_top_k_is_reported():
    # The candidate claims expert 2 as its own choice though expert 0 scores higher.
    result = _replayed([0], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [2])
    assert result.swaps[0].gap < 0
    with pytest.raises(AssertionError, match="more than the scores' difference explains"):
        result.check()


def test_a_near_tie_explained_by_the_scores_passes():
    # The scores differ by 2e-6 at a tie: each stack took its own top-1; the swap's gap
    # (2e-6 / 0.4) is within the drift (4e-6 / 0.4), so the replay holds.
    result = _replayed([1], [0.399999, 0.400001, 0.2], [0.400001, 0.399999, 0.2], [0])
    assert len(result.swaps) == 1 and 0 < result.swaps[0].gap <= result.swaps[0].drift
    result.check()
