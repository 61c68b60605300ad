"""Reading prepared tokens for training: a memory-mapped window dataset, a resumable
sampler that shards each global batch over the DP ranks, and the copy of each step's batch
to the rank's device through buffers allocated once (`BatchToDevice`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from optimized.data.preparation import open_prepared


class TokenDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a prepared folder.

    ``dataset[i]`` is an int64 tensor of ``seq_len + 1`` tokens: inputs are
    ``[:-1]``, labels ``[1:]``. The token file is memory-mapped, never read whole.
    """

    def __init__(self, data_dir: str | os.PathLike, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len = {seq_len} is invalid: must be >= 1")
        self.data_dir = Path(data_dir)
        self.index, self.reader = open_prepared(self.data_dir)
        self.seq_len = seq_len
        self.num_tokens = int(self.index["num_tokens"])
        self.vocab_size: int | None = self.index["vocab_size"]  # None: a bare Megatron pair
        self.eod_id: int | None = self.index["eod_id"]
        self.tokens = self.reader.tokens
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)
        if self.num_samples == 0:
            raise ValueError(
                f"{str(self.data_dir)!r} holds {self.num_tokens} tokens, too few for one "
                f"sample of seq_len + 1 = {seq_len + 1}"
            )

    @property
    def document_offsets(self) -> np.ndarray:
        """Start of each document, and the total token count at the end."""
        return np.concatenate([[0], np.cumsum(self.reader.sequence_lengths, dtype=np.int64)])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        i %= self.num_samples
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def gather(self, sample_ids: np.ndarray) -> torch.Tensor:
        """Windows of ``sample_ids`` (any shape ``S``) as an int64 tensor ``S + [seq_len+1]``."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        starts = ids.reshape(-1, 1) * self.seq_len + np.arange(self.seq_len + 1)
        windows = self.tokens[starts].astype(np.int64)
        return torch.from_numpy(windows.reshape(*ids.shape, self.seq_len + 1))


class ShardedSampler:
    """Which samples each DP rank reads at each step, resumable to the exact sample.

    Every epoch is a permutation of ``range(num_samples)`` drawn from ``(seed, epoch)``
    (identity when ``shuffle`` is false). Steps take consecutive global batches of
    ``dp_size * samples_per_rank`` from it; DP rank ``r`` gets the ``r``-th slice of
    each. Ranks are therefore disjoint and together cover the epoch; the tail shorter
    than a global batch is skipped (a different tail each epoch, when shuffled).

    The position is ``(epoch, offset)`` into the epoch's permutation and does not
    depend on ``dp_size``: a restart with another DP layout but the same global batch
    reads the same global batches.
    """

    def __init__(
        self,
        num_samples: int,
        samples_per_rank: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} is invalid for dp_size = {dp_size}")
        if samples_per_rank < 1:
            raise ValueError(f"samples_per_rank = {samples_per_rank} is invalid: must be >= 1")
        global_batch = samples_per_rank * dp_size
        if num_samples < global_batch:
            raise ValueError(
                f"num_samples = {num_samples} is fewer than one global batch of "
                f"{global_batch} (= {dp_size} DP ranks x {samples_per_rank}); "
                "use more data, a shorter seq_len or smaller batches"
            )
        self.num_samples, self.samples_per_rank = num_samples, samples_per_rank
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch = global_batch
        self.epoch, self.offset = 0, 0
        self._order_epoch: int | None = None
        self._order = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All sample ids of ``epoch``, in the order steps read them."""
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._order = rng.permutation(self.num_samples).astype(np.int64)
            else:
                self._order = np.arange(self.num_samples, dtype=np.int64)
            self._order_epoch = epoch
        return self._order

    def shard(self, epoch: int) -> np.ndarray:
        """Every sample id this rank reads in ``epoch``, in reading order."""
        used = self.epoch_order(epoch)[: self.steps_per_epoch * self.global_batch]
        return used.reshape(-1, self.dp_size, self.samples_per_rank)[:, self.dp_rank].reshape(-1)

    def next_ids(self) -> np.ndarray:
        """This rank's sample ids for the next step; advances the position."""
        if self.offset + self.global_batch > self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0
        start = self.offset + self.dp_rank * self.samples_per_rank
        ids = self.epoch_order(self.epoch)[start : start + self.samples_per_rank].copy()
        self.offset += self.global_batch
        return ids

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key} = {state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data, seq_len and seed"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.num_samples:
            raise ValueError(f"sampler state epoch = {epoch}, offset = {offset} is invalid")
        self.epoch, self.offset = epoch, offset


class Batch(NamedTuple):
    """One step's data for one DP rank: ``M`` micro-batches of ``micro_batch_size``."""

    inputs: torch.Tensor
    """int64 ``[M, micro_batch_size, seq_len]``."""
    labels: torch.Tensor
    """int64 ``[M, micro_batch_size, seq_len]``: ``inputs`` shifted left by one token."""
    sample_ids: torch.Tensor
    """int64 ``[M, micro_batch_size]``: which windows of the dataset these are."""
    epoch: int
    """Epoch the samples were drawn from."""


class TokenLoader:
    """Endless iterator of `Batch`es for one DP rank, with ``state_dict`` for restarts."""

    def __init__(
        self,
        dataset: TokenDataset,
        micro_batches: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        sizes = {"micro_batches": micro_batches, "micro_batch_size": micro_batch_size}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} = {value} is invalid: must be >= 1")
        self.dataset = dataset
        self.micro_batches, self.micro_batch_size = micro_batches, micro_batch_size
        self.sampler = ShardedSampler(
            len(dataset), micro_batches * micro_batch_size, dp_rank, dp_size, seed, shuffle
        )

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        ids = self.sampler.next_ids().reshape(self.micro_batches, self.micro_batch_size)
        epoch = self.sampler.epoch
        windows = self.dataset.gather(ids)
        return Batch(windows[..., :-1], windows[..., 1:], torch.from_numpy(ids), epoch)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "seq_len": self.dataset.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.dataset.seq_len:
            raise ValueError(
                f"loader state has seq_len = {state['seq_len']} but this loader has "
                f"{self.dataset.seq_len}"
            )
        self.sampler.load_state_dict(state["sampler"])


class BatchToDevice:
    """Each step's batch on the rank's device, through buffers allocated at the first step
    and reused.

    On a GPU a copy from pageable memory stages through a pinned buffer the runtime
    allocates (or blocks the host); here the tokens go once into pinned host buffers of the
    batch's shape, then to device buffers with ``non_blocking``: the host queues the copy
    and goes on. Before the pinned buffers are written again, the host waits for the
    previous step's copy to have left them (long done by then: a step reads its logged
    scalars once). The device buffers are reused in stream order: a copy is queued after
    the previous step's kernels that read them. On the CPU the batch is used as it is.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._host: list[torch.Tensor] = []
        self._device: list[torch.Tensor] = []
        self._copied = None

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` on the device (the device buffers: valid until the next
        call)."""
        tensors = (batch.inputs, batch.labels)
        if self.device.type == "cpu":
            return tensors
        if [t.shape for t in self._host] != [t.shape for t in tensors]:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            self._device = [
                torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in tensors
            ]
            self._copied = torch.cuda.Event()
        else:
            self._copied.synchronize()  # the previous copy has left the pinned buffers
        for source, host, device in zip(tensors, self._host, self._device, strict=True):
            host.copy_(source)
            device.copy_(host, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))
        return self._device[0], self._device[1]
