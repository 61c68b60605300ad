"""The bfloat16 verdict's arithmetic (`harness.compare.noise_floor`), on made-up errors: the L2
bound, the radial bounds (all gradients by size, each group relative to its stack's scale)
and the number of independent error sources."""

from __future__ import annotations

import math

import pytest
import torch

from harness.compare.inplace import pair_sums
from harness.compare.noise_floor import (
    ALL,
    RADIAL_SHARE,
    SLACK_LOSS,
    K,
    Z,
    _why,
    judge_grads,
    judge_group,
    judge_loss,
)

N = 4096


TRUTH = torch.randn(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _stack(scale: float, seed: int, rel: float = 1e-2) -> torch.Tensor:
    """The truth times ``scale``, plus random noise of relative size ``rel``."""
    noise = torch.randn(N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    noise -= noise.dot(TRUTH) / TRUTH.dot(TRUTH) * TRUTH  # no radial part of its own
    return TRUTH * scale + noise * (rel * TRUTH.norm() / noise.norm())


def _judge(base_scale: float, cand_scale: float, tokens: int | None = None) -> dict:
    base, cand = _stack(base_scale, 1), _stack(cand_scale, 2)
    return judge_group("g", pair_sums(base, TRUTH), pair_sums(cand, TRUTH), tokens)


def test_a_scale_error_up_to_k_times_the_reference_s_passes_either_way():
    for cand in (1 + 2 * 2e-3, 1 - 2 * 2e-3):
        entry = _judge(1 + 2e-3, cand)
        assert entry["passed"], entry
        assert entry["radial_low"] == -entry["radial_high"] < -K * 2e-3


def test_a_scale_error_beyond_k_times_the_reference_s_fails():
    """A gradient 1% too large against a reference 0.2% off: the L2 error barely moves,
    the radial part fails."""
    entry = _judge(1 + 2e-3, 1.01)
    assert entry["candidate"] <= entry["limit"]
    assert not entry["passed"] and entry["radial_candidate"] > entry["radial_high"]


def test_the_step_s_tokens_bound_the_independent_error_sources():
    """Errors correlated token by token: the allowance is ``Z rel / sqrt(min(n, tokens))``."""
    free = _judge(1.0, 1 - 2e-3)
    capped = _judge(1.0, 1 - 2e-3, tokens=16)
    assert not free["passed"] and capped["passed"]
    rel = capped["baseline"]
    allowance = Z * rel / math.sqrt(16) + RADIAL_SHARE * rel
    assert math.isclose(capped["radial_high"], K * abs(capped["radial_baseline"]) + allowance)


def test_an_l2_error_beyond_twice_the_reference_s_fails():
    """A kernel less precise than PyTorch fails: 2.5 times the reference's error, not 1.5."""
    base = _stack(1.0, 1)
    close, far = _stack(1.0, 2, rel=1.5e-2), _stack(1.0, 2, rel=2.5e-2)
    truth = pair_sums(base, TRUTH)
    assert judge_group("g", truth, pair_sums(close, TRUTH))["passed"]
    entry = judge_group("g", truth, pair_sums(far, TRUTH))
    assert not entry["passed"] and entry["ratio"] > 2.4


def _grads(scales: dict[str, float], seed: int) -> dict[str, object]:
    """Each named gradient the truth times its scale, plus noise: one stack's error sums."""
    return {
        name: pair_sums(_stack(scale, seed + i), TRUTH)
        for i, (name, scale) in enumerate(scales.items())
    }


NAMES = ("model.layers.0.mlp.experts.down_proj", "model.layers.0.self_attn.q_proj.weight",
         "lm_head.weight")  # fmt: skip


def test_a_scale_every_group_shares_is_judged_once_on_all_gradients():
    """A stack's bf16 loss scales every gradient alike (mid-qwen3-moe: the reference's
    -0.1%, the fused cross-entropy's +0.15%): each group keeps its stack's scale and
    passes; all gradients together are judged by size."""
    base = _grads({n: 1 - 1e-3 for n in NAMES}, 10)
    rows = judge_grads(base, _grads({n: 1 + 1.5e-3 for n in NAMES}, 20), tokens=N)
    assert all(r["passed"] for r in rows), [_why(r) for r in rows]
    assert all(r["radial_candidate"] > r["radial_baseline"] + 2e-3 for r in rows)
    too_far = judge_grads(base, _grads({n: 1 + 5e-3 for n in NAMES}, 20), tokens=N)
    assert [r["group"] for r in too_far if not r["passed"]] == [ALL]


def test_one_group_off_its_stack_s_scale_fails_within_twice_the_reference_s_size():
    """An activation rounded toward zero: the down projection's gradient 0.25% small while
    the others keep the stack's scale. By size it is within twice the reference's scale
    error (0.15%, its loss); relative to its own stack it stands out."""
    base = _grads({n: 1 + 1.5e-3 for n in NAMES}, 10)
    cand = _grads({NAMES[0]: 1 - 2.5e-3, NAMES[1]: 1.0, NAMES[2]: 1.0}, 20)
    rows = {r["group"]: r for r in judge_grads(base, cand, tokens=N)}
    down = rows["model.layers.*.mlp.experts.down_proj"]
    assert abs(down["radial_candidate"]) < K * abs(down["radial_baseline"])  # size: hidden
    assert not down["passed"], down
    assert "where its stack's scale is" in _why(down)
    assert rows["model.layers.*.self_attn.q_proj.weight"]["passed"]
    assert rows[ALL]["passed"]  # the bias is diluted in all gradients together


def test_the_loss_is_judged_against_the_reference_s_distance_from_the_truth():
    """The loss bound is K times the *reference's* relative distance from the float32 truth
    (plus a slack): a candidate five times as far fails, one within K times passes. A bound
    computed from the candidate's own distance would pass anything."""
    truth, baseline = 2.0, 2.0 * (1 + 1e-3)  # the reference: 1e-3 from the truth
    close = judge_loss({"truth": truth, "baseline": baseline, "candidate": 2.0 * (1 - 1.5e-3)})
    far = judge_loss({"truth": truth, "baseline": baseline, "candidate": 2.0 * (1 + 5e-3)})
    assert close["limit"] == far["limit"] == pytest.approx(K * 1e-3 + SLACK_LOSS)
    assert close["passed"]
    assert not far["passed"] and far["candidate"] == pytest.approx(5e-3)
