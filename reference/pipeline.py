"""The reference stack's training step on one rank: DualPipeV + EP + DP, plain ops, AdamW."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.network import ModelConfig, WeightSource, build_part
from models.runtime import (
    Layout,
    OptimizerConfig,
    ParallelConfig,
    PipelineRunner,
    even_partition,
    rank_chunks,
)
from reference.dualpipev import ReferenceDualPipeV
from reference.ops import ReferenceOps


class ReferencePipeline(PipelineRunner):
    """This rank's part of the model, its DualPipeV schedule and its optimizer."""

    name = "reference"

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
    ) -> None:
        """``source``: where this rank reads its weights (`models.network.weights`); ``shard``:
        applied to the meta-device part before it is materialised (FSDP2)."""
        self.model_config, self.parallel, self.layout = model, parallel, layout
        self.ops = ReferenceOps()
        self.stages = stages or even_partition(model.num_hidden_layers, 2 * parallel.pp)
        chunks = rank_chunks(self.stages, layout.pp_rank)
        first_rank = layout.pp_rank == 0
        self.part = build_part(
            model, source, chunks[0] + chunks[1], embedding=first_rank, head=first_rank,
            ops=self.ops, ep=layout.expert_parallel, dtype=parallel.torch_dtype, device=device,
            shard=shard,
        )  # fmt: skip
        self.schedule = ReferenceDualPipeV(self.part, chunks, layout, self.ops)
        self.optimizer = optimizer.build(self.part.parameters())
