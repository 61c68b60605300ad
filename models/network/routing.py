"""Routing tapes: compare two MoE stacks at the same expert choices.

Top-k routing is discontinuous. Where a token's k-th and (k+1)-th experts score
almost the same, any rounding difference upstream (a fused kernel, another
reduction order) can swap them, and the token then takes another expert: its
output, and the router's gradient for that token, change by a whole expert's
contribution, not by a rounding error. Two correct stacks therefore disagree,
in bfloat16, wherever such near-ties occur. On tiny-qwen3-moe at random init
(8 experts, top-2 renormalised, near-uniform scores; `twinpipe compare` at
(2,1,1), (1,2,2), (2,2,2), (1,2,1), bfloat16, 2 steps) about 0.7% of the routed
choices swap between the reference and the optimized stack, and those swaps
alone put the router-gate gradients 1.9e-2 to 3.6e-2 apart (1 - cos) by the
second step; at the same choices every gradient agrees to 1.4e-3 or better.
The reference's own bfloat16 run is as far from its float32 run, for the same
reason.

A comparison of the arithmetic must therefore hold the discrete choices fixed:

- the baseline stack runs with a recording tape: every router call appends its
  ``[tokens, k]`` expert indices and its ``[tokens, experts]`` scores (softmax
  probabilities) under the router's module name;
- the candidate runs with a replaying tape made from that record: each router
  still computes its own scores and its own top-k, then takes the recorded
  indices instead, and its weights (and their gradients) are its own scores at
  those indices; so everything but the selection is the candidate's own math;
- the replay holds what is left to chance to account (`ReplayResult.check`):
  each call's scores must agree with the baseline's within the dtype's bound
  (``DRIFT_LIMIT``, relative L2: DESIGN.md's loss bound), and every token the
  candidate would have routed differently must be a near-tie that the score
  difference explains. Both stacks take the top-k of their own scores, so a
  swap's gap (own top-k sum minus the replayed experts' sum, in the
  candidate's scores) can be at most the summed score difference over the
  experts involved; a larger one means the two select differently (a bug),
  and scores far apart mean a misaligned replay or a wrong router;
- group-limited routing (DeepSeek) first keeps the ``topk_group`` best groups by a group
  score, then takes the top-k within them. A token whose kept groups differ is judged at
  that step by the same rule on the group scores (the candidate's kept groups can score
  above the replayed ones by at most the group scores' difference on the groups that
  changed), and the group scores must agree like the scores do; a token with the same kept
  groups is judged on what its top-k ranked (the biased scores, the dropped groups at
  -inf).

Replay is per router in call order: both stacks run the same DualPipeV
schedule, so a layer sees the same micro-batches in the same order; a count or
shape mismatch raises at once. The record is kept in numpy (indices as
``int16``, ``int32`` past 32,767 experts; scores as float32), off torch's
allocator and dispatcher, so the memory tracker does not count it in the
baseline's peak. It costs ``tokens x (2k + 4 experts)`` bytes per router call,
held until the candidate has run (``--routing free`` in `twinpipe compare`
records nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

DRIFT_LIMIT = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
"""The largest relative L2 difference allowed between the two stacks' router scores in one
call, by compute dtype: DESIGN.md's loss bound for each dtype."""

TIE_SLACK = 1e-6
"""Float32 rounding of the score sums a swap is checked with (relative)."""


@dataclass
class Swap:
    """One routed token whose candidate top-k differs from the replayed one."""

    router: str
    call: int
    token: int
    gap: float
    """How much more the candidate's own top-k scores than the replayed experts, relative
    to its own top-k sum (its scores)."""
    drift: float
    """How much the two stacks' scores of the experts involved differ (sum of absolute
    differences), on the same scale: a legitimate swap has ``0 <= gap <= drift`` (a
    negative gap: the candidate's own choice is not its top-k; a gap beyond the drift:
    the baseline's is not its top-k)."""


@dataclass
class _Call:
    index: np.ndarray
    scores: np.ndarray
    ranked: np.ndarray | None
    """What the top-k ranked, when it is not ``scores`` (biased or group-limited routers)."""
    groups: np.ndarray | None = None
    """The group scores that chose the kept groups (group-limited routers with a bias)."""

    def cut(self, start: int, stop: int) -> _Call:
        """Tokens ``[start, stop)`` of this call."""
        rows = slice(start, stop)
        return _Call(
            self.index[rows],
            self.scores[rows],
            None if self.ranked is None else self.ranked[rows],
            None if self.groups is None else self.groups[rows],
        )


