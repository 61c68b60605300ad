"""`models.runtime.OptimizerConfig`, the AdamW every stack of a comparison builds: the
stacks share it, so a comparison of two stacks cannot see a mistake in it. Checked here
against AdamW's update written out by hand."""

from __future__ import annotations

import torch

from models.runtime import OptimizerConfig


def test_two_steps_equal_adamw_by_hand():
    config = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(64, generator=gen, dtype=torch.float64)
    grads = [torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(2)]
    param = torch.nn.Parameter(start.clone())
    optimizer = config.build([param])
    expected, m, v = start.clone(), torch.zeros(64, dtype=torch.float64), 0.0
    b1, b2 = config.betas
    for step, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        optimizer.step()
        expected = expected * (1 - config.lr * config.weight_decay)  # decoupled decay
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
        expected = expected - config.lr * m_hat / (v_hat.sqrt() + config.eps)
        torch.testing.assert_close(param.detach(), expected, rtol=1e-12, atol=1e-14)


def test_defaults_are_the_trainer_s_adamw():
    """`twinpipe compare` builds ``OptimizerConfig(lr=...)``: its other settings are these
    defaults, which must be the trainer's AdamW (`optimized.train.config.OptimSection`).
    Every comparison shares them, so no stack-against-stack test sees a change."""
    from optimized.train.config import OptimSection

    config, trainer = OptimizerConfig(), OptimSection()
    assert config.betas == trainer.betas == (0.9, 0.95)
    assert config.weight_decay == trainer.weight_decay == 0.1
    assert config.eps == 1e-8  # the trainer passes eps=1e-8 (optimized.train.trainer)
