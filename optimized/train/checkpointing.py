"""Training checkpoints: each rank writes its own bytes; layout-free; atomic; verified.

On-disk format (one folder ``step-00000020`` per checkpoint under the checkpoint dir):

- a `torch.distributed.checkpoint` (DCP) in which every rank writes exactly the
  parameters and optimizer state it holds, nothing gathered, as chunks of whole-model
  tensors (`optimized.train.chunks`): ``model.<name>`` with the whole model's shape
  (routed experts ``[E, ...]``), each rank's piece at its offset: the rows of its
  experts (EP) and of its FSDP2 shard; ``optim.<name>.exp_avg`` / ``.exp_avg_sq`` (in the
  run's ``optim.state_dtype``; and ``.master``, the float32 copy, when parameters are not
  float32 and ``optim.master_weights`` is on) as flat tensors of the parameter's element
  count, each rank's slice at its flat offset (the sharded AdamW's slices are flat
  ranges, not always whole rows); a resume with other settings converts them
  (`precision_changes`). DCP's metadata holds
  every global shape and chunk, and replicas' identical pieces are written once. Nothing
  on disk depends on PP, DP, EP or FSDP, so a checkpoint saved at one layout loads at
  any other, each rank reading only the regions it holds;
- ``trainer_state.pt``: the step, AdamW's own step count (``optimizer_steps``: behind the
  step by the steps ``skip_nonfinite`` skipped; its bias correction continues from it), the
  data loader's position, every rank's RNG states;
- ``config.json`` (the model, Hugging Face style) and ``train.toml`` (the run's config);
- ``manifest.json``, written last: every file's size and sha256, and the run id.

A checkpoint folder belongs to one run: ``run.json`` beside the ``step-*`` folders holds
its run id (written when the run claims the folder), and every manifest repeats it. A run
never prunes or replaces a checkpoint another run wrote (`save_checkpoint`), and the
trainer refuses to start a different run in a folder that holds one unless told to
``overwrite`` (`optimized.train.preflight`).

A checkpoint is written to ``.tmp-step-...`` and renamed when complete, so a crash never
leaves a half-written ``step-*``; on resume each candidate is verified against its
manifest, and one that is incomplete or corrupt is skipped with a warning naming it.
Resuming reads the parameters as the part is built (`TrainingCheckpointWeights`, a
weight source) and the optimizer state into the slices each rank owns (`load_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from models.hf import CheckpointError, config_to_hf, expected_state_shapes
from models.network import ModelConfig, is_expert_parameter
from models.runtime import BadInput, Layout, ProgressLine, read_json
from optimized.train import chunks
from optimized.train.chunks import Chunk
from optimized.train.optimizer import ParamShard, ShardedAdamW

MANIFEST = "manifest.json"
RUN_FILE = "run.json"
TRAINER_STATE = "trainer_state.pt"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "master")


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


# ------------------------------------------------------------------ geometry
def _experts_before(s: ParamShard, layout: Layout) -> int:
    """Experts of the whole tensor before this EP rank's block (0 for non-experts)."""
    return layout.ep_rank * s.param.shape[0] if is_expert_parameter(s.name) else 0


def global_shape(s: ParamShard, layout: Layout) -> tuple[int, ...]:
    """The whole model's shape of ``s``'s parameter (routed experts: all ``E``)."""
    shape = tuple(s.param.shape)
    return ((shape[0] * layout.ep,) if is_expert_parameter(s.name) else shape[:1]) + shape[1:]


