"""The loss's normalisation across micro-batches, DP ranks and ignored tokens, against one
process computing the whole batch in float64.

The step's loss is the mean over every labelled token of the global batch, and the
gradients are that mean's (`models.runtime.training`). Each micro-batch's summed loss is divided
by the global count, DP ranks sum their gradients, and pipeline rank 0 holds the loss.
A rank that divided by its own count, a micro-batch that took its own mean, or a count
that included ignored tokens would all give the same loss on a batch where every
micro-batch has as many labelled tokens as the others, which is what the synthetic
batches and the trainer's data give (only the last position of a synthetic row is
ignored; the trainer's labels have none). So here the ignored tokens are uneven: one
micro-batch has none, one has most of its tokens ignored, one sequence is ignored
whole, and DP rank 0 holds far fewer labelled tokens than rank 1.

Each stack the trainer or the harness runs is checked, in one launched world of two
ranks: the reference runner at PP=1 DP=2 and at PP=2 DP=1, the optimized runner at PP=2
DP=1, and at DP=2 the optimized stack sharded with FSDP2 and `ShardedAdamW` as
`twinpipe train` runs it at DP > 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.network import IGNORE_INDEX, SeededWeights, build_model, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch, make_layout
from optimized.pipeline import OptimizedPipeline, sharding
from optimized.train.optimizer import ShardedAdamW
from reference.ops import ReferenceOps
from reference.pipeline import ReferencePipeline

MODEL = "tiny-qwen3-moe"
SEED = 5
LAYOUTS = {
    "pp1-dp2": ParallelConfig(pp=1, dp=2, ep=1, micro_batch_size=2, micro_batches=2,
                              seq_len=8, seed=SEED),
    "pp2-dp1": ParallelConfig(pp=2, dp=1, ep=1, micro_batch_size=2, micro_batches=4,
                              seq_len=8, seed=SEED),
}  # fmt: skip


def uneven_batch(parallel: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``[8, 8]`` ids and labels (the global batch, rows in DP then micro-batch order) with
    0 to 8 ignored labels per row: rows 0-1 (DP rank 0's or PP's first micro-batch) keep
    only 2 of 8, row 2 is ignored whole, rows 4-7 (DP rank 1's) keep every label."""
    model = preset(MODEL)
    generator = torch.Generator().manual_seed(11)
    shape = (parallel.global_batch, parallel.seq_len)
    ids = torch.randint(0, model.vocab_size, shape, generator=generator)
    labels = torch.randint(0, model.vocab_size, shape, generator=generator)
    labels[0:2, 2:] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX
    labels[3, ::3] = IGNORE_INDEX
    return ids, labels


def whole_batch_truth(parallel: ParallelConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """The mean loss over the labelled tokens and its gradients, one process, float64."""
    ids, labels = uneven_batch(parallel)
    model = build_model(preset(MODEL), ReferenceOps(), seed=SEED).double()
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)  # fmt: skip
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def _runs(layout, parallel):
    """Each runner's ``(name, loss, whole gradients by name)`` on this rank."""
    model = preset(MODEL)
    ids, labels = uneven_batch(parallel)
    source = SeededWeights(model, seed=SEED)
    runners = [ReferencePipeline(model, parallel, layout, source, OptimizerConfig())]
    if parallel.dp == 1:
        runners.append(OptimizedPipeline(model, parallel, layout, source, OptimizerConfig()))
    for runner in runners:
        loss = runner.forward_backward(ids, labels)
        yield runner.name, loss, {n: p.grad for n, p in runner.part.named_parameters()}
    if parallel.dp > 1:  # as `twinpipe train` at DP > 1: FSDP2 and the sharded AdamW
        names: set[str] = set()
        runner = OptimizedPipeline(
            model, parallel, layout, source, OptimizerConfig(),
            shard=lambda part: names.update(sharding.apply_fsdp(part, layout,
                                                                torch.device("cpu"))),
        )  # fmt: skip
        optimizer = ShardedAdamW(runner.part, layout, 1e-3, (0.9, 0.95), 1e-8, 0.0, True, names)
        runner.optimizer = optimizer
        loss = sharding.forward_backward(runner, optimizer, names, ids, labels)
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in runner.part.named_parameters()}  # fmt: skip
        yield "optimized-fsdp", loss, grads


def _worker() -> list[tuple[str, float, dict[str, float]]]:
    out = []
    for name, parallel in LAYOUTS.items():
        layout = make_layout(parallel)
        truth_loss, truth = whole_batch_truth(parallel)
        for runner, loss, grads in _runs(layout, parallel):
            errors = {
                n: float((g.double() - truth[n]).norm() / truth[n].norm().clamp(min=1e-30))
                for n, g in grads.items()
            }
            out.append((f"{name} {runner}", abs(loss - truth_loss) / truth_loss, errors))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_loss_is_the_mean_over_the_global_batch_s_labelled_tokens():
    for rank, runs in enumerate(launch(_worker, 2)):
        assert [r[0] for r in runs] == ["pp1-dp2 reference", "pp1-dp2 optimized-fsdp",
                                        "pp2-dp1 reference", "pp2-dp1 optimized"]  # fmt: skip
        for runner, loss_error, errors in runs:
            where = f"rank {rank}, {runner}"
            assert loss_error <= 1e-6, (where, loss_error)
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, (where, worst, errors[worst])
