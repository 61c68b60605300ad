"""Everything `twinpipe train` checks before a process group starts, and the run it plans.

A mistake found inside a rank costs a spawn, a rendezvous and often the whole run (a
read-only checkpoint folder fails at the final save, after every step). So the parent
(or, under torchrun, every rank before it joins) calls `plan_run`, which reads only
configs, headers and indexes and checks:

- the model config (`models.hf.config_json`: unreadable files, unsupported fields) and the
  layout against it (``seq_len`` within the positions, ``2 * pp`` stages of layers, EP
  dividing the experts);
- ``init_from``: a twinpipe checkpoint of this model, or a Hugging Face checkpoint whose
  tensors, shapes and dtypes are this model's (`models.hf.check_hf_checkpoint`);
- the data: a prepared folder, enough tokens for one global batch, no token id beyond the
  model's vocabulary;
- the objective: ``loss.z_loss`` and ``loss.label_smoothing`` need the optimized runner;
  the ``[moe]`` section is set on the model and must suit it (`objective.with_moe`);
- every output path: the checkpoint dir, the metrics file (when it exists, JSON-lines
  text: a resume reads it back), the TensorBoard dir, the profile dir;
- the checkpoint dir's owner: a folder belongs to one run (``run.json``). Resuming picks
  its newest complete checkpoint; a folder whose every checkpoint is corrupt is an error,
  not a fresh start; ``--no-resume`` into another run's folder needs ``--overwrite``; a
  finished run (or ``--steps`` at or below the checkpoint's step) has nothing to do.

Each problem is a `models.runtime.BadInput` naming the config key, the value and what would
be valid; the command exits 2. `claim` is the one step that writes: rank 0 runs it after
the process group starts, so every rank planned against the same folder.
"""

from __future__ import annotations

import datetime as dt
import importlib
import os
import re
import shutil
import sys
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from models.hf import check_hf_checkpoint, config_from_hf, config_to_hf, resolve_model
from models.network import ModelConfig
from models.runtime import BadInput, ParallelConfig, check_output_dir, check_output_file, read_text
from optimized.train import checkpointing
from optimized.train.config import TrainConfig
from optimized.train.objective import objective_options, with_moe, with_mtp


class NothingToDo(Exception):
    """The run is already trained as far as asked; the message says where and how far."""


@dataclass(slots=True)
class RunPlan:
    """What the parent decided, handed to every rank."""

    model: ModelConfig
    """The model config, read once."""
    data_dir: str
    """The prepared token folder (``data.path`` or the default data set)."""
    resume: str | None = None
    """The checkpoint to resume from; None: start at step 0."""
    resume_step: int = 0
    """The step ``resume`` was saved after."""
    run_id: str | None = None
    """The run that owns ``checkpoint.dir``; None: a new run, named when it claims it."""
    replace: list[str] = field(default_factory=list)
    """What ``--overwrite`` deletes from ``checkpoint.dir`` before training."""
    notes: list[str] = field(default_factory=list)
    """Warnings to print once (checkpoints skipped as incomplete or corrupt)."""


_PARALLEL_KEYS = {
    "pp": "parallel.pp", "dp": "parallel.dp", "ep": "parallel.ep", "dtype": "dtype",
    "micro_batch_size": "data.micro_batch_size", "micro_batches": "data.micro_batches",
    "seq_len": "data.seq_len",
}  # fmt: skip


def plan_run(cfg: TrainConfig) -> RunPlan:
    """Check ``cfg`` against the files it names; the plan, or `BadInput` / `NothingToDo`."""
    model = with_mtp(cfg, with_moe(cfg, _model(cfg)))
    _layout(cfg, model)
    if cfg.model.init_from:
        _init_from(cfg.model.init_from, model)
    data_dir = _data(cfg, model)
    _objective(cfg)
    _outputs(cfg)
    plan = RunPlan(model, data_dir)
    if cfg.checkpoint.dir:
        _ownership(cfg, model, plan)
    return plan


RUNNER = "optimized.pipeline:OptimizedPipeline"
"""The one seam between the trainer and the stack it drives (``module:Class``)."""


def runner_class() -> type:
    """The pipeline runner class (``TWINPIPE_RUNNER=module:Class`` overrides `RUNNER`): the
    trainer builds it, and the preflight checks the run's objective options against it."""
    module, _, name = os.environ.get("TWINPIPE_RUNNER", RUNNER).partition(":")
    return getattr(importlib.import_module(module), name)


def _objective(cfg: TrainConfig) -> None:
    """``loss.z_loss`` and ``loss.label_smoothing`` need a runner that takes them."""
    objective_options(cfg, runner_class())


DEFAULT_MODEL = "tiny-deepseek-v2"
"""The model of a run that names none and starts from no checkpoint."""


