"""The dashboard's data: benchmark runs paired into optimized-against-plain series per op,
and compare runs' memory and agreement per commit (`harness.history.dashboard` says how).

A series never mixes devices: times and peaks measured on a GPU and on a CPU differ by
their nature, not by a change (`twinpipe diff` refuses the pair for the same reason). An op
variant measured on a device other than the CPU is its own series, named after the device
(``variant on cuda (NVIDIA H100 80GB HBM3)``); compare runs carry their device, and the page
draws one section per device.

A CPU run's Triton kernels ran through Triton's interpreter, so its optimized times are no
speed measurement: each point says whether that was so (`triton_interpreted`), and the page
marks it rather than colour a speed-up no kernel earned.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from harness.history.documents import classify, document_device

PLAIN_WORDS = ("plain", "reference", "torch", "baseline", "eager", "naive")
OPTIMIZED_WORDS = ("optimized", "fused", "triton", "liger", "fast")
ROLE_KEYS = ("implementation", "impl", "role", "side", "provider")
PEAK_KEYS = ("peak_bytes", "peak_memory_bytes")
OPTIMIZED_COLOR, PLAIN_COLOR = "#c44e52", "#4c72b0"


# ---------------------------------------------------------------------- collecting


@dataclass
class OpPoint:
    """One op variant in one benchmark run."""

    run: int
    commit: str
    date: str
    optimized_time: float | None = None
    plain_time: float | None = None
    optimized_peak: float | None = None
    plain_peak: float | None = None
    # Further implementations of the op (e.g. a second plain one): name -> figures.
    others: dict[str, dict[str, Any]] = field(default_factory=dict)
    interpreted: bool = False
    """The optimized implementation's Triton kernels ran through Triton's interpreter."""

    @property
    def speedup(self) -> float | None:
        if self.optimized_time and self.plain_time:
            return self.plain_time / self.optimized_time
        return None

    @property
    def memory_ratio(self) -> float | None:
        if self.optimized_peak is not None and self.plain_peak:
            return self.optimized_peak / self.plain_peak
        return None


@dataclass
class CompareRun:
    """The figures of one compare report drawn on the dashboard."""

    run: int
    commit: str
    date: str
    passed: bool
    loss_rel_error: float | None
    grad_one_minus_cos: float | None
    grad_rel_error: float | None
    ranks: dict[int, dict[str, float | None]] = field(default_factory=dict)
    tolerance: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    """Where the run's ranks computed (`entry_device`)."""


def entry_device(entry: dict[str, Any]) -> str:
    """The device a history entry's figures were measured on, as the page names it: ``cpu``,
    or the type and the name (``cuda (NVIDIA H100 80GB HBM3)``). Benchmark runs that name no
    device and compare reports written before the device was recorded ran on CPUs."""
    kind, payload = classify(entry)
    device = document_device(kind, payload) if kind else None
    if device is None or device[0] == "cpu":
        return "cpu"
    return f"{device[0]} ({device[1]})" if device[1] else device[0]


def triton_interpreted(bench: dict[str, Any], device: str) -> bool:
    """Whether a benchmark's Triton kernels ran through Triton's interpreter.

    ``extra_info["triton"]`` (``interpreter`` or ``compiled``) and ``triton_launches`` (the
    kernels one run launched) say so where `benchmarks/_common.py` recorded them: an op that
    launched no kernel measured plain torch, a real CPU time. A run recorded before them is
    presumed interpreted when it ran on the CPU (`entry_device`), where every Triton kernel
    is interpreted."""
    extra = bench.get("extra_info") or {}
    mode = extra.get("triton")
    if mode in ("interpreter", "compiled"):
        launches = extra.get("triton_launches")
        return mode == "interpreter" and (not isinstance(launches, int) or launches > 0)
    return device == "cpu"


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\[\]\-_,\s/.]+", text.lower()) if t]


def benchmark_implementation(bench: dict[str, Any]) -> str | None:
    """The implementation a benchmark names (``extra_info`` first, then its parameters)."""
    for source in (bench.get("extra_info") or {}, bench.get("params") or {}):
        for key in ROLE_KEYS:
            if isinstance(source.get(key), str):
                return source[key]
    return None


def benchmark_role(bench: dict[str, Any]) -> str:
    """'plain' for a plain counterpart, 'optimized' for everything else."""
    implementation = benchmark_implementation(bench)
    if implementation is not None:
        words = _tokens(implementation)
    else:
        params = bench.get("params") or {}
        words = [str(v).lower() for v in params.values()] + _tokens(str(bench.get("name", "")))
    return "plain" if any(word in PLAIN_WORDS for word in words) else "optimized"


