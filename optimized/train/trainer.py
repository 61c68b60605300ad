"""The training loop of `twinpipe train`: data, steps, metrics, checkpoints, faults.

One function, `train`, runs on every rank of an initialised process group. Each step:

1. this DP rank reads its own shard of the step's samples (`TokenLoader`), and the DP
   group all-gathers them into the global batch the pipeline runner slices (the ids are
   tiny next to activations, and the loss stays the mean over the global batch);
2. the runner (`runner_class`, the optimized stack's `OptimizedPipeline`) runs the
   DualPipeV forward/backward and reduces gradients. With sharding on (``parallel.fsdp``,
   default when DP > 1) the leaf modules are `fully_shard`-ed (`optimized.pipeline.sharding`),
   routed experts over their expert replicas: FSDP2 gathers their parameters and
   reduce-scatters their gradients (the zero-bubble W steps' included), and only the
   rest (experts where EP = DP, a tied output layer) is all-reduced;
3. `ShardedAdamW` takes float32 gradient slices, the global norm is checked (a NaN or
   inf stops the run naming the step and ranks, or skips the step), clipped, stepped;
4. rank 0 logs one line, a JSON record, TensorBoard scalars; checkpoints are saved every
   ``save_every`` steps, at the end, and when SIGTERM arrives.

Fault injection for tests: ``TWINPIPE_FAULT=KIND@STEP:RANK`` with KIND one of
``nan-grad`` (fill this rank's gradients with NaN), ``crash`` (raise) or ``sigterm``
(signal this process) at 0-based step STEP on global rank RANK.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import resource
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from models.checkpoint import CheckpointWeights, validate_checkpoint
from models.config import ModelConfig
from models.distributed import Layout, ParallelConfig, make_layout
from models.presets import resolve_model
from models.progress import ProgressLine
from models.training import OptimizerConfig
from models.weights import Reporting, SeededWeights, WeightSource
from optimized.pipeline import sharding
from optimized.train import checkpointing
from optimized.train.config import TrainConfig, lr_at
from optimized.train.config_io import config_to_toml
from optimized.train.loader import TokenDataset, TokenLoader
from optimized.train.optimizer import ShardedAdamW
from optimized.train.phases import PhasePeaks, format_peaks
from optimized.train.preparation import default_dataset

DEFAULT_MODEL = "tiny-deepseek-v2"
"""The model of a run that names none and starts from no checkpoint."""

RUNNER = "optimized.pipeline:OptimizedPipeline"
"""The one seam between the trainer and the stack it drives (``module:Class``)."""


def runner_class() -> type:
    """The pipeline runner class (``TWINPIPE_RUNNER=module:Class`` overrides `RUNNER`)."""
    module, _, name = os.environ.get("TWINPIPE_RUNNER", RUNNER).partition(":")
    return getattr(importlib.import_module(module), name)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step was NaN or infinite."""


# ------------------------------------------------------------------ metrics
@dataclass(slots=True)
class StepMetrics:
    step: int
    """1-based step number."""
    steps: int
    step_time_s: float
    """Slowest rank's wall time for the step."""
    loss: float
    learning_rate: float
    gradient_norm: float
    tokens_per_second: float
    peak_memory_bytes: int
    """Max over ranks: CUDA max_memory_allocated on GPU, the process's max RSS on CPU."""
    peak_memory_source: str
    skipped: bool = False

    def line(self) -> str:
        text = (
            f"step {self.step:08d}/{self.steps:08d} | step-time {self.step_time_s:.3f} sec | "
            f"cross-entropy-loss {self.loss:.4f} | learning-rate {self.learning_rate:.6e} | "
            f"gradient-norm {self.gradient_norm:.4f} | "
            f"tokens-per-second {self.tokens_per_second:,.0f} | "
            f"peak-memory {self.peak_memory_bytes / 1e9:.2f} GB"
        )
        return text + (" | skipped (non-finite)" if self.skipped else "")


def peak_memory(peaks: PhasePeaks | None = None) -> tuple[int, str]:
    """This process's peak memory in bytes and how it was measured (``peaks``: the run's
    phases reset the high-water mark, and keep the lifetime peak)."""
    if torch.cuda.is_available():
        value = peaks.lifetime() if peaks else torch.cuda.max_memory_allocated()
        return value, "cuda-max-memory-allocated"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return max(kib * 1024, peaks.lifetime() if peaks else 0), "max-rss"