@dataclass
class RoutingTape:
    """Expert choices recorded from one stack (``mode="record"``) or replayed into
    another (``mode="replay"``), keyed by router module name, in call order."""

    mode: str = "record"
    calls: dict[str, list[_Call]] = field(default_factory=dict)
    cursor: dict[str, int] = field(default_factory=dict)
    swaps: list[Swap] = field(default_factory=list)
    choices: int = 0
    """Routed choices (tokens x k) the replay has served."""
    worst_drift: tuple[float, str, int] = (0.0, "", 0)
    """The largest relative L2 score difference of one call, with its router and call."""
    router_drift: dict[str, float] = field(default_factory=dict)
    """The largest relative L2 score difference of each router's calls."""
    router_where: dict[str, str] = field(default_factory=dict)
    """Where each router's largest difference was (`ReplayResult.router_where`)."""
    dtype: torch.dtype | None = None
    rows: tuple[tuple[int, int], ...] | None = None
    """Replaying a whole-batch record in pieces: each router's one recorded call is served
    as these token ranges, in order (`replay`)."""
    keys: frozenset[str] | None = None
    """With ``rows``: the routers the replaying stack holds (the record may hold more)."""
    pieces: dict[str, list[_Call]] = field(default_factory=dict)
    """With ``rows``: each router's record cut into ``rows``, cut at its first replay."""

    def __post_init__(self) -> None:
        if self.mode not in ("record", "replay"):
            raise ValueError(f"RoutingTape mode={self.mode!r}: expected 'record' or 'replay'")

    def replay(
        self, rows: list[tuple[int, int]] | None = None, keys: frozenset[str] | None = None
    ) -> RoutingTape:
        """A replaying tape over this tape's record (the record is shared, not copied).

        ``rows``: the record is of a stack that routes the whole batch in one call per
        router (the oracle) and the replayer routes it in pieces (a pipeline rank: its
        data-parallel rank's micro-batches, in order); each router's one recorded call is
        served as the token ranges ``[start, stop)``, one replayed call each. ``keys``: the
        routers the replayer holds (a pipeline rank holds some layers), the only ones whose
        calls must all be replayed."""
        if self.mode != "record":
            raise ValueError("RoutingTape.replay: only a recording tape can be replayed")
        if (rows is None) != (keys is None):
            raise ValueError("RoutingTape.replay: rows and keys go together")
        cut = None if rows is None else tuple((int(a), int(b)) for a, b in rows)
        return RoutingTape(mode="replay", calls=self.calls, rows=cut, keys=keys)

    def _recorded(self, key: str) -> list[_Call]:
        """The calls router ``key`` replays: the record's, or its one call cut into `rows`."""
        if self.rows is None:
            return self.calls.get(key, [])
        if key not in self.pieces:
            whole = self.calls.get(key, [])
            if len(whole) != 1:
                raise RuntimeError(
                    f"routing replay: router {key} has {len(whole)} recorded calls; a "
                    "whole-batch record has exactly one per router"
                )
            if self.rows[-1][1] > whole[0].index.shape[0]:
                raise RuntimeError(
                    f"routing replay: router {key} recorded {whole[0].index.shape[0]} tokens; "
                    f"the replay asks for rows up to {self.rows[-1][1]}"
                )
            self.pieces[key] = [whole[0].cut(a, b) for a, b in self.rows]
        return self.pieces[key]

    def route(
        self,
        key: str,
        scores: torch.Tensor,
        own: torch.Tensor,
        dtype: torch.dtype,
        ranked: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The indices a router uses: its own (recorded) or the recorded ones (replayed).

        ``scores [T, E]`` are the router's probabilities over all experts, ``own [T, k]``
        its own top-k indices, ``dtype`` the dtype its input was computed in, ``ranked``
        what its top-k ranked when that is not ``scores`` (biased scores, dropped groups at
        -inf), ``groups [T, G]`` the group scores that chose the kept groups.
        """
        if self.mode == "record":
            # .numpy() is no aten op: the copies are invisible to the memory tracker.
            small = np.int16 if scores.shape[-1] <= np.iinfo(np.int16).max else np.int32
            call = _Call(
                own.detach().cpu().numpy().astype(small),
                _floats(scores),
                None if ranked is None else _floats(ranked),
                None if groups is None else _floats(groups),
            )
            self.calls.setdefault(key, []).append(call)
            return own
        number = self.cursor.get(key, 0)
        recorded = self._recorded(key)
        if number >= len(recorded):
            raise RuntimeError(
                f"routing replay: router {key} called {number + 1} times, the record has "
                f"{len(recorded)}: the two stacks do not run the same micro-batches"
            )
        call = recorded[number]
        if call.index.shape != tuple(own.shape):
            raise RuntimeError(
                f"routing replay: router {key} call {number} routes {tuple(own.shape)}, the "
                f"record {call.index.shape}"
            )
        replayed = torch.from_numpy(call.index).to(own.device, own.dtype)
        self.cursor[key] = number + 1
        self.dtype = dtype
        self.choices += own.numel()
        mine = scores.detach().float().cpu()
        theirs = torch.from_numpy(call.scores)
        drift, where = _relative(mine, theirs), key
        pair = None
        if groups is not None and call.groups is not None:
            pair = (groups.detach().float().cpu(), torch.from_numpy(call.groups))
            if _relative(*pair) > drift:
                drift, where = _relative(*pair), f"{key} (its group scores)"
        if drift > self.worst_drift[0]:
            self.worst_drift = (drift, where, number)
        if drift >= self.router_drift.get(key, 0.0):
            self.router_drift[key] = drift
            self.router_where[key] = where
        if ranked is not None:
            mine = ranked.detach().float().cpu()
            theirs = torch.from_numpy(call.ranked if call.ranked is not None else call.scores)
        self._count_swaps(key, number, mine, theirs, own.cpu(), replayed.cpu(), pair)
        return replayed

    def _count_swaps(self, key, number, mine, theirs, own, replayed, groups=None) -> None:
        """Each token whose choice differs. Both stacks take the top-k of their own scores,
        so ``mine(own) - mine(replayed) <= sum over own and replayed of |mine - theirs|``:
        a swap can only be as large as the scores' difference (a near-tie). ``groups``
        (mine, theirs): where the kept groups differ, the same rule on the group scores."""
        differ = (own.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)
        for token in differ.nonzero().flatten().tolist():
            if groups is not None and self._group_swap(key, number, token, mine, theirs, groups):
                continue
            ours, recorded = own[token], replayed[token]
            total = mine[token, ours].abs().sum().clamp_min(1e-30)  # biased logits: any sign
            gap = float((mine[token, ours].sum() - mine[token, recorded].sum()) / total)
            involved = torch.unique(torch.cat([ours, recorded]))
            drift = mine[token, involved] - theirs[token, involved]
            self.swaps.append(Swap(key, number, token, gap, float(drift.abs().sum() / total)))

    def _group_swap(self, key, number, token, mine, theirs, groups) -> bool:
        """Judge ``token`` on the group scores if its kept groups (the finite entries of what
        the top-k ranked) differ; False when they are the same."""
        width = groups[0].shape[-1]
        kept = torch.isfinite(mine[token]).view(width, -1).any(dim=-1)
        recorded = torch.isfinite(theirs[token]).view(width, -1).any(dim=-1)
        if torch.equal(kept, recorded):
            return False
        own_scores, their_scores = groups[0][token], groups[1][token]
        total = own_scores[kept].abs().sum().clamp_min(1e-30)
        gap = float((own_scores[kept].sum() - own_scores[recorded].sum()) / total)
        changed = kept ^ recorded
        drift = (own_scores[changed] - their_scores[changed]).abs().sum() / total
        self.swaps.append(Swap(key, number, token, gap, float(drift)))
        return True

    def unreplayed(self) -> dict[str, int]:
        """Recorded calls no router replayed: ``{router: count}`` (empty when all were)."""
        if self.rows is not None:
            held = [key for key in self.calls if key in self.keys]
            counts = {key: len(self.rows) - self.cursor.get(key, 0) for key in held}
            return {key: count for key, count in counts.items() if count > 0}
        return {
            key: len(calls) - self.cursor.get(key, 0)
            for key, calls in self.calls.items()
            if len(calls) > self.cursor.get(key, 0)
        }

    def result(self) -> ReplayResult:
        """What this replay saw, without the record (small, picklable, for reports)."""
        if self.mode != "replay":
            raise ValueError("RoutingTape.result: only a replaying tape has swaps to report")
        limit = DRIFT_LIMIT.get(self.dtype or torch.float32, DRIFT_LIMIT[torch.bfloat16])
        return ReplayResult(
            self.choices,
            list(self.swaps),
            self.unreplayed(),
            self.worst_drift,
            limit,
            dict(self.router_drift),
            dict(self.router_where),
        )


def _floats(values: torch.Tensor) -> np.ndarray:
    return values.detach().float().cpu().numpy().copy()


def _relative(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """Relative L2 difference of two calls' scores (against the recorded ones)."""
    return float((mine - theirs).norm() / theirs.norm().clamp_min(1e-30))


@dataclass
class ReplayResult:
    """The outcome of one replay: routed choices served, swaps, score drift, unreplayed
    calls."""

    choices: int
    swaps: list[Swap]
    unreplayed: dict[str, int]
    worst_drift: tuple[float, str, int]
    drift_limit: float
    router_drift: dict[str, float] = field(default_factory=dict)
    """Each router's largest score difference over its calls (relative L2)."""
    router_where: dict[str, str] = field(default_factory=dict)
    """Where each router's largest difference was: its key, or ``key (its group scores)``
    when the group scores that chose the kept groups differed more than the scores."""

    def max_gap(self) -> float:
        return max((s.gap for s in self.swaps), default=0.0)

    def as_dict(self) -> dict:
        return {
            "choices": self.choices,
            "swaps": len(self.swaps),
            "max_gap": self.max_gap(),
            "score_drift": self.worst_drift[0],
            "drift_limit": self.drift_limit,
            "unreplayed_calls": sum(self.unreplayed.values()),
        }

    def problems(self, limits: Mapping[str, float] | None = None) -> list[str]:
        """Why the replay does not hold (empty when it does): calls never replayed, router
        scores further apart than the dtype allows, or a swap larger than the scores'
        difference explains.

        ``limits``: a score-drift limit per router instead of the dtype's fixed one (the
        harness's noise floor: k times the reference's own drift from float32). Whether
        swaps are explained does not depend on it."""
        found = []
        if self.unreplayed:
            found.append(f"recorded router calls never replayed: {self.unreplayed}")
        drift, router, call = self.worst_drift
        if limits is None and drift > self.drift_limit:
            found.append(
                f"router scores differ from the baseline's by {drift:.3g} (relative L2) at "
                f"router {router}, call {call}; the limit is {self.drift_limit:.3g}"
            )
        checked = self.router_drift if limits is not None else {}
        for name, drift in sorted(checked.items()):
            limit = limits.get(name, self.drift_limit) if limits is not None else 0.0
            if drift > limit:
                found.append(
                    f"router scores differ from the recorded ones by {drift:.3g} (relative "
                    f"L2) at router {self.router_where.get(name, name)}; the limit is {limit:.3g}"
                )
        far = [s for s in self.swaps if not -TIE_SLACK <= s.gap <= s.drift + TIE_SLACK]
        if far:
            worst = max(far, key=lambda s: max(s.gap - s.drift, -s.gap))
            found.append(
                f"{len(far)} of {self.choices} routed choices differ from the baseline by more "
                f"than the scores' difference explains; worst: gap {worst.gap:.3g} against "
                f"{worst.drift:.3g} at router {worst.router}, call {worst.call}, "
                f"token {worst.token}"
            )
        return found

    def check(self) -> None:
        """Raise `AssertionError` with `problems` unless there are none."""
        found = self.problems()
        if found:
            raise AssertionError("routing replay: " + "; ".join(found))


class BalancedRouting:
    """A tape that pins a perfectly balanced assignment: in every router call, token ``t``
    takes experts ``(t * k + i) mod E`` for ``i < k`` (k distinct experts while k <= E), so
    each expert receives ``T * k / E`` copies of a ``T``-token micro-batch (exactly, when E
    divides ``T * k``; otherwise the first ``T * k mod E`` experts one more) on every rank.

    What it is for: traffic that depends on routing (the dispatch and combine all-to-alls)
    becomes a function of the config alone, so a real run's byte counts can be held
    against the estimator's to the byte (`optimized.estimator.communication`). The weights
    are still the router's own scores at those experts, so the step is a real one. Both
    stacks of a comparison use it (``twinpipe compare --routing balanced``): it replays
    nothing and checks nothing.
    """

    def route(
        self,
        key: str,
        scores: torch.Tensor,
        own: torch.Tensor,
        dtype: torch.dtype,
        ranked: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens, k = own.shape
        experts = scores.shape[-1]
        slots = torch.arange(tokens * k, device=own.device).view(tokens, k)
        return (slots % experts).to(own.dtype)


def router_keys(part: nn.Module) -> frozenset[str]:
    """The keys `attach_routing_tape` gives the routers of ``part``."""
    from models.network.router import Router  # noqa: PLC0415

    return frozenset(
        _key(name) for name, module in part.named_modules() if isinstance(module, Router)
    )


def _key(name: str) -> str:
    # Wrappers (activation checkpointing, torch.compile) add "_..." components; the key is
    # the model's own name, the same in every stack.
    return ".".join(p for p in name.split(".") if not p.startswith("_"))


def attach_routing_tape(part: nn.Module, tape: RoutingTape | BalancedRouting | None) -> int:
    """Route every router of ``part`` through ``tape`` (``None`` detaches). Returns how many."""
    from models.network.router import Router  # noqa: PLC0415 (router imports nothing from here)

    count = 0
    for name, module in part.named_modules():
        if isinstance(module, Router):
            module.tape, module.tape_key = tape, _key(name)
            count += 1
    return count