def benchmark_op_and_variant(bench: dict[str, Any]) -> tuple[str, str]:
    """The op a benchmark measures and its variant (shape parameters).

    Role words, the implementation's name and the op's own name are left out of
    the variant, so ``test_act[silu-plain_float32]`` of op ``silu`` has variant ''.
    """
    name = str(bench.get("name") or bench.get("fullname") or "?")
    base, _, bracket = name.partition("[")
    role_words = set(PLAIN_WORDS) | set(OPTIMIZED_WORDS)
    group = bench.get("group") or (bench.get("extra_info") or {}).get("op")
    if group:
        op = str(group)
    else:
        base = base.removeprefix("test_")
        op = "_".join(t for t in base.split("_") if t.lower() not in role_words) or base
    skip = role_words | set(_tokens(op)) | set(_tokens(benchmark_implementation(bench) or ""))
    variant = "-".join(t for t in _tokens(bracket) if t not in skip)
    return op, variant


def peak_bytes(bench: dict[str, Any]) -> float | None:
    extra = bench.get("extra_info") or {}
    for key in PEAK_KEYS:
        if isinstance(extra.get(key), (int, float)) and not isinstance(extra[key], bool):
            return float(extra[key])
    for key, value in extra.items():
        if (
            "bytes" in key.lower()
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ):
            return float(value)
    return None


def collect_ops(entries: list[dict[str, Any]]) -> dict[str, dict[str, list[OpPoint]]]:
    """op -> variant -> one point per benchmark run that measured it.

    Of several implementations with one role (``plain`` and ``plain_float32``),
    the one named after the role, else the first, is the pair's; the rest are
    kept in ``OpPoint.others``. A variant measured off the CPU is named after its device
    (`entry_device`), so a CPU series and a GPU series of one op stay apart.
    """
    ops: dict[str, dict[str, list[OpPoint]]] = defaultdict(lambda: defaultdict(list))
    runs = [e for e in entries if e.get("kind") == "bench"]
    for run, entry in enumerate(runs):
        device = entry_device(entry)
        by_key: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(
            lambda: {"optimized": [], "plain": []}
        )
        for bench in (entry.get("benchmark") or {}).get("benchmarks") or []:
            if isinstance(bench, dict):
                by_key[benchmark_op_and_variant(bench)][benchmark_role(bench)].append(bench)
        for (op, variant), roles in by_key.items():
            point = OpPoint(run, str(entry.get("git_commit")), str(entry.get("date")))
            for role, benches in roles.items():
                benches = sorted(
                    benches, key=lambda b: (benchmark_implementation(b) or role).lower() != role
                )
                for index, bench in enumerate(benches):
                    median = (bench.get("stats") or {}).get("median")
                    if index == 0:
                        setattr(point, f"{role}_time", median)
                        setattr(point, f"{role}_peak", peak_bytes(bench))
                        if role == "optimized":
                            point.interpreted = triton_interpreted(bench, device)
                    else:
                        name = benchmark_implementation(bench) or str(bench.get("name"))
                        point.others[name] = {
                            "role": role,
                            "time": median,
                            "peak": peak_bytes(bench),
                        }
            if device != "cpu":
                variant = f"{variant} on {device}" if variant else f"on {device}"
            ops[op][variant].append(point)
    return {op: dict(variants) for op, variants in sorted(ops.items())}


def _max(values: Any) -> float | None:
    if not isinstance(values, list):
        return None
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    if any(math.isnan(v) for v in numbers):
        return math.nan
    return max(numbers) if numbers else None


def collect_compare(entries: list[dict[str, Any]]) -> list[CompareRun]:
    runs = []
    for entry in (e for e in entries if e.get("kind") == "compare"):
        report = entry.get("report") or {}
        ranks = {}
        for index, rank in enumerate((report.get("memory") or {}).get("ranks") or []):
            ranks[int(rank.get("rank", index))] = {
                "baseline": (rank.get("baseline") or {}).get("total"),
                "candidate": (rank.get("candidate") or {}).get("total"),
                "ratio": rank.get("ratio"),
            }
        runs.append(
            CompareRun(
                run=len(runs),
                commit=str(entry.get("git_commit") or report.get("git_commit")),
                date=str(entry.get("date")),
                passed=bool(report.get("passed")),
                loss_rel_error=_max((report.get("loss") or {}).get("rel_error")),
                grad_one_minus_cos=_max((report.get("grads") or {}).get("max_one_minus_cos")),
                grad_rel_error=_max((report.get("grads") or {}).get("max_rel_error")),
                ranks=ranks,
                tolerance=dict(report.get("tolerance") or {}),
                device=entry_device(entry),
            )
        )
    return runs
