"""The training loop of `twinpipe train`: data, steps, metrics, checkpoints, faults.

One function, `train`, runs on every rank of an initialised process group. Each step:

1. this DP rank reads its own slice of the step's global batch of the blend
   (`optimized.data.blend.BlendLoader`: every rank computes the same order, and rank 0 logs
   a source that starts a new epoch), and the DP group all-gathers the slices into the
   global batch the pipeline runner slices (the ids are tiny next to activations, and the
   loss stays the mean over the global batch);
2. the runner (`runner_class`, the optimized stack's `OptimizedPipeline`) runs the
   DualPipeV forward/backward and reduces gradients. With sharding on (``parallel.fsdp``,
   default when DP > 1) the leaf modules are `fully_shard`-ed (`optimized.pipeline.sharding`),
   routed experts over their expert replicas: FSDP2 gathers their parameters and
   reduce-scatters their gradients (the zero-bubble W steps' included), and only the
   rest (experts where EP = DP, a tied output layer) is all-reduced;
3. `ShardedAdamW` takes float32 gradient slices, the global norm is checked (a NaN or
   inf stops the run naming the step and ranks, or skips the step), clipped, stepped;
   then, once per step taken (never a skipped one), the runner moves the expert biases
   (``moe.expert_bias``) from the step's load;
4. with held-out data, every ``eval_every`` steps and after the last, the held-out loss
   of the updated weights, forward only (`optimized.train.evaluation`);
5. rank 0 logs one line, a JSON record, TensorBoard scalars, the expert load of every MoE
   layer among them (`optimized.train.expert_load`: one all-reduce a step); checkpoints
   are saved every ``save_every`` steps, at the end, and when SIGTERM arrives.

The host never waits for the device in a step except where it needs a value: the MoE
layers' split sizes (`models.network.decoder.MoE.split_sizes`) and, once, the logged loss,
norm, z-loss and expert load, read together before the update (`LoggedScalars`); the norm,
the clipping factor and the loss stay on the device until then, and the host's own figures
(time, memory, traffic) reduce over the gloo host group. ``tests/test_host_syncs.py``
holds it to that.

A run stops early on SIGTERM or SIGINT (the launcher forwards both to every rank): the
ranks agree at the end of the step, save, and return ``signal``; the command exits
128 + the signal. Metrics are written once per step: on resume, records past the resumed
step are dropped from the metrics file before the steps are run again.

Fault injection for tests: ``TWINPIPE_FAULT=KIND@STEP:RANK`` (`optimized.train.faults`):
a crash, a signal, a lost checkpoint folder, NaN gradients, or one NaN mid-step in one rank's
attention, routed experts or loss gradient.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from models.hf import CheckpointWeights
from models.network import ModelConfig, Reporting, SeededWeights, WeightSource, state_buffers
from models.runtime import (
    CommunicationCounter,
    Layout,
    OptimizerConfig,
    ParallelConfig,
    ProgressLine,
    group_names,
    make_layout,
    phase_limit,
    rank_device,
    rescue_folder,
)
from optimized.data.corpus import open_corpus
from optimized.data.loader import BatchToDevice
from optimized.ops import first_step_kernels
from optimized.pipeline import sharding
from optimized.train import checkpointing, faults
from optimized.train.checkpoint_weights import TrainingCheckpointWeights
from optimized.train.config import TrainConfig, lr_at
from optimized.train.config_io import config_to_toml
from optimized.train.evaluation import Evaluation
from optimized.train.expert_load import ExpertLoad
from optimized.train.metrics import (
    LoggedScalars,
    MetricsSink,
    StepMetrics,
    Throughput,
    slowest_rank,
    step_traffic,
)
from optimized.train.mtp_coef import mtp_coef_at
from optimized.train.objective import mean_z_loss, objective_options
from optimized.train.optimizer import ShardedAdamW
from optimized.train.phases import PhasePeaks, format_peaks, peak_memory
from optimized.train.preflight import RunPlan, claim, plan_run, runner_class
from optimized.train.profiling import StepProfiler, parse_steps
from optimized.train.startup import before_first_step, describe


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step was NaN or infinite."""