def _model(cfg: TrainConfig) -> ModelConfig:
    """``model.name``; unset, the ``init_from`` checkpoint's own model, else `DEFAULT_MODEL`."""
    name, key = cfg.model.name, "model.name"
    if name is None and cfg.model.init_from is not None:
        folder = checkpointing.newest_valid(cfg.model.init_from, warn=False)
        name, key = str(folder or cfg.model.init_from), "model.init_from"
    try:
        return resolve_model(name or DEFAULT_MODEL)
    except (ValueError, OSError) as error:
        raise BadInput(f"{key} = {name!r}: {error}") from None


def _layout(cfg: TrainConfig, model: ModelConfig) -> None:
    parallel = ParallelConfig(
        pp=cfg.parallel.pp, dp=cfg.parallel.dp, ep=cfg.parallel.ep,
        micro_batch_size=cfg.data.micro_batch_size, micro_batches=cfg.data.micro_batches,
        seq_len=cfg.data.seq_len, dtype=cfg.dtype, seed=cfg.seed,
    )  # fmt: skip
    try:
        parallel.validate(model)
    except ValueError as error:
        text = re.sub(
            r"ParallelConfig\.(\w+)=", lambda m: f"{_PARALLEL_KEYS.get(m[1], m[1])} = ", str(error)
        )
        named = cfg.model.name or cfg.model.init_from or DEFAULT_MODEL
        raise BadInput(f"{text} (model {named})") from None


def _same_model(found: ModelConfig, model: ModelConfig) -> bool:
    return config_to_hf(found) == config_to_hf(model)


def _init_from(source: str, model: ModelConfig) -> None:
    folder = checkpointing.newest_valid(source, warn=False)
    if folder is None and (Path(source) / checkpointing.MANIFEST).exists():
        raise BadInput(
            f"model.init_from = {source!r}: a twinpipe checkpoint that is incomplete or "
            f"corrupt: {checkpointing.verify(source)}"
        )
    if folder is None and checkpointing.list_checkpoints(source):
        raise BadInput(
            f"model.init_from = {source!r}: every twinpipe checkpoint in it is incomplete or "
            "corrupt"
        )
    if folder is None:
        check_hf_checkpoint(source, model, "model.init_from")
        return
    _check_training_checkpoint(folder, model, "model.init_from")


def _check_training_checkpoint(folder: Path, model: ModelConfig, key: str) -> None:
    try:
        found = config_from_hf(folder / "config.json")
    except (ValueError, OSError) as error:
        raise BadInput(f"{key}: checkpoint {folder}: {error}") from None
    if not _same_model(found, model):
        differ = sorted(
            k
            for k, v in config_to_hf(model).items()
            if config_to_hf(found).get(k) != v and k != "dtype"
        )
        raise BadInput(
            f"{key}: checkpoint {folder} holds another model than {model.model_type} being "
            f"trained (differs in {', '.join(differ[:6]) or 'its config'})"
        )
    try:  # its tensors, as DCP's metadata records them
        checkpointing.validate_training_checkpoint(folder, model)
    except ValueError as error:
        raise BadInput(f"{key}: {error}") from None


def _data(cfg: TrainConfig, model: ModelConfig) -> str:
    """The training blend (``data.path``, or the default data set), its held-out data, each
    source opened and held against the others and the model (`optimized.data.corpus`)."""
    from optimized.data import corpus  # noqa: PLC0415
    from optimized.data.preparation import default_dataset  # noqa: PLC0415

    data = cfg.data
    spec = data.path if data.path is not None else str(default_dataset())
    try:
        train = corpus.open_corpus(spec, data.seq_len, "data.path", data.split)
        held = corpus.held_out(spec, data.eval_path, data.split, data.seq_len)
        corpus.check_corpora([train] + ([held] if held else []), model.vocab_size)
    except ValueError as error:
        raise BadInput(str(error)) from None
    needed = cfg.parallel.dp * data.micro_batches * data.micro_batch_size
    if train.num_samples < needed:
        tokens = sum(w.end - w.first for w in train.windows)
        raise BadInput(
            f"data.path = {spec!r} holds {tokens} tokens: {train.num_samples} samples of "
            f"seq_len + 1 = {data.seq_len + 1}, fewer than one global batch of {needed} "
            "(parallel.dp x data.micro_batches x data.micro_batch_size); "
            "use more data, a shorter seq_len or smaller batches"
        )
    return spec


def _outputs(cfg: TrainConfig) -> None:
    if cfg.checkpoint.dir:
        check_output_dir(cfg.checkpoint.dir, "checkpoint.dir")
    if cfg.logging.metrics_file:
        metrics = check_output_file(cfg.logging.metrics_file, "logging.metrics_file")
        if metrics.is_file():  # appended to, and read back on resume: it must be JSON lines
            try:
                read_text(metrics, "a text file of JSON lines, one per step (or a new path)")
            except BadInput as error:
                raise BadInput(f"logging.metrics_file: {error}") from None
    if cfg.logging.profile_dir:
        check_output_dir(cfg.logging.profile_dir, "logging.profile_dir")
    if cfg.logging.tensorboard_dir:
        check_output_dir(cfg.logging.tensorboard_dir, "logging.tensorboard_dir")
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401, PLC0415
        except ImportError as error:
            raise BadInput(
                f"logging.tensorboard_dir = {cfg.logging.tensorboard_dir!r}: TensorBoard is "
                f"not installed ({error}); pip install tensorboard, or leave it unset"
            ) from None


