"""A training step of a real-width MoE model with the routing controls on, against the same
step with them off: what expert balancing costs (issue 37's target: within 5%).

``on``: the pooled load-balancing loss (its counts carried through the schedule), the
router z-loss and the expert bias (the load reduced over DP, the update on the device),
and the expert load every step of ``twinpipe train`` shows (`optimized.train.ExpertLoad`:
gathered, then read with the loss in the step's one read). ``off``: the same step as it
ran before any of them: no control, no load gathered, the loss read alone. Both time the
runner's forward and backward of one global batch, then the trainer's read and the bias
update; AdamW's update, the same in both, is left out (it would only dilute the ratio).

``mid-qwen3-moe`` (hidden 2048, 16 experts, top-8: every width of Qwen3-30B-A3B, 4 layers)
in float32 at PP = DP = 1, one process: on CUDA the optimized stack (what the trainer runs)
at 4096 tokens a micro-batch; on the CPU the reference stack (the optimized one's Triton
kernels would run in the interpreter, and time it) at 32.
"""

from __future__ import annotations

import tempfile

import pytest
import torch.distributed as dist

from benchmarks._common import DEVICE, ON_CUDA, pick, synchronize
from models.network import SeededWeights, preset
from models.runtime import OptimizerConfig, ParallelConfig, make_layout, synthetic_batch
from optimized.train import ExpertLoad, LoggedScalars

MODEL = "mid-qwen3-moe"
SEQ_LEN = pick(gpu=4096, cpu=32)
MICRO_BATCHES = 2
ROUNDS, WARMUP = (10, 2) if ON_CUDA else (5, 1)
CONTROLS = {
    "off": {},
    "on": dict(aux_loss="pooled", aux_loss_coef=0.001, router_z_loss_coef=0.001,
               expert_bias=True),
}  # fmt: skip


@pytest.fixture(scope="module")
def process_group():
    """One rank's gloo group: the runners reduce over DP = 1 and PP = 1 (nothing moves)."""
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0,
                                world_size=1)  # fmt: skip
        yield
        dist.destroy_process_group()


def _runner(controls: dict):
    if ON_CUDA:
        from optimized.pipeline import OptimizedPipeline as Runner  # noqa: PLC0415
    else:
        from reference.pipeline import ReferencePipeline as Runner  # noqa: PLC0415
    config = preset(MODEL, **controls)
    parallel = ParallelConfig(micro_batch_size=1, micro_batches=MICRO_BATCHES, seq_len=SEQ_LEN)
    layout = make_layout(parallel)
    runner = Runner(config, parallel, layout, SeededWeights(config, 0), OptimizerConfig(),
                    device=DEVICE)  # fmt: skip
    return runner, parallel, layout


@pytest.mark.parametrize("balancing", list(CONTROLS))
def test_train_step(benchmark, process_group, balancing):
    runner, parallel, layout = _runner(CONTROLS[balancing])
    load = ExpertLoad.of(runner, layout) if balancing == "on" else None
    scalars = LoggedScalars()
    ids, labels = (t.to(DEVICE) for t in synthetic_batch(runner.part.config, parallel, 0))

    def step() -> None:
        loss = runner.forward_backward_on_device(ids, labels)
        gathered = load.gather(runner.balance) if load is not None else None
        scalars.read(loss, gathered)
        runner.update_expert_biases()
        synchronize()

    benchmark.group = "train_step"
    benchmark.extra_info.update(
        op="train_step", implementation=balancing, model=MODEL, seq_len=SEQ_LEN,
        micro_batches=MICRO_BATCHES, device=str(DEVICE), stack=type(runner).__name__,
        dtype="float32",
    )  # fmt: skip
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    if balancing == "on":
        routers = [r.e_score_correction_bias for r in runner.part.modules()
                   if getattr(r, "e_score_correction_bias", None) is not None]  # fmt: skip
        assert routers and all(bias.abs().max() > 0 for bias in routers)  # the bias moved