def parameter_chunk(s: ParamShard, layout: Layout) -> Chunk | None:
    """This rank's rows of the whole parameter (its experts, its FSDP2 rows), in place."""
    local = s.local()
    if local.numel() == 0:
        return None
    row = math.prod(s.param.shape[1:])
    first = _experts_before(s, layout) + (s.start // row if s.fsdp else 0)
    return chunks.rows(local, first, global_shape(s, layout))


def state_chunk(s: ParamShard, layout: Layout, piece: torch.Tensor) -> Chunk | None:
    """This rank's flat slice ``[start, stop)`` of a parameter's optimizer state, as a
    chunk of the flat whole-model tensor (``piece`` may be padded past ``stop``)."""
    if s.stop <= s.start:
        return None
    whole = math.prod(global_shape(s, layout))
    offset = _experts_before(s, layout) * math.prod(s.param.shape[1:]) + s.start
    return Chunk(piece[: s.stop - s.start], (offset,), (whole,))


def local_state(optimizer: ShardedAdamW, layout: Layout) -> dict[str, Chunk]:
    """This rank's pieces of the layout-free state dict, by key (views: nothing copied)."""
    state: dict[str, Chunk] = {}
    for s in optimizer.shards:
        parameter = parameter_chunk(s, layout)
        if parameter is not None:
            state[f"model.{s.name}"] = parameter
        for key, piece in optimizer.state_tensors(s).items():
            chunk = state_chunk(s, layout, piece)
            if chunk is not None:
                state[f"optim.{s.name}.{key}"] = chunk
    return state


# ------------------------------------------------------------------ files
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path, run_id: str | None) -> None:
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    with open(folder / MANIFEST, "w") as f:
        json.dump({"run_id": run_id, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify(folder: str | os.PathLike) -> str | None:
    """None when ``folder`` is a complete checkpoint; else why it is not."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (incomplete)"
    try:
        files = read_json(manifest, "a JSON object listing the checkpoint's files")["files"]
    except BadInput as error:  # binary, or not JSON
        return str(error)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest.json ({error})"
    for name, info in files.items():
        path = folder / name
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != info["size"]:
            return f"file {name} has size {path.stat().st_size}, expected {info['size']}"
        if _sha256(path) != info["sha256"]:
            return f"file {name} fails its sha256 check"
    return None


def checkpoint_run(folder: str | os.PathLike) -> str | None:
    """The run id a checkpoint's manifest records (None: unreadable, or written before
    checkpoints carried one)."""
    try:
        run_id = json.loads((Path(folder) / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def read_run(root: str | os.PathLike) -> dict[str, Any] | None:
    """The ``run.json`` of a checkpoint dir (None when there is none); ``ValueError``
    naming the file when it is unreadable."""
    path = Path(root) / RUN_FILE
    if not path.exists():
        return None
    try:
        run = read_json(path, "a JSON object naming the run that owns the folder (run_id)")
    except BadInput:
        raise
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{path} is unreadable ({error}); it names the run that owns the folder"
        ) from None
    if not isinstance(run, dict) or not isinstance(run.get("run_id"), str):
        raise ValueError(f"{path} holds no run_id; it names the run that owns the folder")
    return run


def write_run(root: str | os.PathLike, run: dict[str, Any]) -> None:
    """Write ``run.json`` (atomically) claiming ``root`` for ``run["run_id"]``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{RUN_FILE}"
    tmp.write_text(json.dumps(run, indent=1) + "\n")
    os.replace(tmp, root / RUN_FILE)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """``step-*`` folders under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def newest_valid(root: str | os.PathLike, warn: bool = True) -> Path | None:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one);
    older ones are tried when the newest fails verification, with a warning naming it."""
    root = Path(root)
    candidates = [root] if (root / MANIFEST).exists() else list_checkpoints(root)
    for folder in candidates:
        problem = verify(folder)
        if problem is None:
            return folder
        if warn:
            warnings.warn(f"skipping checkpoint {folder}: {problem}", stacklevel=2)
    return None


# ------------------------------------------------------------------ save
class CheckpointSaveError(OSError):
    """A checkpoint could not be written; raised on every rank, so they agree what to do."""


def _agree(problem: str | None, layout: Layout) -> None:
    """Raise `CheckpointSaveError` on every rank when rank 0 met ``problem``."""
    box = [problem]
    dist.broadcast_object_list(box, src=0, group=layout.host_group)
    if box[0] is not None:
        raise CheckpointSaveError(box[0])


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    optimizer: ShardedAdamW,
    layout: Layout,
    trainer_state: dict[str, Any],
    model_config: ModelConfig,
    config_toml: str,
    keep_last: int,
    run_id: str | None = None,
) -> Path:
    """Write ``root/step-<step>`` atomically (collective); keep the newest ``keep_last`` of
    this run's (``run_id``'s) checkpoints, never touching another run's. Each rank writes
    only its own pieces (`local_state`). A failure on any rank raises `CheckpointSaveError`
    on every rank."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    state = local_state(optimizer, layout)
    trainer_state = {**trainer_state, "optimizer_steps": optimizer.step_count}
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(
        rng, rng_state(optimizer.shards[0].param.device), group=layout.host_group
    )
    problem = None
    if layout.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{TMP_PREFIX}{PREFIX}*"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as error:
            problem = f"cannot write checkpoint {tmp}: {error}"
    _agree(problem, layout)
    line = ProgressLine(f"saving {final} (rank 0's part)", len(state),
                        enabled=None if layout.rank == 0 else False)  # fmt: skip
    try:
        chunks.save(state, tmp, line)
    except Exception as error:  # DCP raises on every rank when any rank failed to write
        raise CheckpointSaveError(f"cannot write checkpoint {tmp}: {error}") from error
    line.close()
    if layout.rank == 0:
        try:
            _finish(tmp, final, root, trainer_state, rng, model_config, config_toml, run_id)
            if keep_last > 0 and run_id is not None:
                mine = [c for c in list_checkpoints(root) if checkpoint_run(c) == run_id]
                for old in mine[keep_last:]:
                    shutil.rmtree(old, ignore_errors=True)
        except OSError as error:
            problem = f"cannot write checkpoint {final}: {error}"
    _agree(problem, layout)
    return final


def _finish(tmp, final, root, trainer_state, rng, model_config, config_toml, run_id) -> None:
    """Rank 0's part of a save: trainer state, configs, manifest, then the rename."""
    torch.save({**trainer_state, "rng": rng}, tmp / TRAINER_STATE)
    with open(tmp / "config.json", "w") as f:
        json.dump(config_to_hf(model_config), f, indent=2, sort_keys=True)
    (tmp / "train.toml").write_text(config_toml)
    _write_manifest(tmp, run_id)
    if final.exists():
        owner = checkpoint_run(final)
        if owner is not None and owner != run_id:
            raise FileExistsError(f"{final} belongs to run {owner}, not to this run {run_id}")
        shutil.rmtree(final)
    os.rename(tmp, final)