class MetricsSink:
    """Rank 0's outputs: stdout lines, JSON lines, TensorBoard, a terminal progress bar."""

    def __init__(self, cfg: TrainConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.every = cfg.logging.log_every
        self.file = None
        self.writer = None
        self.bar = enabled and sys.stderr.isatty()
        if not enabled:
            return
        if cfg.logging.metrics_file:
            Path(cfg.logging.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(cfg.logging.metrics_file, "a")  # noqa: SIM115 - closed in close()
        if cfg.logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
            except ImportError as error:
                warnings.warn(f"TensorBoard is off: {error}", stacklevel=2)
            else:
                self.writer = SummaryWriter(cfg.logging.tensorboard_dir)

    def record(self, m: StepMetrics) -> None:
        if not self.enabled or (m.step % self.every and m.step != m.steps):
            return
        if self.bar:
            sys.stderr.write("\r\033[K")
        print(m.line(), flush=True)
        if self.file:
            self.file.write(json.dumps(asdict(m)) + "\n")
            self.file.flush()
        if self.writer:
            for key in ("loss", "learning_rate", "gradient_norm", "tokens_per_second"):
                self.writer.add_scalar(key, getattr(m, key), m.step)
        if self.bar:
            done = int(30 * m.step / m.steps)
            sys.stderr.write(f"[{'#' * done}{'.' * (30 - done)}] {m.step}/{m.steps}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar:
            sys.stderr.write("\n")
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


# ------------------------------------------------------------------ setup
def parallel_config(cfg: TrainConfig, model: ModelConfig) -> ParallelConfig:
    parallel = ParallelConfig(
        pp=cfg.parallel.pp, dp=cfg.parallel.dp, ep=cfg.parallel.ep,
        micro_batch_size=cfg.data.micro_batch_size, micro_batches=cfg.data.micro_batches,
        seq_len=cfg.data.seq_len, dtype=cfg.dtype, seed=cfg.seed,
    )  # fmt: skip
    parallel.validate(model)
    return parallel


def weight_source(
    cfg: TrainConfig, model: ModelConfig, resume: str | os.PathLike | None = None
) -> WeightSource:
    """Where each rank reads its first weights (only its own slices of them): the checkpoint
    being resumed, else ``init_from`` (a twinpipe checkpoint or an HF folder), else a
    random initialisation from ``seed``."""
    if resume is not None:
        return checkpointing.TrainingCheckpointWeights(resume)
    source = cfg.model.init_from
    if source is None:
        return SeededWeights(model, cfg.seed)
    folder = checkpointing.newest_valid(source, warn=False)
    if folder is not None:
        return checkpointing.TrainingCheckpointWeights(folder)
    return CheckpointWeights(source, model)


def global_batch(inputs: torch.Tensor, labels: torch.Tensor, layout: Layout):
    """The step's global batch from every DP rank's ``[M, mbs, L]`` shard, in DP order."""
    pair = torch.stack([inputs.reshape(-1, inputs.shape[-1]), labels.reshape(-1, labels.shape[-1])])
    if layout.dp > 1:
        pieces = [torch.empty_like(pair) for _ in range(layout.dp)]
        dist.all_gather(pieces, pair.contiguous(), group=layout.dp_group)
        pair = torch.cat(pieces, dim=1)
    return pair[0], pair[1]


def _fault() -> tuple[str, int, int] | None:
    spec = os.environ.get("TWINPIPE_FAULT")
    if not spec:
        return None
    kind, _, where = spec.partition("@")
    step, _, rank = where.partition(":")
    return kind, int(step), int(rank or 0)


class _StopFlag:
    """Set by SIGTERM; the loop saves a checkpoint and stops at the end of the step."""

    def __init__(self) -> None:
        self.requested = False
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler
            pass

    def _handle(self, signum, frame) -> None:
        self.requested = True


# ------------------------------------------------------------------ loop
def train_model(cfg: TrainConfig) -> ModelConfig:
    """The model a run trains: ``model.name``; unset, the ``init_from`` checkpoint's own
    model (its config.json), else `DEFAULT_MODEL`."""
    if cfg.model.name is not None:
        return resolve_model(cfg.model.name)
    if cfg.model.init_from is not None:
        folder = checkpointing.newest_valid(cfg.model.init_from, warn=False)
        return ModelConfig.from_hf(str(folder or cfg.model.init_from))
    return resolve_model(DEFAULT_MODEL)


def check_weights(cfg: TrainConfig) -> ModelConfig:
    """Refuse, before any rank starts, a layout that does not fit the model or a checkpoint
    (``init_from``, or the one ``checkpoint.dir`` would resume) that does not match it:
    ``ValueError`` naming the file, the tensor, and the expected and found shape or dtype."""
    model = train_model(cfg)
    parallel_config(cfg, model)
    if cfg.model.init_from is not None:
        folder = checkpointing.newest_valid(cfg.model.init_from, warn=False)
        if folder is not None:
            checkpointing.validate_training_checkpoint(folder, model)
        else:
            validate_checkpoint(cfg.model.init_from, model)
    if cfg.checkpoint.dir and cfg.checkpoint.resume:
        folder = checkpointing.newest_valid(cfg.checkpoint.dir, warn=False)
        if folder is not None:
            checkpointing.validate_training_checkpoint(folder, model)
    return model


class _Run(NamedTuple):
    runner: Any
    optimizer: ShardedAdamW
    loader: TokenLoader
    sharded: set[str]
    start: int


def _set_up(cfg: TrainConfig, model_config: ModelConfig, parallel, layout, device) -> _Run:
    """Build this rank's part on the meta device, FSDP2 on it (DP > 1), its weights read
    from the checkpoint being resumed, ``init_from`` or the seed (only its own slices),
    the optimizer (its state from the checkpoint) and the data loader."""
    opt = cfg.optim
    resume = _resume_folder(cfg, layout)
    fsdp = cfg.parallel.use_fsdp and layout.dp > 1
    sharded: set[str] = set()

    def shard(part: torch.nn.Module) -> None:  # FSDP2 on the meta part: this rank's rows only
        sharded.update(sharding.apply_fsdp(part, layout, device))

    source = weight_source(cfg, model_config, resume)
    line = ProgressLine(
        f"loading {source!r} (rank 0's part)", enabled=None if layout.rank == 0 else False
    )
    runner = runner_class()(
        model_config, parallel, layout, Reporting(source, line),
        OptimizerConfig(lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay),
        device=device, shard=shard if fsdp else None,
    )  # fmt: skip
    line.close()
    optimizer = ShardedAdamW(
        runner.part, layout, lr=opt.lr, betas=opt.betas, eps=1e-8,
        weight_decay=opt.weight_decay, shard=cfg.parallel.use_fsdp, fsdp=sharded,
    )  # fmt: skip
    runner.optimizer = optimizer  # the runner zeroes gradients through it
    data_dir = cfg.data.path or default_dataset()
    loader = TokenLoader(
        TokenDataset(data_dir, cfg.data.seq_len), cfg.data.micro_batches,
        cfg.data.micro_batch_size, layout.dp_rank, layout.dp, cfg.seed, cfg.data.shuffle,
    )  # fmt: skip
    start = _resume(resume, optimizer, loader, layout)
    return _Run(runner, optimizer, loader, sharded, start)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank (process group already initialised); returns this rank's
    per-step losses (``None`` for skipped steps), where it stopped, and every rank's peak
    memory in each phase (load, train, save; `optimized.train.phases`)."""
    stop = _StopFlag()
    device = _device(cfg)
    model_config = train_model(cfg)
    parallel = parallel_config(cfg, model_config)
    layout = make_layout(parallel)
    torch.manual_seed(cfg.seed)
    opt = cfg.optim
    peaks = PhasePeaks(device)
    with peaks.phase("load"):
        runner, optimizer, loader, sharded, start = _set_up(
            cfg, model_config, parallel, layout, device
        )
    fsdp = bool(sharded)
    sink = MetricsSink(cfg, enabled=layout.rank == 0)
    fault = _fault()
    tokens_per_step = parallel.global_batch * parallel.seq_len
    losses: list[float | None] = []
    result = {"start": start, "stopped_at": cfg.steps, "signal": False}
    try:
        for step in range(start, cfg.steps):
            began = time.perf_counter()
            peaks.begin()
            batch = next(loader)
            ids, labels = global_batch(batch.inputs.to(device), batch.labels.to(device), layout)
            if fault and fault[1] == step and fault[2] == layout.rank:
                _inject(fault[0], runner.part, step, layout)
            if fsdp:
                loss = sharding.forward_backward(runner, optimizer, sharded, ids, labels)
            else:
                loss = runner.forward_backward(ids, labels)
            if fault and fault[0] == "nan-grad" and fault[1] == step and fault[2] == layout.rank:
                for p in runner.part.parameters():
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
            norm = optimizer.prepare_gradients()
            lr = lr_at(step, cfg)
            skipped = not (math.isfinite(loss) and math.isfinite(norm))
            if skipped:
                _nonfinite(cfg, step, loss, norm, optimizer, layout)
            else:
                optimizer.clip(norm, opt.grad_clip)
                optimizer.step(lr)
            peaks.end("train")
            elapsed = time.perf_counter() - began
            memory, source = peak_memory(peaks)
            shared = torch.tensor(
                [elapsed, float(memory), float(stop.requested)], dtype=torch.float64,
                device=device,
            )  # fmt: skip
            dist.all_reduce(shared, op=dist.ReduceOp.MAX)
            losses.append(None if skipped else loss)
            sink.record(
                StepMetrics(
                    step + 1, cfg.steps, float(shared[0]), loss, lr, norm,
                    tokens_per_step / max(float(shared[0]), 1e-9), int(shared[1]), source,
                    skipped,
                )
            )  # fmt: skip
            done = step + 1
            stopping = bool(shared[2])
            every = cfg.checkpoint.save_every
            if cfg.checkpoint.dir and (
                done == cfg.steps or stopping or (every and done % every == 0)
            ):
                with peaks.phase("save"):
                    _save(cfg, done, optimizer, loader, layout, model_config)
            if stopping:
                if layout.rank == 0:
                    print(f"SIGTERM: stopped after step {done}, checkpoint saved", flush=True)
                result.update(stopped_at=done, signal=True)
                break
    finally:
        sink.close()
    every_rank: list[dict[str, int]] = [{}] * dist.get_world_size()
    dist.all_gather_object(every_rank, peaks.peaks)
    if layout.rank == 0 and cfg.checkpoint.dir:
        print(format_peaks(every_rank, peaks.source), flush=True)
    return {"losses": losses, **result, "memory_peaks": every_rank}


def _device(cfg: TrainConfig) -> torch.device:
    """``cuda:LOCAL_RANK`` when asked for or (``auto``) available, else the CPU."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _inject(kind: str, part: torch.nn.Module, step: int, layout: Layout) -> None:
    if kind == "crash":
        raise RuntimeError(f"injected fault: rank {layout.rank} crashed at step {step + 1}")
    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)


def _nonfinite(cfg, step, loss, norm, optimizer, layout) -> None:
    """Stop naming the step and ranks, or (``skip_nonfinite``) drop this step's gradients."""
    device = optimizer.shards[0].param.device
    mine = torch.tensor([0.0 if math.isfinite(optimizer.local_square_sum) else 1.0], device=device)
    flags = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, mine)
    ranks = [r for r, f in enumerate(flags) if f.item()] or "pp-rank 0 (loss)"
    text = (
        f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step "
        f"{step + 1}: loss {loss}, gradient norm {norm}; non-finite gradients on rank(s) {ranks}"
    )
    optimizer.zero_grad()
    if not cfg.optim.skip_nonfinite:
        raise NonFiniteError(text + " (weights not updated; --skip-nonfinite skips such steps)")
    if layout.rank == 0:
        print(f"warning: {text}; step skipped", file=sys.stderr, flush=True)


def _save(cfg, done, optimizer, loader, layout, model_config) -> None:
    state = {"step": done, "loader": loader.state_dict(), "world_size": dist.get_world_size()}
    path = checkpointing.save_checkpoint(
        cfg.checkpoint.dir, done, optimizer, layout, state, model_config,
        config_to_toml(cfg), cfg.checkpoint.keep_last,
    )  # fmt: skip
    if layout.rank == 0:
        print(f"saved checkpoint {path}", flush=True)


def _resume_folder(cfg: TrainConfig, layout: Layout) -> str | None:
    """The newest complete checkpoint of ``checkpoint.dir`` (rank 0 checks, every rank
    gets its answer), or None to start afresh."""
    if not (cfg.checkpoint.dir and cfg.checkpoint.resume):
        return None
    choice = [None]
    if layout.rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            folder = checkpointing.newest_valid(cfg.checkpoint.dir)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr, flush=True)
        choice = [str(folder) if folder else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _resume(folder: str | None, optimizer, loader, layout: Layout) -> int:
    """Load the optimizer state and the trainer state of ``folder`` (the parameters were
    read from it when the part was built); return the step to start from."""
    if folder is None:
        return 0
    state = checkpointing.load_checkpoint(folder, optimizer, layout)
    loader.load_state_dict(state["loader"])
    rng = state["rng"]
    checkpointing.set_rng_state(rng[layout.rank] if len(rng) == dist.get_world_size() else rng[0])
    if layout.rank == 0:
        print(f"resumed from {folder} at step {state['step']}", flush=True)
    return int(state["step"])