def _ownership(cfg: TrainConfig, model: ModelConfig, plan: RunPlan) -> None:
    """Who owns ``checkpoint.dir``, and where this run starts in it."""
    root = Path(cfg.checkpoint.dir)
    try:
        run = checkpointing.read_run(root)
    except ValueError as error:
        raise BadInput(f"checkpoint.dir = {str(root)!r}: {error}") from None
    found = checkpointing.list_checkpoints(root)
    owner = run["run_id"] if run else None
    if not found and run is None:
        return  # a new folder, or an empty one: this run claims it
    if cfg.checkpoint.overwrite:
        plan.replace = [str(p) for p in found] + ([str(root / checkpointing.RUN_FILE)] * bool(run))
        return
    holds = f"run {owner}" if owner else "a run"
    names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
    if not cfg.checkpoint.resume:
        raise BadInput(
            f"checkpoint.dir = {str(root)!r} holds {holds}'s checkpoints ({names or 'none'}); "
            "checkpoint.resume = false would start a new run in it. Pass --overwrite to "
            "delete them, resume it, or choose another --checkpoint-dir"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = checkpointing.newest_valid(root)
    skipped = [str(w.message) for w in caught]
    if folder is None and found:
        raise BadInput(
            f"checkpoint.dir = {str(root)!r}: every checkpoint is incomplete or corrupt, so "
            "there is nothing to resume, and starting over would overwrite them:\n  "
            + "\n  ".join(skipped)
            + "\nPass --overwrite to delete them and start afresh, or choose another "
            "--checkpoint-dir"
        )
    plan.notes += skipped
    plan.run_id = owner or (checkpointing.checkpoint_run(folder) if folder else None)
    if folder is None:
        return
    _check_training_checkpoint(folder, model, "checkpoint.dir")
    step = _saved_step(folder)
    if step >= cfg.steps:
        raise NothingToDo(
            f"nothing to do: {folder} is step {step} of run {plan.run_id or '(unnamed)'}, and "
            f"steps = {cfg.steps}; raise --steps to train further"
        )
    _schedule_extension(cfg, folder, step)
    _data_position(cfg, folder, plan.data_dir)
    plan.resume, plan.resume_step = str(folder), step


def _data_position(cfg: TrainConfig, folder: Path, spec: str) -> None:
    """The checkpoint's data position fits this run's blend (the same sources, sizes,
    weights, seed and seq_len), as every rank will load it."""
    import torch  # noqa: PLC0415

    from optimized.data.corpus import open_corpus  # noqa: PLC0415

    state = torch.load(folder / checkpointing.TRAINER_STATE, weights_only=False)
    data = cfg.data
    loader = open_corpus(spec, data.seq_len, "data.path", data.split).loader(
        cfg.seed, data.shuffle, data.micro_batches, data.micro_batch_size, 0, cfg.parallel.dp
    )
    try:
        loader.load_state_dict(state["loader"])
    except (ValueError, KeyError) as error:
        raise BadInput(f"checkpoint.dir: {folder} cannot go on with this data: {error}") from None


def _schedule_extension(cfg: TrainConfig, folder: Path, step: int) -> None:
    """A WSD run goes on under a changed schedule only if every step taken keeps its rate
    (`optimized.train.schedule.resume_conflict`)."""
    from optimized.train.config_io import load_config  # noqa: PLC0415
    from optimized.train.schedule import resume_conflict  # noqa: PLC0415

    saved_toml = folder / "train.toml"  # the run's config, saved with it
    if not saved_toml.is_file():
        return
    try:
        saved = load_config(saved_toml)
    except (ValueError, BadInput):
        return  # an older checkpoint's config: its schedule has no WSD to keep
    problem = resume_conflict(saved, cfg, step)
    if problem:
        raise BadInput(f"{problem} (checkpoint {folder})")


def _saved_step(folder: Path) -> int:
    match = re.fullmatch(rf"{checkpointing.PREFIX}(\d+)", folder.name)
    if match:
        return int(match[1])
    import torch  # noqa: PLC0415

    return int(torch.load(folder / checkpointing.TRAINER_STATE, weights_only=False)["step"])


def claim(cfg: TrainConfig, plan: RunPlan) -> str:
    """Rank 0, after the process group started: delete what ``--overwrite`` replaces, and
    record this run as the owner of ``checkpoint.dir``. Returns the run id."""
    root = Path(cfg.checkpoint.dir)
    for path in plan.replace:
        target = Path(path)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    if plan.replace:
        print(f"--overwrite: deleted {len(plan.replace)} entries of {root}", file=sys.stderr)
    run_id = plan.run_id or uuid.uuid4().hex[:12]
    if plan.run_id is None or not (root / checkpointing.RUN_FILE).exists():
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        checkpointing.write_run(root, {"run_id": run_id, "created": stamp,
                                       "model": cfg.model.name, "seed": cfg.seed})  # fmt: skip
    return run_id
