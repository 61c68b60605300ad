"""Which DualPipeV layouts of a model fit which GPUs: the search behind `twinpipe plan`.

The question every estimator's users ask (Megatron-LM issues #4050 and #1784) is not "how
much memory does this layout take" but "which layout fits my GPUs". `plan` enumerates
every layout the code can run on ``gpus`` ranks for a global batch:

- ``PP`` dividing the GPUs with ``2 * PP`` stages no more than the layers, ``DP = GPUs /
  PP``, ``EP`` dividing ``DP`` and the expert count;
- a micro-batch size dividing the sequences of one DP rank, ``M`` the micro-batches that
  make up the global batch (DualPipeV needs ``M >= 2 * PP``);
- FSDP2 on or off (on only where ``DP > 1``; off with torch's AdamW, which runs
  unsharded);
- attention recomputation on or off for the optimized stack (`EstimateConfig.recompute`;
  the reference never recomputes).

Each is estimated on the partition the stack will run: the optimized runner's, chosen by
the estimator (`choose_partition`, with the runner's settings: `default_partition`), the
reference's even split. Each is reported with its largest per-rank peak and whether it
fits the GPU memory less a margin, DualPipeV's bubble from the simulated schedule
(`optimized.estimator.bubble`) and the bytes each rank sends per step, by the
communication model (`optimized.estimator.communication`: all-to-all, point-to-point and
DP/FSDP collectives, exact for balanced routing). Layouts that fit sort by bubble, then
by communication, then recompute off before on (the same layout does less work without
it). The bubble stays in schedule units (F, B, W, `optimized.estimator.bubble`): with
recompute each B also reruns the layers' attention-block forward, a cost the F/B/W model
has no figure for, so it is noted (``recompute_attention``), not timed.
When none fits, `smallest_change` names the nearest change that would: more GPUs, a
shorter sequence, FSDP, or recomputing attention.

A layout whose static bytes alone (weights, gradients, optimizer state: a lower bound on
its largest peak under any partition) exceed the budget is not searched for a partition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from models.network import ModelConfig
from optimized.estimator.bubble import simulate
from optimized.estimator.communication import (
    PLAN_KINDS,
    bytes_sent_by_plan_kind,
    predict_traffic,
)
from optimized.estimator.config import EstimateConfig
from optimized.estimator.memory import static_bytes
from optimized.estimator.params import model_params
from optimized.estimator.ranks import estimate_ranks

OPTIMIZERS = ("train", "adamw")
FSDP_CHOICES = ("auto", "on", "off")
RECOMPUTE_CHOICES = ("auto", "on", "off")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """``80GiB``, ``80GB``, ``512MiB``, ``1e9`` -> bytes (GB is 10^9, GiB 2^30)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"--gpu-memory={text!r} is not a size; expected a number with an optional unit "
            f"({', '.join(u for u in _UNITS if u)}), e.g. 80GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(slots=True)
