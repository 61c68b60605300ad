"""Training checkpoints: layout-free, written atomically, verified before they are trusted.

On-disk format (one folder ``step-00000020`` per checkpoint under the checkpoint dir):

- a `torch.distributed.checkpoint` (DCP) of *whole-model* tensors under the whole-model
  names: ``model.<name>`` for every parameter, routed experts as whole ``[E, ...]``
  tensors, and ``optim.<name>.exp_avg`` / ``.exp_avg_sq`` (and ``.master``, the float32
  copy, when parameters are bfloat16) with the parameter's shape. Each rank gathers its
  FSDP2 parameter rows and its optimizer slices over their replica group (DP, or the
  expert replicas), then its expert shards over its EP group; every rank hands DCP its
  part, and DCP keeps one copy of what DP replicas share. Nothing on
  disk depends on PP, DP or EP, so a checkpoint saved at one layout loads at any other;
- ``trainer_state.pt``: the step, the data loader's position, every rank's RNG states;
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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from models.config import ModelConfig
from models.distributed import Layout
from models.model import is_expert_parameter
from optimized.train import chunks
from optimized.train.optimizer import ParamShard, ShardedAdamW, gather_slices

MANIFEST = "manifest.json"
RUN_FILE = "run.json"
TRAINER_STATE = "trainer_state.pt"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


# ------------------------------------------------------------------ gathering
def _gather_experts(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Whole ``[E, ...]`` from this EP group's shards (dim 0 is the local experts)."""
    if layout.ep == 1:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(layout.ep)]
    dist.all_gather(pieces, tensor.contiguous(), group=layout.ep_group)
    return torch.cat(pieces)


def _local_experts(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This EP rank's experts of a whole ``[E, ...]`` tensor."""
    per_rank = tensor.shape[0] // layout.ep
    return tensor[layout.ep_rank * per_rank : (layout.ep_rank + 1) * per_rank]


def _whole(tensor: torch.Tensor, name: str, layout: Layout) -> torch.Tensor:
    return _gather_experts(tensor, layout) if is_expert_parameter(name) else tensor


def full_state_dict(optimizer: ShardedAdamW, layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's contribution to the layout-free state dict (collective over the world)."""
    state: dict[str, torch.Tensor] = {}
    for s in optimizer.shards:
        state[f"model.{s.name}"] = _whole(optimizer.full_parameter(s), s.name, layout).clone()
        for key, piece in optimizer.state_tensors(s).items():
            whole = gather_slices(piece, s).view(s.param.shape)
            state[f"optim.{s.name}.{key}"] = _whole(whole, s.name, layout).clone()
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
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as error:
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
        run = json.loads(path.read_text())
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
    dist.broadcast_object_list(box, src=0)
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
    this run's (``run_id``'s) checkpoints, never touching another run's. A failure on any
    rank raises `CheckpointSaveError` on every rank."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    state = full_state_dict(optimizer, layout)
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, rng_state())
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
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except Exception as error:  # DCP raises on every rank when any rank failed to write
        raise CheckpointSaveError(f"cannot write checkpoint {tmp}: {error}") from error
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
        json.dump(model_config.to_hf(), f, indent=2, sort_keys=True)
    (tmp / "train.toml").write_text(config_toml)
    _write_manifest(tmp, run_id)
    if final.exists():
        owner = checkpoint_run(final)
        if owner is not None and owner != run_id:
            raise FileExistsError(f"{final} belongs to run {owner}, not to this run {run_id}")
        shutil.rmtree(final)
    os.rename(tmp, final)


# ------------------------------------------------------------------ load
def _placeholders(folder: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Empty tensors of the stored shapes and dtypes for those ``keys`` the checkpoint has."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {
        key: torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype)
        for key in keys
        if key in metadata
    }


def load_checkpoint(
    folder: str | os.PathLike, optimizer: ShardedAdamW, layout: Layout
) -> dict[str, Any]:
    """Load ``folder`` into this rank's parameters and optimizer slices; return its trainer
    state (step, loader position, RNG states)."""
    folder = Path(folder)
    keys = []
    for s in optimizer.shards:
        keys += [f"model.{s.name}"] + [f"optim.{s.name}.{k}" for k in _OPTIM_KEYS]
    state = _placeholders(folder, keys)
    missing = [f"model.{s.name}" for s in optimizer.shards if f"model.{s.name}" not in state]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {', '.join(missing[:8])}")
    dcp.load(state, checkpoint_id=str(folder))
    trainer_state = torch.load(folder / TRAINER_STATE, weights_only=False)
    step = int(trainer_state["step"])
    with torch.no_grad():
        for s in optimizer.shards:
            optimizer.set_parameter(s, _mine(state[f"model.{s.name}"], s, layout))
        optimizer.reset_masters()
        for s in optimizer.shards:
            full = {
                k: _mine(state[f"optim.{s.name}.{k}"], s, layout)
                for k in _OPTIM_KEYS
                if f"optim.{s.name}.{k}" in state
            }
            optimizer.load_state(s, full, step)
    return trainer_state


_OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "master")


def _mine(tensor: torch.Tensor, s: ParamShard, layout: Layout) -> torch.Tensor:
    return _local_experts(tensor, layout) if is_expert_parameter(s.name) else tensor


def load_model_state(folder: str | os.PathLike, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's state dict (our naming) from a checkpoint, in one process."""
    from models.hf_layout import expected_state_shapes  # noqa: PLC0415

    folder = Path(folder)
    names = list(expected_state_shapes(config))
    state = _placeholders(folder, [f"model.{n}" for n in names])
    if config.tie_word_embeddings and "model.lm_head.weight" not in state:
        names.remove("lm_head.weight")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    out = {name: state[f"model.{name}"] for name in names}
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ------------------------------------------------------------------ as a source
class TrainingCheckpointWeights:
    """A training checkpoint's parameters as a weight source (`models.weights`): a rank
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
def rng_state() -> dict[str, Any]:
    import random  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
