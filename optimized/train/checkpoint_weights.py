"""A training checkpoint as a weight source (`models.network.weights`): what a resumed or
``init_from`` run builds its part from.

A rank reads only its rows of each ``model.<name>`` of the DCP checkpoint
(`optimized.train.checkpointing`), straight into its parameter, from the chunks that overlap
them, whatever layout saved it. Training-state buffers (the routers' expert biases) are
read where the checkpoint has them (`TrainingCheckpointWeights.holds`); one made before the
run turned the bias on has none, and the bias starts at zero.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

from optimized.train import chunks

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata


class TrainingCheckpointWeights:
    """A training checkpoint's parameters and buffers as a weight source: see the module
    docstring. Picklable; no process group needed."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = str(folder)
        self._reader: chunks.CachedReader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.folder, self._reader = state["folder"], None

    def __repr__(self) -> str:
        return f"TrainingCheckpointWeights({self.folder!r})"

    def _shapes(self) -> dict[str, TensorStorageMetadata]:
        if self._reader is None:
            self._reader = chunks.CachedReader(self.folder)
        return chunks.tensor_metadata(self._reader.read_metadata())

    def holds(self, name: str) -> bool:
        """Whether the checkpoint has the training-state buffer ``name`` (an expert bias)."""
        return f"model.{name}" in self._shapes()

    def fill(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        shapes = self._shapes()
        key = f"model.{name}"
        if key not in shapes and name == "lm_head.weight":  # tied: the embedding
            key = "model.embed_tokens.weight"
        if key not in shapes:
            raise ValueError(f"checkpoint {self.folder} has no tensor {key}")
        global_shape = tuple(shapes[key].size)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            chunks.load({key: chunks.rows(out, start, global_shape)}, reader=self._reader,
                        collective=False)  # fmt: skip
