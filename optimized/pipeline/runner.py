"""The optimized stack's training step on one rank: overlapped DualPipeV + EP + DP, AdamW.

Same interface as the reference's runner (`reference.pipeline.ReferencePipeline`)
so the harness drives both the same way; nothing here imports the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.network import ModelConfig, WeightSource, build_part
from models.runtime import Layout, OptimizerConfig, ParallelConfig, PipelineRunner, rank_chunks
from optimized.estimator.config import EstimateConfig
from optimized.ops import OptimizedOps, watch_launches
from optimized.ops.precompile import precompile
from optimized.ops.tuning import TuningCache, pretune
from optimized.pipeline.dualpipev import OptimizedDualPipeV, SummedLinearCrossEntropy
from optimized.pipeline.partition import choose_partition


def default_partition(model: ModelConfig, parallel: ParallelConfig) -> list[list[int]]:
    """The layer ranges the memory estimator predicts lowest peak for (`choose_partition`)."""
    estimate = EstimateConfig(
        model=model, pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
        micro_batch_size=parallel.micro_batch_size, seq_len=parallel.seq_len,
        num_microbatches=parallel.micro_batches, dtype=parallel.dtype, stack="optimized",
        recompute=parallel.recompute,
    )  # fmt: skip
    return [list(stage) for stage in choose_partition(estimate)]


class OptimizedPipeline(PipelineRunner):
    """This rank's part of the model, its optimized DualPipeV schedule and its optimizer."""

    name = "optimized"

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelConfig,
        layout: Layout,
        source: WeightSource,
        optimizer: OptimizerConfig,
        stages: list[list[int]] | None = None,
        device: torch.device | str = "cpu",
        shard: Callable[[torch.nn.Module], object] | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
    ) -> None:
        """``source``: where this rank reads its weights (`models.network.weights`); ``shard``:
        applied to the meta-device part before it is materialised (FSDP2).
        ``label_smoothing`` and ``z_loss`` (the z-loss weight) change the objective; they
        are the trainer's options, which the reference stack does not have."""
        self.model_config, self.parallel, self.layout = model, parallel, layout
        self.stages = stages or default_partition(model, parallel)
        chunks = rank_chunks(self.stages, layout.pp_rank)
        first_rank = layout.pp_rank == 0
        # The part's own ops serve the embedding and the loss; the layers get each
        # step's ops, wired to that step's weight-gradient store.
        self.part = build_part(
            model, source, chunks[0] + chunks[1], embedding=first_rank, head=first_rank,
            ops=OptimizedOps(recompute_attention=parallel.recompute),
            ep=layout.expert_parallel, dtype=parallel.torch_dtype, device=device, shard=shard,
        )  # fmt: skip
        self.schedule = OptimizedDualPipeV(
            self.part,
            chunks,
            layout,
            SummedLinearCrossEntropy(label_smoothing, z_loss),
            recompute_attention=parallel.recompute,
        )
        self.optimizer = optimizer.build(self.part.parameters())

    def prepare(self, cache: TuningCache | None = None) -> dict:
        """Before the first step: every attention key of this rank's layers tuned and
        compiled on dummy tensors of the run's shapes, the choices loaded from and saved to
        ``cache`` when given (`optimized.ops.tuning.pretune`), then every other Triton kernel
        of the step launched once on them (`optimized.ops.precompile`); what it did."""
        parallel = self.parallel
        watch_launches()  # the step's kernels keyed until step 1 is reported
        done = pretune(self.part, parallel.micro_batch_size, parallel.seq_len, cache)
        compiled = precompile(self.part, parallel.micro_batch_size, parallel.seq_len,
                              self.schedule.loss_fn)  # fmt: skip
        return {**done, "compiled_keys": compiled["keys"],
                "compile_seconds": compiled["seconds"]}  # fmt: skip
