"""Routing tapes (`models.network.routing`): record, replay, near-tie swaps, misuse."""

from __future__ import annotations

import pytest
import torch

from models.network import Router, RoutingTape, attach_routing_tape, preset

PRESETS = ("tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe")


def _router(name: str, seed: int = 0) -> Router:
    torch.manual_seed(seed)
    router = Router(preset(name))
    torch.nn.init.normal_(router.weight, std=0.02)
    if hasattr(router, "bias"):
        torch.nn.init.normal_(router.bias, std=0.02)
    return router


def _route(router: Router, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    weights, index = router(x)[:2]
    (weights.float() * torch.arange(1, weights.shape[1] + 1)).sum().backward()
    return weights.detach(), index, x.grad, router.weight.grad.clone()


@pytest.mark.parametrize("name", PRESETS)
def test_replaying_its_own_record_changes_nothing(name):
    """Same input, own record: no swap, and weights and gradients bit-equal to an untaped run."""
    router = _router(name)
    x = torch.randn(64, router.weight.shape[1])
    plain = _route(router, x)
    router.weight.grad = None
    tape = RoutingTape()
    assert attach_routing_tape(router, tape) == 1
    recorded = _route(router, x)
    router.weight.grad = None
    replay = tape.replay()
    attach_routing_tape(router, replay)
    replayed = _route(router, x)
    for a, b, c in zip(plain, recorded, replayed):
        assert torch.equal(a, b) and torch.equal(a, c)
    result = replay.result()
    assert result.choices == x.shape[0] * router.top_k
    assert result.swaps == [] and result.unreplayed == {} and result.problems() == []


@pytest.mark.parametrize("name", PRESETS)
def test_bfloat16_rounding_swaps_only_near_ties(name):
    """Record in float32, replay the bfloat16-rounded input: the replay serves the float32
    choices; the scores agree within bf16's bound and each choice the bf16 router would
    have made differently is a near-tie that the score difference explains."""
    router = _router(name)
    x = torch.randn(2048, router.weight.shape[1])
    tape = RoutingTape()
    attach_routing_tape(router, tape)
    router(x)
    replay = tape.replay()
    attach_routing_tape(router.to(torch.bfloat16), replay)
    _, index = router(x.to(torch.bfloat16))[:2]
    assert torch.equal(index, torch.from_numpy(tape.calls[""][0].index).long())
    result = replay.result()
    assert result.drift_limit == 1e-2
    assert 0 < result.worst_drift[0] <= 1e-2
    assert result.swaps, "2,048 random tokens in bfloat16: some near-tie swaps expected"
    assert all(0 <= s.gap <= s.drift for s in result.swaps)
    result.check()


def test_a_misaligned_replay_fails_on_the_scores():
    """Replaying another batch's choices: the scores are far apart and `check` says where."""
    router = _router("tiny-qwen3-moe")
    hidden = router.weight.shape[1]
    tape = RoutingTape()
    attach_routing_tape(router, tape)
    router(torch.randn(256, hidden))
    replay = tape.replay()
    attach_routing_tape(router, replay)
    router(torch.randn(256, hidden))  # other tokens
    result = replay.result()
    assert len(result.swaps) > 200
    with pytest.raises(AssertionError, match=r"router scores differ .* at router , call 0"):
        result.check()


def test_a_selection_the_scores_do_not_explain_fails():
    """Same scores, but the candidate's own choice is not its top-k (a selection bug): no
    score difference explains the swaps."""
    scores = torch.rand(64, 8).softmax(dim=-1)
    top = torch.topk(scores, 2, dim=-1)[1]
    tape = RoutingTape()
    tape.route("gate", scores, top, torch.float32)
    replay = tape.replay()
    bottom = torch.topk(-scores, 2, dim=-1)[1]  # the candidate's wrong "top-k"
    used = replay.route("gate", scores, bottom, torch.float32)
    assert torch.equal(used, top)  # the record is served all the same
    result = replay.result()
    assert result.worst_drift[0] == 0 and len(result.swaps) == 64
    with pytest.raises(AssertionError, match="more than the scores' difference explains"):
        result.check()


def test_call_count_and_shape_mismatches_raise():
    router = _router("tiny-deepseek-v2")
    hidden = router.weight.shape[1]
    tape = RoutingTape()
    attach_routing_tape(router, tape)
    router(torch.randn(8, hidden))
    router(torch.randn(8, hidden))
    replay = tape.replay()
    attach_routing_tape(router, replay)
    with pytest.raises(RuntimeError, match=r"call 0 routes \(4, 2\), the record \(8, 2\)"):
        router(torch.randn(4, hidden))
    router(torch.randn(8, hidden))
    assert replay.result().unreplayed == {"": 1}
    assert "never replayed" in replay.result().problems()[0]
    router(torch.randn(8, hidden))
    with pytest.raises(RuntimeError, match="called 3 times, the record has 2"):
        router(torch.randn(8, hidden))
    with pytest.raises(ValueError, match="mode='play'"):
        RoutingTape(mode="play")
    with pytest.raises(ValueError, match="only a recording tape"):
        replay.replay()


def test_keys_are_the_models_own_names_and_detach():
    from models.network import build_model

    model = build_model(preset("tiny-qwen3-moe"))
    tape = RoutingTape()
    assert attach_routing_tape(model, tape) == 4
    keys = [m.tape_key for m in model.modules() if isinstance(m, Router)]
    assert keys == [f"model.layers.{i}.mlp.gate" for i in range(4)]
    assert attach_routing_tape(model, None) == 4
    assert all(m.tape is None for m in model.modules() if isinstance(m, Router))


def test_the_record_is_invisible_to_the_memory_tracker():
    """The baseline's peak must not grow by the tape: the record lives in numpy."""
    from harness.memory import MemoryTracker

    router = _router("tiny-qwen3-moe")
    x = torch.randn(512, router.weight.shape[1])

    def peak(tape):
        attach_routing_tape(router, tape)
        tracker = MemoryTracker("cpu")
        tracker.register(parameters=router)
        with tracker.step():
            kept = router(x)  # noqa: F841 (alive at the step's end)
        return tracker.peak_bytes

    assert peak(RoutingTape()) == peak(None)
