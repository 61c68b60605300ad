"""The oracle: the whole model on one process, the whole global batch at once, AdamW."""

from __future__ import annotations

import torch

from models.network import ModelConfig, WeightSource, build_part
from models.runtime import OptimizerConfig
from reference.ops import ReferenceOps


class Oracle:
    """Single-process training step that every pipeline is held against."""

    name = "oracle"

    def __init__(
        self,
        model: ModelConfig,
        source: WeightSource,
        optimizer: OptimizerConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = build_part(model, source, ops=ReferenceOps(), dtype=dtype, device=device)
        self.part = self.model
        self.optimizer = optimizer.build(self.model.parameters())

    def forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model.loss(ids, labels)
        loss.backward()
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return float(loss.detach())

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = self.forward_backward(ids, labels)
        self.optimizer_step()
        return loss

    @torch.no_grad()
    def evaluate(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        return float(self.model.loss(ids, labels))
