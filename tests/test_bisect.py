"""First-divergence bisection names the op that a planted bug broke, on `compute_device`
(bisect builds the models where the input ids are)."""

import pytest
import torch

from harness.compare.bisect import bisect, stack_ops
from models.network import build_model, preset, shift_labels
from optimized.ops import OptimizedOps


class WrongActivation(OptimizedOps):
    """A copy of the optimized stack whose SiLU-and-multiply is off by 0.1%."""

    def silu_and_mul(self, x):
        return super().silu_and_mul(x) * 1.001


class WrongCombine(OptimizedOps):
    """A copy of the optimized stack that adds expert outputs into the wrong tokens."""

    def scatter_add_rows(self, src, index, num_rows):
        return super().scatter_add_rows(src, index.flip(0), num_rows)


class WrongBackward(OptimizedOps):
    """Right forward, wrong gradient: the gather's backward is scaled."""

    def gather_rows(self, x, index):
        out = super().gather_rows(x, index)
        return out + (out * 1e-3 - (out * 1e-3).detach())


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as the ranks run: the tiny model's ops gain nothing from a
    second thread per pytest process (two workers on two cores) but OpenMP's waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def setup(compute_device):
    cfg = preset("tiny-deepseek-v2")
    state = build_model(cfg, seed=4).state_dict()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ids = ids.to(compute_device)
    return cfg, state, ids, shift_labels(ids)


@pytest.mark.slow
def test_agreeing_stacks_have_no_divergence(setup):
    cfg, state, ids, labels = setup
    assert bisect(cfg, state, stack_ops("reference"), stack_ops("optimized"), ids, labels) is None


@pytest.mark.parametrize(
    "ops,stage,direction",
    [
        (WrongActivation, "experts", "forward"),
        (WrongCombine, "aggregate", "forward"),
        (WrongBackward, "attention", "backward"),
    ],
)
def test_planted_bug_is_named(setup, ops, stage, direction):
    cfg, state, ids, labels = setup
    found = bisect(cfg, state, stack_ops("reference"), ops(), ids, labels)
    assert found is not None
    # layer 0 is dense in tiny DeepSeek-V2, so routed-expert bugs show first in layer 1
    assert (found.layer, found.stage, found.direction) == ("layer 1", stage, direction), found
    assert found.rel_error > found.tolerance
    assert "layer 1" in found.describe()


@pytest.mark.slow
def test_the_optimized_loss_stage_is_the_stacks_own_and_agrees(setup):
    """Bisected with each stack's own loss stage (the optimized stack's fused output layer
    and cross-entropy), correct stacks agree; a bug planted in that loss is found there."""
    import optimized.pipeline.dualpipev as dualpipev
    from harness.compare.bisect import stack_loss
    from harness.compare.planted import planted

    cfg, state, ids, labels = setup
    losses = (stack_loss("reference"), stack_loss("optimized"))
    args = (cfg, state, stack_ops("reference"), stack_ops("optimized"), ids, labels)
    assert bisect(*args, losses=losses) is None
    loss_op = dualpipev.linear_cross_entropy  # what the plant replaces
    with planted("cross-entropy-grad-1.01"):
        assert dualpipev.linear_cross_entropy is not loss_op
        found = bisect(*args, losses=losses)
    assert found is not None
    assert (found.layer, found.stage, found.direction) == ("loss", "loss", "backward"), found
    # The plant is gone with its block (a third bisection said so at the cost of a fourth).
    assert dualpipev.linear_cross_entropy is loss_op
