"""Routing tapes: compare two MoE stacks at the same expert choices.

Top-k routing is discontinuous. Where a token's k-th and (k+1)-th experts score
almost the same, any rounding difference upstream (a fused kernel, another
reduction order) can swap them, and the token then takes another expert: its
output, and the router's gradient for that token, change by a whole expert's
contribution, not by a rounding error. Two correct stacks therefore disagree,
in bfloat16, wherever such near-ties occur. On tiny-qwen3-moe at random init
(8 experts, top-2 renormalised, near-uniform scores) 0 to 4 of every 320 to 384
routed choices per rank swap between the reference and the optimized stack,
and those few swaps alone put the router-gate gradient 1.0e-2 to 1.7e-2 apart
(1 - cos); the reference's own bfloat16 run is as far from its float32 run, for
the same reason.

A comparison of the arithmetic must therefore hold the discrete choices fixed:

- the baseline stack runs with a recording tape: every router call appends its
  ``[tokens, k]`` expert indices under the router's module name;
- the candidate runs with a replaying tape made from that record: each router
  still computes its own scores and its own top-k, then takes the recorded
  indices instead, and its weights (and their gradients) are its own scores at
  those indices; so everything but the selection is the candidate's own math;
- every choice where the candidate would have picked differently is counted,
  with its score gap ``|sum of own top-k scores - sum of replayed scores| /
  sum of own top-k scores`` (scores as softmax probabilities over all experts).
  A swap is legitimate only at a near-tie: `ReplayResult.check` fails any gap
  above ``NEAR_TIE_EPS`` machine epsilons of the compute dtype, which a wrong
  router (wrong scores, wrong order, a misaligned replay) cannot stay under.

Replay is per router in call order: both stacks run the same DualPipeV
schedule, so a layer sees the same micro-batches in the same order; a count or
shape mismatch raises at once. The record is kept as numpy ``int16`` arrays
(``int32`` past 32,767 experts), off torch's allocator and dispatcher, so the
memory tracker does not count it in the baseline's peak (and it is 4x smaller
than the int64 indices).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

NEAR_TIE_EPS = 2
"""A swap counts as a near-tie when its score gap is at most this many machine
epsilons of the compute dtype: 2 x 2^-7 = 1.6e-2 in bfloat16, 2 x 2^-23 = 2.4e-7 in
float32. Measured between the reference and the optimized stack over every tiny preset
at (2,1,1), (1,2,2), (2,2,2) and (1,2,1): bfloat16 swaps have gaps up to 3.9e-3 (half
an epsilon), float32 has none. For scale, on a random near-uniform router (8 experts,
top 2) swapping a token's 2nd and 3rd experts moves its score sum by 2.1e-2 at the
median, and a random other pair by 1.5e-1: a misaligned replay fails the check."""


@dataclass
class Swap:
    """One routed token whose candidate top-k differs from the replayed one."""

    router: str
    call: int
    token: int
    gap: float
    """Relative score gap between the candidate's own top-k and the replayed experts."""