# ------------------------------------------------------------------ load
def _metadata(folder: str | os.PathLike) -> dict[str, TensorStorageMetadata]:
    return chunks.tensor_metadata(chunks.CachedReader(folder).read_metadata())


def check_keys(folder: str | os.PathLike, wanted: dict[str, tuple[int, ...]]) -> None:
    """`CheckpointError` naming every key of ``wanted`` (key -> global shape) the checkpoint
    lacks or holds at another shape."""
    stored = _metadata(folder)
    problems = [f"{key}: missing (expected {list(shape)})" for key, shape in wanted.items()
                if key not in stored]  # fmt: skip
    problems += [
        f"{key}: expected {list(shape)}, found {list(stored[key].size)}"
        for key, shape in wanted.items()
        if key in stored and tuple(stored[key].size) != tuple(shape)
    ]
    if problems:
        listed = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more"
                                                if len(problems) > 12 else "")  # fmt: skip
        raise CheckpointError(f"checkpoint {folder} does not match this model:\n  {listed}")


def validate_training_checkpoint(folder: str | os.PathLike, config: ModelConfig) -> None:
    """Check a training checkpoint's parameters against ``config`` from DCP's metadata
    alone (no process group); `CheckpointError` names each key and both shapes."""
    wanted = {f"model.{n}": tuple(s) for n, s in expected_state_shapes(config).items()}
    if config.tie_word_embeddings:
        wanted.pop("model.lm_head.weight", None)
    check_keys(folder, wanted)