class PlanRequest:
    """What `twinpipe plan` is asked: a model, a machine and a batch."""

    model: ModelConfig
    """The network's shapes."""
    gpus: int
    """Ranks (GPUs) the job may use."""
    gpu_memory: int
    """Bytes of memory per GPU."""
    seq_len: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per step over all data-parallel ranks."""
    stack: str = "optimized"
    """Whose memory: ``optimized`` (what `twinpipe train` runs) or ``reference``."""
    margin: float = 0.1
    """Share of the GPU memory kept free (allocator fragmentation, buffers not modelled)."""
    dtype: str | None = None
    """Parameter and activation dtype; None: `twinpipe train`'s (its ``dtype`` default)."""
    optimizer: str = "train"
    """``train``: `twinpipe train`'s AdamW, as the trainer's config has it by default
    (`optimized.train.sizing`: float32 moments and masters, state sharded over DP with FSDP2
    and not without); ``adamw``: torch's AdamW, unsharded, moments in the parameter dtype
    (what `twinpipe compare` runs for the plain stacks), FSDP off."""
    fsdp: str = "auto"
    """``auto`` tries FSDP2 on and off (off only with ``optimizer="adamw"``, which runs
    unsharded), ``on`` / ``off`` only that."""
    recompute: str = "auto"
    """Attention recomputation in the optimized stack: ``auto`` tries on and off, ``on`` /
    ``off`` only that. The reference stack never recomputes (``auto`` or ``off``)."""

    def __post_init__(self) -> None:
        if self.dtype is None:
            from optimized.train.sizing import trainer_default

            self.dtype = trainer_default("dtype")

    def validate(self) -> None:
        def bad(name: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"--{name.replace('_', '-')}={value!r} is invalid: {valid}")

        for name in ("gpus", "gpu_memory", "seq_len", "global_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, value, "expected a positive integer")
        if not 0 <= self.margin < 1:
            raise bad("margin", self.margin, "expected a fraction in [0, 1)")
        if self.optimizer not in OPTIMIZERS:
            raise bad("optimizer", self.optimizer, f"expected one of {OPTIMIZERS}")
        if self.fsdp not in FSDP_CHOICES:
            raise bad("fsdp", self.fsdp, f"expected one of {FSDP_CHOICES}")
        if self.optimizer == "adamw" and self.fsdp == "on":
            raise bad("fsdp", self.fsdp, "torch's AdamW runs unsharded; use --optimizer train")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise bad("recompute", self.recompute, f"expected one of {RECOMPUTE_CHOICES}")
        if self.stack == "reference" and self.recompute == "on":
            raise bad("recompute", self.recompute, "the reference stack never recomputes; "
                      "expected 'auto' or 'off', or --stack optimized")  # fmt: skip
        # The stack and dtype are checked by EstimateConfig on the first layout.
        EstimateConfig(self.model, stack=self.stack, dtype=self.dtype, num_microbatches=2,
                       seq_len=self.seq_len, pp=1)  # fmt: skip

    @property
    def budget(self) -> int:
        """Bytes a rank's peak may reach."""
        return int(self.gpu_memory * (1 - self.margin))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fsdp_options(request: PlanRequest) -> tuple[bool, ...]:
    """FSDP2 settings to try: ``auto`` is both with the trainer's optimizer and off with
    torch's AdamW (unsharded: `validate` refuses ``on``)."""
    if request.fsdp == "auto":
        return (False, True) if request.optimizer == "train" else (False,)
    return (request.fsdp == "on",)


def recompute_options(request: PlanRequest) -> tuple[bool, ...]:
    """Recompute settings to try (off first: it does less work). The reference: off."""
    if request.stack == "reference":
        return (False,)
    return {"auto": (False, True), "on": (True,), "off": (False,)}[request.recompute]


def layouts(request: PlanRequest) -> list[EstimateConfig]:
    """Every layout the code can run for the request (see the module docstring)."""
    m = request.model
    has_moe = m.num_experts > 0 and any(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    out = []
    for pp in _divisors(request.gpus):
        if 2 * pp > m.num_hidden_layers:
            continue
        dp = request.gpus // pp
        if request.global_batch % dp:
            continue
        per_rank = request.global_batch // dp
        eps = [ep for ep in _divisors(dp) if not has_moe or m.num_experts % ep == 0]
        if not has_moe:
            eps = [1]
        for ep in eps:
            for mbs in _divisors(per_rank):
                micro_batches = per_rank // mbs
                if micro_batches < 2 * pp:
                    continue
                for fsdp in fsdp_options(request):
                    if fsdp and dp == 1:
                        continue
                    for recompute in recompute_options(request):
                        batch = (pp, dp, ep, mbs, micro_batches)
                        out.append(_layout(request, batch, fsdp, recompute))
    return out


def _layout(
    request: PlanRequest, batch: tuple[int, ...], fsdp: bool, recompute: bool
) -> EstimateConfig:
    """One layout: ``batch`` is (PP, DP, EP, micro-batch size, M). With the trainer's
    optimizer it is the trainer's run of those settings (`optimized.train.sizing`, its
    defaults for the rest); with torch's AdamW, `twinpipe compare`'s unsharded stacks."""
    pp, dp, ep, mbs, micro_batches = batch
    if request.optimizer == "train":
        from optimized.train.sizing import estimate_config, training_run

        run = training_run({
            "parallel.pp": pp, "parallel.dp": dp, "parallel.ep": ep, "parallel.fsdp": fsdp,
            "parallel.recompute": recompute, "data.micro_batch_size": mbs,
            "data.micro_batches": micro_batches, "data.seq_len": request.seq_len,
            "dtype": request.dtype,
        })  # fmt: skip
        return estimate_config(run, request.model, request.stack)
    return EstimateConfig(
        request.model, pp=pp, dp=dp, ep=ep, micro_batch_size=mbs, seq_len=request.seq_len,
        num_microbatches=micro_batches, dtype=request.dtype, stack=request.stack, fsdp=False,
        shard_optimizer=False, optimizer_state_dtype="param", master_weights=False,
        recompute=recompute,
    )  # fmt: skip


def static_lower_bound(config: EstimateConfig) -> int:
    """A lower bound on the largest per-rank peak under any partition: the ranks' static
    bytes together, over PP (every parameter is on one pp-rank)."""
    _, weights, gradients, optimizer = static_bytes(config, model_params(config))
    return (weights + gradients + optimizer) // config.pp


@dataclass(slots=True)
class PlannedLayout:
    """One layout with its memory, bubble and communication."""

    config: EstimateConfig
    largest_peak: int | None
    """Bytes of the largest per-rank peak (None: not searched, see ``lower_bound``)."""
    lower_bound: int
    fits: bool
    partition: list[int] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    bubble: dict[str, Any] = field(default_factory=dict)
    traffic: dict[str, int] = field(default_factory=dict)

    @property
    def traffic_total(self) -> int:
        return sum(self.traffic.values())

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "pp": c.pp, "dp": c.dp, "ep": c.ep, "micro_batch_size": c.micro_batch_size,
            "num_microbatches": c.num_microbatches, "fsdp": c.fsdp,
            "recompute_attention": c.stack == "optimized" and c.recompute,
            "layers_per_stage": list(self.partition), "largest_peak_bytes": self.largest_peak,
            "peak_bytes_per_rank": list(self.peaks), "static_lower_bound_bytes": self.lower_bound,
            "fits": self.fits, "bubble": dict(self.bubble),
            "bytes_sent_per_step": {**self.traffic, "total": self.traffic_total},
        }  # fmt: skip


def run_partition(config: EstimateConfig) -> list[range]:
    """The layer ranges the stack runs this layout with: the optimized runner chooses them
    by estimate with its own settings (`optimized.pipeline.runner.default_partition`: no
    FSDP, torch's AdamW), the reference splits evenly."""
    from optimized.pipeline.partition import stage_layers

    runner = EstimateConfig(
        config.model, pp=config.pp, dp=config.dp, ep=config.ep,
        micro_batch_size=config.micro_batch_size, seq_len=config.seq_len,
        num_microbatches=config.num_microbatches, dtype=config.dtype, stack=config.stack,
        recompute=config.recompute,
    )  # fmt: skip
    return stage_layers(runner)


def evaluate(config: EstimateConfig, budget: int, partitions: dict | None = None) -> PlannedLayout:
    """Estimate one layout on the partition it runs with (skipped when static bytes alone
    exceed ``budget``); bubble and traffic for layouts that fit. ``partitions`` caches the
    runner's partitions (FSDP on and off share one; recompute on and off do not)."""
    bound = static_lower_bound(config)
    if bound > budget:
        return PlannedLayout(config, None, bound, False)
    key = (config.pp, config.dp, config.ep, config.micro_batch_size, config.num_microbatches,
           config.recompute)  # fmt: skip
    partitions = {} if partitions is None else partitions
    if key not in partitions:
        partitions[key] = run_partition(config)
    partition = partitions[key]
    peaks = [rank.peak_bytes for rank in estimate_ranks(config, partition)]
    planned = PlannedLayout(
        config, max(peaks), bound, max(peaks) <= budget, [len(s) for s in partition], peaks
    )
    if planned.fits:
        planned.bubble = simulate(config.pp, config.num_microbatches).as_dict()
        # Each pp-rank's first DP rank (its DP peers send as much, but for routing's skew);
        # with the trainer's optimizer, the step is `twinpipe train`'s (its own collective).
        trainer = config.blocked_update
        per_rank = [
            bytes_sent_by_plan_kind(
                predict_traffic(config, rank * config.dp, partition, trainer=trainer)
            )
            for rank in range(config.pp)
        ]
        planned.traffic = {kind: max(t[kind] for t in per_rank) for kind in PLAN_KINDS}
    return planned


def plan(request: PlanRequest) -> list[PlannedLayout]:
    """Every layout, evaluated: those that fit first (by bubble, then bytes sent, then
    recompute off before on: less work for the same schedule), then the rest by largest
    peak (or its lower bound)."""
    request.validate()
    partitions: dict = {}
    planned = [evaluate(config, request.budget, partitions) for config in layouts(request)]
    fitting = sorted(
        (p for p in planned if p.fits),
        key=lambda p: (
            p.bubble["idle_fraction"],
            p.traffic_total,
            p.config.recompute,
            p.largest_peak,
        ),
    )
    rest = sorted(
        (p for p in planned if not p.fits),
        key=lambda p: p.largest_peak if p.largest_peak is not None else p.lower_bound,
    )
    return fitting + rest


def smallest_change(request: PlanRequest, max_factor: int = 64) -> list[str]:
    """When nothing fits: the nearest changes that would (each found by planning again)."""
    changes = []
    if request.fsdp == "off" and request.optimizer == "train":
        on = _replace(request, fsdp="auto")
        if _first_fit(on):
            changes.append("turn FSDP on (--fsdp auto)")
    if request.recompute == "off" and request.stack == "optimized":
        found = _first_fit(_replace(request, recompute="on"))
        if found is not None:
            changes.append(f"recompute attention (--recompute on: {_describe(found)})")
    gpus = request.gpus * 2
    while gpus <= request.gpus * max_factor:
        found = _first_fit(_replace(request, gpus=gpus))
        if found is not None:
            changes.append(f"{gpus} GPUs ({_describe(found)})")
            break
        gpus *= 2
    seq = request.seq_len // 2
    while seq >= 1:
        found = _first_fit(_replace(request, seq_len=seq))
        if found is not None:
            changes.append(f"--seq-len {seq} ({_describe(found)})")
            break
        seq //= 2
    return changes


def _replace(request: PlanRequest, **changes: Any) -> PlanRequest:
    fields = {name: getattr(request, name) for name in PlanRequest.__slots__}
    fields.update(changes)
    return PlanRequest(**fields)


def _first_fit(request: PlanRequest) -> PlannedLayout | None:
    """A fitting layout of ``request``, trying the smallest lower bounds first."""
    candidates = sorted(layouts(request), key=static_lower_bound)
    partitions: dict = {}
    for config in candidates:
        planned = evaluate(config, request.budget, partitions)
        if planned.fits:
            return planned
    return None


def _describe(planned: PlannedLayout) -> str:
    c = planned.config
    recompute = c.recompute and c.stack == "optimized"
    return (
        f"PP{c.pp} DP{c.dp} EP{c.ep} mbs{c.micro_batch_size} M{c.num_microbatches}"
        f"{' FSDP' if c.fsdp else ''}{' recompute' if recompute else ''}"
    )


__all__ = [
    "PlanRequest",
    "RECOMPUTE_CHOICES",
    "PlannedLayout",
    "evaluate",
    "layouts",
    "parse_size",
    "plan",
    "run_partition",
    "smallest_change",
    "static_lower_bound",
]
