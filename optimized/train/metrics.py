"""The metrics of `twinpipe train`: one `StepMetrics` per step, its log line, and the
`MetricsSink` that writes each step once to the JSON-lines file and TensorBoard (on resume,
records past the resumed step are dropped from the file before the steps run again).

`Throughput` turns tokens per second into TFLOP/s per device and MFU: the FLOPs per token
come from the model config (`optimized.estimator.flops`: every matrix product, 3x the
forward for forward and backward, attention over the keys a query sees under the causal
mask or window; HFU adds the recomputed attention), the peak from ``--peak-tflops`` or the
GPU's dense peak in the dtype the step multiplies in. On a CPU, or a GPU the table does not
know, there is no peak: TFLOP/s only.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from models.network import HostCopy, ModelConfig, host_side
from models.runtime import KINDS, Counts
from optimized.estimator.flops import TrainingFlops, known_gpu, training_flops
from optimized.train.config import TrainConfig


@dataclass(slots=True)
class StepMetrics:
    step: int
    """1-based step number."""
    steps: int
    step_time_s: float
    """Slowest rank's wall time for the step, on the host: the step reads the device once,
    before its update, so the device may finish the update while the next step starts
    (nothing waits for it; over many steps the times add up to the run's)."""
    loss: float
    learning_rate: float
    gradient_norm: float
    tokens_per_second: float
    peak_memory_bytes: int
    """Max over ranks: CUDA max_memory_allocated on GPU, the process's max RSS on CPU."""
    peak_memory_source: str
    skipped: bool = False
    communication_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes the step's collective and point-to-point calls moved, by kind, summed over all
    ranks (sent plus received, `models.runtime.communication`); the per-step metrics reduction is
    not counted."""
    z_loss: float | None = None
    """The step's mean z-loss when ``loss.z_loss`` is on (else None). ``loss`` is the
    objective minimised, z-loss included; the log line shows the two parts."""
    optimizer_state_bytes: int | None = None
    """Max over ranks: bytes of the AdamW state a rank holds after the step, its moments (in
    ``optim.state_dtype``) and the float32 masters kept apart from the parameters."""
    tflops: float | None = None
    """Model TFLOP/s per device: tokens per second x the model FLOPs per token (6N plus the
    attention, `optimized.estimator.flops`) / devices (ranks) / 1e12."""
    mfu: float | None = None
    """``tflops`` over the device's peak (``peak_tflops``); None without a peak (CPU)."""
    hardware_tflops: float | None = None
    """TFLOP/s per device with the recomputed attention counted (HFU's numerator)."""
    hfu: float | None = None
    """``hardware_tflops`` over the peak; None without a peak."""
    model_flops_per_token: float | None = None
    """The model FLOPs of one token's forward and backward (`TrainingFlops.model`)."""
    peak_tflops: float | None = None
    """The peak TFLOP/s of one device the MFU divides by; None on a CPU or an unknown GPU."""
    moe_layers: list[int] | None = None
    """The model's MoE layers: the rows of the per-layer figures below (None: a dense model).
    These figures are `optimized.train.expert_load`'s."""
    expert_load: list[list[int]] | None = None
    """Per MoE layer, the copies routed to each expert this step, over the global batch."""
    load_max_over_mean: list[float] | None = None
    """Per MoE layer, the busiest expert's load over the mean (1: balanced)."""
    load_max_over_mean_worst: float | None = None
    """The worst layer's ``load_max_over_mean``: the one the log line shows."""
    expert_bias_min: list[float] | None = None
    """Per MoE layer, the smallest expert bias the step routed with (``moe.expert_bias``)."""
    expert_bias_max: list[float] | None = None
    """Per MoE layer, the largest."""
    aux_loss: float | None = None
    """The step's load-balancing loss as the objective holds it (coefficient included; None
    when off). Not part of ``loss``, which stays the language-model loss."""
    router_z_loss: float | None = None
    """The step's router z-loss, coefficient included (``moe.z_loss_coef``; None when off)."""
    validation_loss: float | None = None
    """The held-out loss after this step's update (`optimized.train.evaluation`); None at a
    step that does not evaluate."""
    validation_perplexity: float | None = None
    """``exp(validation_loss)``."""
    mtp_loss: list[float] | None = None
    """Per MTP depth, its mean cross-entropy on its targets (`models.network.mtp`; None
    without MTP). Not part of ``loss``, which stays the main model's."""
    mtp_accuracy: list[float] | None = None
    """Per MTP depth, the share of its targets its top-1 prediction gets right (a proxy for
    speculative decoding's acceptance rate, as Megatron-Core logs it)."""

    def line(self) -> str:
        cross_entropy, z_loss = self.loss, ""
        if self.z_loss is not None:
            cross_entropy, z_loss = self.loss - self.z_loss, f"z-loss {self.z_loss:.4e} | "
        text = (
            f"step {self.step:08d}/{self.steps:08d} | step-time {self.step_time_s:.3f} sec | "
            f"cross-entropy-loss {cross_entropy:.4f} | {z_loss}"
            f"learning-rate {self.learning_rate:.6e} | "
            f"gradient-norm {self.gradient_norm:.4f} | "
            f"{self._load()}{self._mtp()}"
            f"tokens-per-second {self.tokens_per_second:,.0f} | "
            f"{self._throughput()}"
            f"peak-memory {self.peak_memory_bytes / 1e9:.2f} GB"
        )
        if self.validation_loss is not None:
            text += (f" | validation-loss {self.validation_loss:.4f} | "
                     f"validation-perplexity {self.validation_perplexity:.4g}")  # fmt: skip
        return text + (" | skipped (non-finite)" if self.skipped else "")

    def _load(self) -> str:
        worst = self.load_max_over_mean_worst
        return "" if worst is None else f"load-max/mean {worst:.2f} | "

    def _mtp(self) -> str:
        if self.mtp_loss is None:
            return ""
        losses = "/".join(f"{v:.4f}" for v in self.mtp_loss)
        accuracy = "/".join(f"{v:.1%}" for v in self.mtp_accuracy)
        return f"mtp-loss {losses} | mtp-accuracy {accuracy} | "

    def _throughput(self) -> str:
        if self.tflops is None:
            return ""
        mfu = "" if self.mfu is None else f" | mfu {self.mfu:.1%}"
        return f"tflops-per-device {self.tflops:.4g}{mfu} | "


class Throughput:
    """TFLOP/s per device and MFU from tokens per second (see the module docstring)."""

    def __init__(self, flops: TrainingFlops, devices: int, peak: float | None, source: str):
        self.flops, self.devices, self.peak, self.source = flops, devices, peak, source

    @classmethod
    def of(
        cls, cfg: TrainConfig, model: ModelConfig, device: torch.device, recompute: bool
    ) -> Throughput:
        """For a run of ``cfg`` on ranks computing on ``device``; ``recompute``: whether
        the runner reruns the attention blocks in backward."""
        flops = training_flops(model, cfg.data.seq_len, recompute)
        devices = cfg.parallel.world_size
        if cfg.logging.peak_tflops is not None:
            return cls(flops, devices, cfg.logging.peak_tflops, "logging.peak_tflops")
        if device.type != "cuda":
            return cls(flops, devices, None, f"the ranks compute on the {device.type}")
        name = torch.cuda.get_device_name(device)
        gpu = known_gpu(name)
        if gpu is None:
            return cls(flops, devices, None, f"{name} is not in the GPU peak table "
                       "(--peak-tflops gives one)")  # fmt: skip
        precision = _matmul_precision(cfg.dtype)
        return cls(flops, devices, getattr(gpu, precision),
                   f"{gpu.name}'s dense {precision} peak, GPU_PEAKS")  # fmt: skip

    def describe(self) -> str:
        """One line for the log's start."""
        text = f"throughput: {self.flops.model / 1e9:.4g} GFLOP per token"
        if self.flops.recompute:
            text += f" ({self.flops.hardware / 1e9:.4g} with the recomputed attention)"
        if self.peak is None:
            return f"{text}; TFLOP/s only, no MFU: {self.source}"
        return f"{text}; MFU against {self.peak:g} TFLOP/s per device ({self.source})"

    def figures(self, tokens_per_second: float) -> dict[str, float | None]:
        """`StepMetrics`' throughput fields for a step at ``tokens_per_second``."""
        model = tokens_per_second * self.flops.model / self.devices / 1e12
        hardware = tokens_per_second * self.flops.hardware / self.devices / 1e12
        ratio = (lambda value: value / self.peak) if self.peak else (lambda value: None)
        return {
            "tflops": model, "mfu": ratio(model), "hardware_tflops": hardware,
            "hfu": ratio(hardware), "model_flops_per_token": self.flops.model,
            "peak_tflops": self.peak,
        }  # fmt: skip


def _matmul_precision(dtype: str) -> str:
    """The peak a step's matrix products run at: bf16, or for float32 TF32 when torch
    allows it (``torch.set_float32_matmul_precision("high")``) and the CUDA cores if not."""
    if dtype == "bfloat16":
        return "bfloat16"
    return "float32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def step_traffic(counts: Counts, group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """Bytes moved this step by kind, summed over all ranks: one all-reduce of host values
    over ``group``, the layout's gloo host group (not counted; nothing touches the device)."""
    mine = [sum(t.bytes for (k, _), t in counts.items() if k == kind) for kind in KINDS]
    total = torch.tensor(mine, dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, group=group)
    with host_side():
        summed = total.tolist()
    return {kind: b for kind, b in zip(KINDS, summed, strict=True) if b}


def slowest_rank(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """The largest of each host value over all ranks (step time, peak memory, a stop
    signal, optimizer state bytes): one all-reduce over ``group``, the gloo host group."""
    shared = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
    with host_side():
        return shared.tolist()


class LoggedScalars:
    """The device's values a step logs (loss, gradient norm, z-loss, the expert load), read
    on the host in one copy through a buffer kept from step to step
    (`models.network.HostCopy`)."""

    def __init__(self) -> None:
        self.host = HostCopy()

    def read(self, *values: torch.Tensor | None) -> list[float | list[float] | None]:
        """Each 0-dim tensor of ``values`` as a float, each vector as a list of floats (None
        stays None); one read."""
        present = [v.detach().reshape(-1).to(torch.float64) for v in values if v is not None]
        if not present:
            return [None] * len(values)
        read = iter(self.host.tolist(torch.cat(present)))
        out: list[float | list[float] | None] = []
        for v in values:
            if v is None or v.dim() == 0:
                out.append(None if v is None else next(read))
            else:
                out.append([next(read) for _ in range(v.numel())])
        return out


class MetricsSink:
    """Rank 0's outputs: stdout lines, JSON lines, TensorBoard, a terminal progress bar."""

    def __init__(self, cfg: TrainConfig, enabled: bool, start: int = 0) -> None:
        self.enabled = enabled
        self.every = cfg.logging.log_every
        self.file = None
        self.writer = None
        self.bar = enabled and sys.stderr.isatty()
        if not enabled:
            return
        if cfg.logging.metrics_file:
            Path(cfg.logging.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            _drop_records_after(Path(cfg.logging.metrics_file), start)
            self.file = open(cfg.logging.metrics_file, "a")  # noqa: SIM115 - closed in close()
        if cfg.logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
            except ImportError as error:
                warnings.warn(f"TensorBoard is off: {error}", stacklevel=2)
            else:
                self.writer = SummaryWriter(cfg.logging.tensorboard_dir)

    def record(self, m: StepMetrics) -> None:
        logged = m.step % self.every == 0 or m.step == m.steps or m.validation_loss is not None
        if not self.enabled or not logged:
            return
        if self.bar:
            sys.stderr.write("\r\033[K")
        print(m.line(), flush=True)
        if self.file:
            self.file.write(json.dumps(asdict(m)) + "\n")
            self.file.flush()
        if self.writer:
            for key in ("loss", "z_loss", "learning_rate", "gradient_norm", "tokens_per_second",
                        "tflops", "mfu", "aux_loss", "router_z_loss",
                        "load_max_over_mean_worst", "validation_loss",
                        "validation_perplexity"):  # fmt: skip
                if getattr(m, key) is not None:
                    self.writer.add_scalar(key, getattr(m, key), m.step)
            self._load_scalars(m)
            for key in ("mtp_loss", "mtp_accuracy"):
                for depth, value in enumerate(getattr(m, key) or [], start=1):
                    self.writer.add_scalar(f"mtp/{key[4:]}/depth_{depth}", value, m.step)
        if self.bar:
            done = int(30 * m.step / m.steps)
            sys.stderr.write(f"[{'#' * done}{'.' * (30 - done)}] {m.step}/{m.steps}")
            sys.stderr.flush()

    def _load_scalars(self, m: StepMetrics) -> None:
        """Per MoE layer: the max/mean ratio and the bias range as scalars, the load over the
        experts as a histogram (``moe/<figure>/layer_<n>``)."""
        for row, layer in enumerate(m.moe_layers or []):
            for key in ("load_max_over_mean", "expert_bias_min", "expert_bias_max"):
                values = getattr(m, key)
                if values is not None:
                    self.writer.add_scalar(f"moe/{key}/layer_{layer}", values[row], m.step)
            load = torch.tensor(m.expert_load[row], dtype=torch.float64)
            self.writer.add_histogram(f"moe/expert_load/layer_{layer}", load, m.step)

    def close(self) -> None:
        if self.bar:
            sys.stderr.write("\n")
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


def _drop_records_after(path: Path, step: int) -> None:
    """Keep the metrics records of steps ``<= step`` (the steps this run does not redo), so
    no step is recorded twice; rewritten atomically, and only when something is dropped."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            record_step = None
        if isinstance(record_step, int) and record_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
        print(f"{path}: dropped {dropped} records after step {step}, which this run redoes",
              file=sys.stderr, flush=True)  # fmt: skip
