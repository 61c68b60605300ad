"""How `twinpipe diff` judges one figure: growth beyond a tolerance is a regression, a drop
an improvement, and a figure the old document has but the new one lacks a regression too
(what was not measured cannot pass). The rules, apart from the documents they read."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from deepdiff import DeepDiff


@dataclass(frozen=True)
class Tolerances:
    """Relative growth allowed before a change counts as a regression."""

    memory: float = 0.01
    time: float = 0.10
    error: float = 0.0


@dataclass
class DiffResult:
    """What changed between two documents, in words."""

    kind: str
    regressions: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.regressions

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def as_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def series_max(values: Any) -> float | None:
    """Largest value of a per-step series; NaN if any step is NaN; None if absent."""
    if not isinstance(values, list):
        return as_number(values)
    numbers = [as_number(v) for v in values]
    numbers = [v for v in numbers if v is not None]
    if not numbers:
        return None
    if any(math.isnan(v) for v in numbers):
        return math.nan
    return max(numbers)


def _percent(old: float, new: float) -> str:
    if old == 0:
        return "from zero"
    return f"{abs(new - old) / abs(old) * 100:.1f}%"


def judge(
    result: DiffResult,
    what: str,
    old: float | None,
    new: float | None,
    limit: float,
    show: Any = None,
    verb: tuple[str, str] = ("grew", "shrank"),
) -> None:
    """Growth beyond ``limit`` (relative) is a regression; a drop is an improvement; a
    figure the old document has and the new one lacks is a regression too."""
    if old is not None and new is None:
        result.regressions.append(
            f"{what} is missing from the new document (was {_show(old, show)}): "
            "what was not measured cannot pass"
        )
        return
    if old is None or new is None:
        if new is not None:
            result.changes.append(f"{what}: absent -> {_show(new, show)}")
        return
    if math.isnan(new) and not math.isnan(old):
        result.regressions.append(f"{what} became NaN (was {_show(old, show)})")
        return
    if math.isnan(old):
        if not math.isnan(new):
            result.improvements.append(f"{what} is no longer NaN ({_show(new, show)})")
        return
    values = f"({_show(old, show)} -> {_show(new, show)})"
    if new > old * (1 + limit) and new > old:
        result.regressions.append(
            f"{what} {verb[0]} {_percent(old, new)} {values}, limit {limit * 100:g}%"
        )
    elif new < old:
        result.improvements.append(f"{what} {verb[1]} {_percent(old, new)} {values}")
    elif new > old:
        result.changes.append(
            f"{what} {verb[0]} {_percent(old, new)} {values}, within {limit * 100:g}%"
        )


def _show(value: float | None, show: Any) -> str:
    if value is None:
        return "absent"
    if show is not None:
        return show(value)
    return f"{value:.4g}"


def format_seconds(value: float) -> str:
    if value < 1e-3:
        return f"{value * 1e6:.3g} us"
    if value < 1:
        return f"{value * 1e3:.3g} ms"
    return f"{value:.3g} s"


def change_lines(old: Any, new: Any, prefix: str) -> list[str]:
    """Structural and value changes, in words, with ``root`` replaced by ``prefix``."""
    diff = DeepDiff(old, new, ignore_order=False, verbose_level=2)
    lines = []

    def name(path: str) -> str:
        return prefix + path[len("root") :]

    for path, change in diff.get("values_changed", {}).items():
        lines.append(f"{name(path)}: {change['old_value']!r} -> {change['new_value']!r}")
    for path, change in diff.get("type_changes", {}).items():
        lines.append(f"{name(path)}: {change['old_value']!r} -> {change['new_value']!r}")
    for key in ("dictionary_item_added", "iterable_item_added"):
        for path, value in _items(diff.get(key)):
            lines.append(f"{name(path)} added: {value!r}")
    for key in ("dictionary_item_removed", "iterable_item_removed"):
        for path, value in _items(diff.get(key)):
            lines.append(f"{name(path)} removed (was {value!r})")
    return sorted(lines)


def _items(entries: Any) -> list[tuple[str, Any]]:
    if not entries:
        return []
    if isinstance(entries, dict):
        return list(entries.items())
    return [(path, "") for path in entries]