def load_checkpoint(
    folder: str | os.PathLike, optimizer: ShardedAdamW, layout: Layout
) -> dict[str, Any]:
    """Load ``folder``'s optimizer state into the slices this rank owns (collective; the
    parameters were read from it when the part was built); return its trainer state
    (step, loader position, RNG states).

    AdamW resumes at its own step count (``optimizer_steps``), which trails the trainer's
    step after skipped steps; a checkpoint written before it was recorded counts one per
    trainer step."""
    folder = Path(folder)
    trainer_state = torch.load(folder / TRAINER_STATE, weights_only=False)
    step = int(trainer_state.get("optimizer_steps", trainer_state["step"]))
    stored = _metadata(folder)
    state: dict[str, Chunk] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for s in optimizer.shards:
        targets = {}
        if s.keeps_master and f"optim.{s.name}.master" in stored:
            targets["master"] = s.master
        if step > 0:
            moments[s.name] = {k: optimizer.zero_moment(s) for k in ("exp_avg", "exp_avg_sq")}
            targets.update(moments[s.name])
        for key, piece in targets.items():
            chunk = state_chunk(s, layout, piece)
            if chunk is not None:
                state[f"optim.{s.name}.{key}"] = chunk
    check_keys(folder, {key: tuple(chunk.size()) for key, chunk in state.items()})
    if layout.rank == 0:
        for change in precision_changes(stored, optimizer):
            print(f"resuming {folder.name}: {change}", flush=True)
    chunks.load(state, reader=chunks.CachedReader(folder))
    for s in optimizer.shards:
        if s.name in moments:
            optimizer.optimizer.state[s.master] = {
                **moments[s.name],
                "step": torch.tensor(float(step)),  # AdamW keeps it on CPU
            }
    return trainer_state


def precision_changes(
    stored: dict[str, TensorStorageMetadata], optimizer: ShardedAdamW
) -> list[str]:
    """How the checkpoint's optimizer precision differs from this run's, each change as it
    is converted on load: moments are read into ``optim.state_dtype`` (DCP copies them
    into the run's tensors), masters are read when both keep them, else dropped or started
    from the parameters."""
    changes = []
    moments = {md.properties.dtype for k, md in stored.items() if k.endswith(".exp_avg")}
    want = optimizer.state_dtype
    for dtype in sorted(moments - {want}, key=str):
        changes.append(
            f"optim.state_dtype: the checkpoint's moments are {str(dtype)[6:]}, this run "
            f"keeps {str(want)[6:]}: converted on load"
        )
    if any(s.param.dtype != torch.float32 for s in optimizer.shards):
        saved = any(k.endswith(".master") for k in stored)
        if saved and not optimizer.master_weights:
            changes.append(
                "optim.master_weights: the checkpoint holds float32 masters, this run keeps "
                "none: training goes on from the 16-bit parameters (the masters are not read)"
            )
        elif optimizer.master_weights and not saved:
            changes.append(
                "optim.master_weights: the checkpoint holds no float32 masters, this run "
                "keeps them: they start from the 16-bit parameters"
            )
    return changes


def load_model_state(folder: str | os.PathLike, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's state dict (our naming) from a checkpoint, in one process."""
    stored = _metadata(folder)
    shapes = expected_state_shapes(config)
    names = [n for n in shapes if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    validate_training_checkpoint(folder, config)
    out = {n: torch.empty(shapes[n], dtype=stored[f"model.{n}"].properties.dtype) for n in names}
    state = {f"model.{n}": Chunk(out[n], (0,) * len(shapes[n]), tuple(shapes[n])) for n in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        chunks.load(state, folder, collective=False)
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ------------------------------------------------------------------ as a source
class TrainingCheckpointWeights:
    """A training checkpoint's parameters as a weight source (`models.network.weights`): a rank
    reads only its rows of each ``model.<name>``, straight into its parameter, from the
    DCP chunks that overlap them (whatever layout saved it). Picklable; no process group
    needed."""

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


# ------------------------------------------------------------------ RNG
def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every generator this rank draws from: the host's, and ``device``'s when a GPU."""
    import random  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}  # fmt: skip
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_initialized():  # a CUDA rank's own generator
        torch.cuda.set_rng_state(state["cuda"])