# ------------------------------------------------------------------ setup
def parallel_config(cfg: TrainConfig, model: ModelConfig) -> ParallelConfig:
    parallel = ParallelConfig(
        pp=cfg.parallel.pp, dp=cfg.parallel.dp, ep=cfg.parallel.ep,
        micro_batch_size=cfg.data.micro_batch_size, micro_batches=cfg.data.micro_batches,
        seq_len=cfg.data.seq_len, dtype=cfg.dtype, seed=cfg.seed,
        grad_sync=cfg.parallel.grad_sync, reshard_after_forward=cfg.parallel.reshard_after_forward,
        recompute=cfg.parallel.recompute,
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
        return TrainingCheckpointWeights(resume)
    source = cfg.model.init_from
    if source is None:
        return SeededWeights(model, cfg.seed)
    folder = checkpointing.newest_valid(source, warn=False)
    if folder is not None:
        return TrainingCheckpointWeights(folder)
    return CheckpointWeights(source, model)


def global_batch(inputs: torch.Tensor, labels: torch.Tensor, layout: Layout):
    """The step's global batch from every DP rank's ``[M, mbs, L]`` shard, in DP order."""
    pair = torch.stack([inputs.reshape(-1, inputs.shape[-1]), labels.reshape(-1, labels.shape[-1])])
    if layout.dp > 1:
        pieces = [torch.empty_like(pair) for _ in range(layout.dp)]
        dist.all_gather(pieces, pair.contiguous(), group=layout.dp_group)
        pair = torch.cat(pieces, dim=1)
    return pair[0], pair[1]


class _StopFlag:
    """Set by SIGTERM or SIGINT; the loop saves a checkpoint and stops at the end of the
    step. ``requested`` is the signal's number (0: none)."""

    def __init__(self) -> None:
        self.requested = 0
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: no handler
                pass

    def _handle(self, signum, frame) -> None:
        self.requested = signum


# ------------------------------------------------------------------ loop
def train(
    cfg: TrainConfig,
    plan: RunPlan | None = None,
    step_watch: Callable[[int], AbstractContextManager] | None = None,
) -> dict[str, Any]:
    """Train on this rank (process group already initialised); returns this rank's
    per-step losses (``None`` for skipped steps), where it stopped, the signal that
    stopped it (0: none), where the last checkpoint went if not to ``checkpoint.dir``, and
    every rank's peak memory in each phase (load, train, save; `optimized.train.phases`).

    ``plan`` is what `optimized.train.preflight.plan_run` decided in the parent; without
    one, rank 0 makes it here. ``step_watch(step)`` (1-based), when given, returns a
    context entered around each whole step, from reading its batch to recording its
    metrics (tests count a step's host synchronisations through it: `models.runtime.host_sync`)."""
    stop = _StopFlag()
    device = rank_device()  # what the launcher handed this rank (`models.runtime.device`)
    plan = _shared_plan(cfg, plan)
    model_config = plan.model
    parallel = parallel_config(cfg, model_config)
    layout = make_layout(parallel)
    run_id = _claimed(cfg, plan, layout)
    torch.manual_seed(cfg.seed)
    opt = cfg.optim
    peaks = PhasePeaks(device)
    peaks.begin()  # load: the part built from the checkpoint, the optimizer state read
    resume = plan.resume
    fsdp = cfg.parallel.sharded
    sharded: set[str] = set()

    def shard(part: torch.nn.Module) -> None:  # FSDP2 on the meta part: this rank's rows only
        sharded.update(sharding.apply_fsdp(part, layout, device, parallel.reshard_after_forward))

    with phase_limit("load", cfg.setup_timeout):  # its own limit (optimized.train.startup)
        source = weight_source(cfg, model_config, resume)
        line = ProgressLine(f"loading {source!r} (rank 0's part)",
                            enabled=None if layout.rank == 0 else False)  # fmt: skip
        runner = runner_class()(
            model_config, parallel, layout, Reporting(source, line),
            OptimizerConfig(lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay),
            device=device, shard=shard if fsdp else None, **objective_options(cfg, runner_class()),
        )  # fmt: skip
        line.close()
        optimizer = ShardedAdamW(
            runner.part, layout, lr=opt.lr, betas=opt.betas, eps=1e-8,
            weight_decay=opt.weight_decay, shard=cfg.parallel.use_fsdp, fsdp=sharded,
            state_dtype=opt.state_dtype, master_weights=opt.master_weights,
        )  # fmt: skip
        runner.optimizer = optimizer  # the runner zeroes gradients through it
        data = cfg.data  # the blend's training part, every rank's own slice of each global batch
        corpus = open_corpus(plan.data_dir, data.seq_len, "data.path", data.split)
        loader = corpus.loader(cfg.seed, data.shuffle, data.micro_batches, data.micro_batch_size,
                               layout.dp_rank, layout.dp)  # fmt: skip
        runner.eod_id = corpus.eod_id  # MTP targets never cross a document's end
        evaluation = Evaluation.of(cfg, plan.data_dir, runner, device, fsdp)

        start = _resume(resume, optimizer, loader, layout)
    peaks.end("load")
    peaks.begin(counted=False)  # connect and tune: no step's peak (optimized.train.startup)
    prepared = before_first_step(cfg, runner, layout, device)
    peaks.end("warm-up")
    if layout.rank == 0:
        print(describe(prepared), flush=True)
    sink = MetricsSink(cfg, enabled=layout.rank == 0, start=start)
    throughput = Throughput.of(cfg, model_config, device, runner.part.ops.recompute_attention)
    profiler = _profiler(cfg, start, layout, device)
    if layout.rank == 0:
        print(throughput.describe(), flush=True)
    saved = _Saver(cfg, run_id, optimizer, loader, layout, model_config, runner.part)
    expert_load = ExpertLoad.of(runner, layout)  # None: no MoE layer
    fault = faults.fault_from_env() or faults.Fault("none", -1, -1)
    tokens_per_step = parallel.global_batch * parallel.seq_len
    losses: list[float | None] = []
    result = {"start": start, "stopped_at": cfg.steps, "signal": 0, "batch_digests": [],
              "eval_losses": {}}  # fmt: skip
    counter = CommunicationCounter(group_names(layout)).install()
    to_device, scalars = BatchToDevice(device), LoggedScalars()
    watch = ExitStack()
    try:
        for step in range(start, cfg.steps):
            if step_watch is not None:
                watch.enter_context(step_watch(step + 1))
            began = time.perf_counter()
            profiler.begin(step + 1)
            peaks.begin()
            counter.start()
            batch = next(loader)
            result["batch_digests"].append(batch.digest)
            _log_data_notes(loader.blend, layout)
            ids, labels = global_batch(*to_device(batch), layout)
            faults.before_step(fault, step, layout.rank, cfg.checkpoint.dir)
            runner.mtp_coef = mtp_coef_at(step + 1, cfg)  # the MTP weight's schedule
            with faults.mid_step(fault, step, layout.rank, runner.part):
                if fsdp:
                    loss = sharding.forward_backward_on_device(
                        runner, optimizer, sharded, ids, labels
                    )
                else:
                    loss = runner.forward_backward_on_device(ids, labels)
            faults.after_backward(fault, step, layout.rank, runner.part)
            if step == start:  # every kernel launched before it (optimized.ops.precompile)
                result["kernels_first_in_step"] = first_step_kernels(layout.rank)
            norm_on_device = optimizer.prepare_gradients_on_device()
            z_loss = None
            if cfg.loss.z_loss:
                with counter.paused():  # logged only: not the step's traffic
                    z_loss = mean_z_loss(runner.schedule, layout)
            load = expert_load.gather(runner.balance) if expert_load else None
            with counter.paused():  # logged only
                mtp = runner.mtp_values()  # [2, D]: each depth's loss and accuracy
            # The step's one read of the device's values (the skip needs them before the
            # update): loss, gradient norm, z-loss, the expert load and the MTP's, one copy.
            loss, norm, z_loss, load, mtp = scalars.read(loss, norm_on_device, z_loss, load, mtp)
            depths = model_config.num_mtp_layers
            lr = lr_at(step, cfg)
            skipped = not (math.isfinite(loss) and math.isfinite(norm))
            if skipped:
                _nonfinite(cfg, step, loss, norm, optimizer, layout)
            else:
                optimizer.clip(norm_on_device, opt.grad_clip)
                optimizer.step(lr)
                runner.update_expert_biases()  # once per step taken (`moe.expert_bias`)
            traffic = step_traffic(counter.stop(), layout.host_group)
            peaks.end("train")
            elapsed = time.perf_counter() - began
            memory, source = peak_memory(peaks)
            slowest, memory, stopping, state_bytes = slowest_rank(
                [elapsed, memory, stop.requested, optimizer.state_bytes()], layout.host_group
            )
            losses.append(None if skipped else loss)
            held = None
            if evaluation is not None and evaluation.due(step + 1, cfg.steps):
                held = evaluation.run()  # after the update: the weights the step left
                result["eval_losses"][step + 1] = held[0]
            sink.record(
                StepMetrics(
                    step + 1,
                    cfg.steps,
                    slowest,
                    loss,
                    lr,
                    norm,
                    tokens_per_step / max(slowest, 1e-9),
                    int(memory),
                    source,
                    skipped,
                    traffic,
                    z_loss,
                    int(state_bytes),
                    validation_loss=held and held[0],
                    validation_perplexity=held and held[1],
                    **throughput.figures(tokens_per_step / max(slowest, 1e-9)),
                    **(expert_load.figures(load) if expert_load else {}),
                    mtp_loss=mtp[:depths] if mtp else None,
                    mtp_accuracy=mtp[depths:] if mtp else None,
                )
            )
            profiler.end(step + 1)
            watch.close()
            done = step + 1
            stopping = int(stopping)
            every = cfg.checkpoint.save_every
            if cfg.checkpoint.dir and (
                done == cfg.steps or stopping or (every and done % every == 0)
            ):
                with peaks.phase("save"):
                    saved.save(done)
            if stopping:
                if layout.rank == 0:
                    name = signal.Signals(stopping).name
                    what = "checkpoint saved" if cfg.checkpoint.dir else "no checkpoint dir"
                    print(f"{name}: stopped after step {done} of {cfg.steps}, {what}", flush=True)
                result.update(stopped_at=done, signal=stopping)
                break
    finally:
        watch.close()
        profiler.close()
        counter.remove()
        sink.close()
    if layout.rank == 0 and profiler.written:
        print(f"profile of steps {profiler.steps.start}-{profiler.steps[-1]}: "
              f"{Path(profiler.written[0]).parent}/rank*.trace.json, rank*.top_ops.md",
              flush=True)  # fmt: skip
    every_rank: list[dict[str, int]] = [{}] * dist.get_world_size()
    dist.all_gather_object(every_rank, peaks.peaks, group=layout.host_group)
    if layout.rank == 0 and cfg.checkpoint.dir:
        print(format_peaks(every_rank, peaks.source), flush=True)
    return {"losses": losses, **result, "rescued": saved.rescued, "memory_peaks": every_rank}


def _log_data_notes(blend, layout: Layout) -> None:
    """Rank 0 says when a source ran out and started a new epoch (every rank computes the
    same blend: the others forget it)."""
    if blend.notes and layout.rank == 0:
        for note in blend.notes:
            print(note, flush=True)
    blend.notes.clear()


def _profiler(cfg: TrainConfig, start: int, layout: Layout, device) -> StepProfiler:
    """``logging.profile_steps`` of this run on this rank (none without ``profile_dir``)."""
    folder = cfg.logging.profile_dir
    steps = parse_steps(cfg.logging.profile_steps, start, cfg.steps) if folder else range(0)
    if folder and steps.stop <= start + 1 and layout.rank == 0:
        print(f"warning: logging.profile_steps = {cfg.logging.profile_steps}: this run starts "
              f"after step {start}, nothing is profiled", file=sys.stderr, flush=True)  # fmt: skip
    return StepProfiler(folder, steps, layout.rank, device)


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


class _Saver:
    """Saves checkpoints into ``checkpoint.dir``; when a save fails there (the disk filled
    or went away), into a rescue folder that every later save uses too, named on stdout."""

    def __init__(self, cfg, run_id, optimizer, loader, layout, model_config, part) -> None:
        self.cfg, self.run_id, self.optimizer = cfg, run_id, optimizer
        self.loader, self.layout, self.model_config = loader, layout, model_config
        self.part = part  # its expert biases are training state too (`state_buffers`)
        self.root = cfg.checkpoint.dir
        self.rescued: str | None = None

    def save(self, done: int) -> None:
        try:
            path = self._write(self.root, done)
        except checkpointing.CheckpointSaveError as error:
            if self.rescued is not None:
                raise
            box = [str(rescue_folder()) if self.layout.rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.layout.host_group)
            self.root = self.rescued = box[0]
            path = self._write(self.root, done)
            if self.layout.rank == 0:
                print(f"error: {error}; saved the checkpoint to {path} instead",
                      file=sys.stderr, flush=True)  # fmt: skip
        if self.layout.rank == 0:
            print(f"saved checkpoint {path}", flush=True)

    def _write(self, root: str, done: int) -> Path:
        state = {"step": done, "loader": self.loader.state_dict(), "run_id": self.run_id,
                 "world_size": dist.get_world_size()}  # fmt: skip
        return checkpointing.save_checkpoint(
            root, done, self.optimizer, self.layout, state, self.model_config,
            config_to_toml(self.cfg), self.cfg.checkpoint.keep_last, self.run_id,
            state_buffers(self.part),
        )  # fmt: skip


def _shared_plan(cfg: TrainConfig, plan: RunPlan | None) -> RunPlan:
    """``plan``, or (called without one, as tests do) rank 0's plan given to every rank."""
    if plan is not None:
        return plan
    box = [None]
    if dist.get_rank() == 0:
        box = [plan_run(cfg)]
        for note in box[0].notes:
            print(f"warning: {note}", file=sys.stderr, flush=True)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _claimed(cfg: TrainConfig, plan: RunPlan, layout: Layout) -> str | None:
    """The run id that owns ``checkpoint.dir``, recorded there by rank 0 (`preflight.claim`)."""
    if not cfg.checkpoint.dir:
        return None
    box = [claim(cfg, plan) if layout.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=layout.host_group)
    return box[0]


def _resume(folder: str | None, optimizer, loader, layout: Layout) -> int:
    """Load the optimizer state and the trainer state of the checkpoint the plan chose
    (None: start afresh; its parameters were the part's weight source); return the step
    to start from."""
    if folder is None:
        return 0
    state = checkpointing.load_checkpoint(folder, optimizer, layout)
    loader.load_state_dict(state["loader"])
    rng = state["rng"]
    checkpointing.set_rng_state(rng[layout.rank] if len(rng) == dist.get_world_size() else rng[0])
    if layout.rank == 0:
        print(f"resumed from {folder} at step {state['step']}", flush=True)
    return int(state["step"])