@dataclass
class RoutingTape:
    """Expert choices recorded from one stack (``mode="record"``) or replayed into
    another (``mode="replay"``), keyed by router module name, in call order."""

    mode: str = "record"
    calls: dict[str, list[np.ndarray]] = field(default_factory=dict)
    cursor: dict[str, int] = field(default_factory=dict)
    swaps: list[Swap] = field(default_factory=list)
    choices: int = 0
    """Routed choices (tokens x k) the replay has served."""
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("record", "replay"):
            raise ValueError(f"RoutingTape mode={self.mode!r}: expected 'record' or 'replay'")

    def replay(self) -> RoutingTape:
        """A replaying tape over this tape's record (the record is shared, not copied)."""
        if self.mode != "record":
            raise ValueError("RoutingTape.replay: only a recording tape can be replayed")
        return RoutingTape(mode="replay", calls=self.calls)

    def route(
        self, key: str, scores: torch.Tensor, own: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The indices a router uses: its own (recorded) or the recorded ones (replayed).

        ``scores [T, E]`` are the router's probabilities over all experts, ``own [T, k]``
        its own top-k indices, ``dtype`` the dtype its input was computed in.
        """
        if self.mode == "record":
            # .numpy() is no aten op: the copy is invisible to the memory tracker.
            small = np.int16 if scores.shape[-1] <= np.iinfo(np.int16).max else np.int32
            record = own.detach().cpu().numpy().astype(small)
            self.calls.setdefault(key, []).append(record)
            return own
        call = self.cursor.get(key, 0)
        recorded = self.calls.get(key, [])
        if call >= len(recorded):
            raise RuntimeError(
                f"routing replay: router {key} called {call + 1} times, the record has "
                f"{len(recorded)}: the two stacks do not run the same micro-batches"
            )
        if recorded[call].shape != tuple(own.shape):
            raise RuntimeError(
                f"routing replay: router {key} call {call} routes {tuple(own.shape)}, the "
                f"record {recorded[call].shape}"
            )
        replayed = torch.from_numpy(recorded[call]).to(own.device, own.dtype)
        self.cursor[key] = call + 1
        self.dtype = dtype
        self.choices += own.numel()
        self._count_swaps(key, call, scores.detach().float(), own, replayed)
        return replayed

    def _count_swaps(self, key, call, scores, own, replayed) -> None:
        differ = (own.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)
        for token in differ.nonzero().flatten().tolist():
            mine = scores[token, own[token]].sum()
            theirs = scores[token, replayed[token]].sum()
            gap = float((mine - theirs).abs() / mine.clamp_min(torch.finfo(torch.float32).tiny))
            self.swaps.append(Swap(key, call, token, gap))

    def unreplayed(self) -> dict[str, int]:
        """Recorded calls no router replayed: ``{router: count}`` (empty when all were)."""
        return {
            key: len(calls) - self.cursor.get(key, 0)
            for key, calls in self.calls.items()
            if len(calls) > self.cursor.get(key, 0)
        }

    def tolerance(self) -> float:
        """The near-tie limit for the dtype the routers computed in."""
        return NEAR_TIE_EPS * torch.finfo(self.dtype or torch.float32).eps

    def result(self) -> ReplayResult:
        """What this replay saw, without the record (small, picklable, for reports)."""
        if self.mode != "replay":
            raise ValueError("RoutingTape.result: only a replaying tape has swaps to report")
        return ReplayResult(self.choices, list(self.swaps), self.unreplayed(), self.tolerance())


@dataclass
class ReplayResult:
    """The outcome of one replay: routed choices served, swaps, unreplayed calls."""

    choices: int
    swaps: list[Swap]
    unreplayed: dict[str, int]
    near_tie_limit: float

    def max_gap(self) -> float:
        return max((s.gap for s in self.swaps), default=0.0)

    def as_dict(self) -> dict:
        return {
            "choices": self.choices,
            "swaps": len(self.swaps),
            "max_gap": self.max_gap(),
            "near_tie_limit": self.near_tie_limit,
            "unreplayed_calls": sum(self.unreplayed.values()),
        }

    def problems(self) -> list[str]:
        """Why the replay does not hold (empty when it does): calls never replayed, or a
        swap whose gap is beyond a near-tie."""
        found = []
        if self.unreplayed:
            found.append(f"recorded router calls never replayed: {self.unreplayed}")
        far = [s for s in self.swaps if s.gap > self.near_tie_limit]
        if far:
            worst = max(far, key=lambda s: s.gap)
            found.append(
                f"{len(far)} of {self.choices} routed choices differ from the baseline by more "
                f"than a near-tie (gap > {self.near_tie_limit:.3g}); worst {worst.gap:.3g} at "
                f"router {worst.router}, call {worst.call}, token {worst.token}"
            )
        return found

    def check(self) -> None:
        """Raise `AssertionError` with `problems` unless there are none."""
        found = self.problems()
        if found:
            raise AssertionError("routing replay: " + "; ".join(found))


def attach_routing_tape(part: nn.Module, tape: RoutingTape | None) -> int:
    """Route every router of ``part`` through ``tape`` (``None`` detaches). Returns how many."""
    from models.layers import Router  # noqa: PLC0415 (layers imports nothing from here)

    count = 0
    for name, module in part.named_modules():
        if isinstance(module, Router):
            # Wrappers (activation checkpointing, torch.compile) add "_..." components; the
            # key is the model's own name, the same in every stack.
            key = ".".join(p for p in name.split(".") if not p.startswith("_"))
            module.tape, module.tape_key = tape, key
            count += 1
    return count
