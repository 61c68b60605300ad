"""The bfloat16 verdict: the candidate may be at most ``K`` times as far from float32 as the
reference is.

A fixed bound cannot judge bfloat16 at every width: how far a correct bf16 step lands
from exact arithmetic depends on the model, the width and the data, and a bound loose
enough for one is blind at another. So each lockstep step is also computed in float32
by the reference stack (the same weights, batch and expert choices: the truth), and
each bf16 stack's error against it is measured, per quantity:

- the loss: ``|loss - truth| / |truth|``;
- each parameter group's gradient (a group is one parameter name over all layers,
  ``model.layers.*.self_attn.q_proj.weight``; plus all gradients as one vector):
  the relative L2 error ``|g - t| / |t|``, and its *radial* part ``<g - t, t> / |t|^2``
  (`harness.compare.inplace.Sums.radial`). Rounding noise is nearly orthogonal to the
  truth; a wrong scale is all radial, and hides under the noise in the L2 error;
- each router's scores (the worst call's relative L2 difference, `models.network.routing`).

The candidate passes a quantity when its error is at most ``K`` times the reference's plus
an allowance. The rules, and why (docs/compare.md's "Why the constants are what they are"
links the measurements behind each, in docs/results.json):

- ``K = 2``: correct stacks sit well below it, the planted bugs (`harness.compare.planted`)
  but the rounding bias well above (the bias shows in its radial part, below). Below 2 a
  correct kernel whose rounding differs from PyTorch's (a fused kernel keeps float32
  longer in one place and rounds in another) would fail by chance on small groups.
- L2 allowance ``SLACK_REL``: a tenth of a typical bf16 gradient error, so a group whose
  reference error happens to be small is not failed on a few elements.
- the radial part of all gradients together (the stack's own scale error) is judged by
  its size, as the L2 error is: at most ``K`` times the reference's, plus an allowance.
  A stack's bf16 loss scales every gradient alike (each one flows from the logits'
  gradient), and nearly every group follows its stack's scale;
- each group's radial part is judged *relative to its own stack's scale*: ``radial -
  scale`` of the candidate at most ``K`` times the reference's, plus the allowance. A
  kernel that biases one group (an activation rounded toward zero: the down projection's
  gradient a little small while every other group keeps its stack's scale) stands out of
  its stack's shared scale. Judged by its size, such a group hid under the scales the two
  losses give; judged with a sign, the correct stack failed at mid width, where its group
  scales have the other sign. No ``Z`` or share separates every correct run from every
  planted one at every width: the fused loss's output layer and final norm keep small
  biases of their own;
- radial allowance: ``Z`` standard deviations of the radial part of random noise,
  ``rel_reference / sqrt(n)`` (the reference's own radial error can be near zero by
  chance), where ``n`` is the number of independent error sources: the group's elements,
  but at most the step's tokens. A token's rounding errors reach every parameter through
  the same upstream gradient (its logits' gradient, its hidden state's), so errors across
  a large group are correlated token by token, not independent element by element; plus
  ``RADIAL_SHARE`` of the reference's L2 error: a correct fused kernel may scale its result
  coherently by a little, far less than a wrong normalisation or a biased rounding does;
- loss allowance ``SLACK_LOSS`` (relative): the loss is a mean of per-token rounding
  errors with random signs, so the reference's can be near zero by chance;
- router allowance ``SLACK_ROUTER``, for the same reason.

DESIGN.md's fixed bf16 bounds (loss 1e-2, gradient 1 - cos 1e-2, candidate against
baseline) stay as a backstop in `harness.compare.tolerances`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from harness.compare.inplace import Sums, group_sums
from harness.compare.record import StepRecord

K = 2.0
"""The candidate may be this many times as far from the float32 truth as the reference."""
Z = 4.0
"""Standard deviations of random rounding noise allowed in the radial part of an error."""
RADIAL_SHARE = 1 / 32
"""Share of the reference's L2 error a coherent scale difference may take."""
SLACK_REL = 1e-3
"""Allowance on a group's relative L2 gradient error."""
SLACK_LOSS = 1e-4
"""Allowance on the relative loss error."""
SLACK_ROUTER = 1e-4
"""Allowance on a router's score drift."""
ALL = "(all gradients)"


def _entry(base: float, cand: float, limit: float, **extra: Any) -> dict[str, Any]:
    ratio = cand / base if base else (math.inf if cand else 1.0)
    passed = math.isfinite(cand) and cand <= limit
    return {"baseline": base, "candidate": cand, "ratio": ratio, "limit": limit,
            "passed": bool(passed), **extra}  # fmt: skip


def judge_loss(losses: Mapping[str, float]) -> dict[str, Any]:
    truth = losses["truth"]
    base = abs(losses["baseline"] - truth) / abs(truth)
    cand = abs(losses["candidate"] - truth) / abs(truth)
    return _entry(base, cand, K * base + SLACK_LOSS)


def judge_group(
    name: str,
    base: Sums,
    cand: Sums,
    tokens: int | None = None,
    scales: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """One group's L2 and radial verdicts (``base``/``cand``: each stack against the truth;
    ``tokens``: the step's, which bound the independent error sources; ``scales``: the
    radial errors of all gradients together, baseline's and candidate's, for a group
    judged against its own stack's scale; None for all gradients themselves)."""
    entry = _entry(base.rel, cand.rel, K * base.rel + SLACK_REL, group=name)
    sources = base.count if tokens is None else min(base.count, tokens)
    noise = base.rel / math.sqrt(max(sources, 1))
    own_b, own_c = scales or (0.0, 0.0)
    limit = K * abs(base.radial - own_b) + Z * noise + RADIAL_SHARE * base.rel
    low, high = own_c - limit, own_c + limit
    entry.update(
        radial_baseline=base.radial,
        radial_candidate=cand.radial,
        radial_scale_baseline=own_b,
        radial_scale_candidate=own_c,
        radial_low=low,
        radial_high=high,
        radial_limit=limit,
        elements=base.count,
    )
    entry["passed"] = entry["passed"] and low <= cand.radial <= high
    return entry


def judge_grads(
    base: Mapping[str, Sums], cand: Mapping[str, Sums], tokens: int | None = None
) -> list[dict[str, Any]]:
    """Every group and all gradients together, worst (highest L2 ratio to its limit) first.
    All gradients' radial error is judged by its size; each group's relative to its own
    stack's (see the module docstring)."""
    groups_b, groups_c = group_sums(base), group_sums(cand)
    total_b, total_c = Sums(), Sums()
    for name in base:
        total_b.merge(base[name])
        total_c.merge(cand[name])
    scales = (total_b.radial, total_c.radial)
    rows = [judge_group(ALL, total_b, total_c, tokens)]
    rows += [judge_group(name, groups_b[name], groups_c[name], tokens, scales) for name in groups_b]
    return sorted(rows, key=lambda r: (r["passed"], -r["candidate"] / max(r["limit"], 1e-300)))


def judge_routers(drifts: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    """``drifts[side][router]``: each side's worst score drift from the truth, per router."""
    base, cand = drifts.get("baseline", {}), drifts.get("candidate", {})
    rows = [
        _entry(base.get(r, 0.0), cand[r], K * base.get(r, 0.0) + SLACK_ROUTER, router=r)
        for r in sorted(cand)
    ]
    return sorted(rows, key=lambda r: (r["passed"], -r["ratio"]))


def router_limits(drifts: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The candidate's score-drift limit per router (for `ReplayResult.problems`)."""
    return {r: K * d + SLACK_ROUTER for r, d in drifts.get("baseline", {}).items()}


def judge_step(
    record: StepRecord,
    drifts: Mapping[str, Mapping[str, float]],
    tokens: int | None = None,
) -> dict:
    """One lockstep step's noise-floor verdict (``tokens``: the step's, every rank's)."""
    out = {"loss": judge_loss(record.loss)}
    truth = record.grads_truth
    out["groups"] = judge_grads(truth["baseline"], truth["candidate"], tokens)
    out["routers"] = judge_routers(drifts)
    failed = [f"loss {_why(out['loss'])}"] if not out["loss"]["passed"] else []
    failed += [f"gradient {g['group']} {_why(g)}" for g in out["groups"] if not g["passed"]]
    failed += [f"router {r['router']} {_why(r)}" for r in out["routers"] if not r["passed"]]
    out["problems"] = failed
    out["passed"] = not failed
    return out


def _why(entry: Mapping[str, Any]) -> str:
    text = (
        f"error {entry['candidate']:.3g} against the reference's {entry['baseline']:.3g} "
        f"(limit {entry['limit']:.3g})"
    )
    low, high = entry.get("radial_low"), entry.get("radial_high")
    if low is not None and not low <= entry["radial_candidate"] <= high:
        text += f", radial {entry['radial_candidate']:+.3g}"
        if entry.get("group") == ALL:
            text += f" against the reference's {entry['radial_baseline']:+.3g}"
        else:
            own_c, own_b = entry["radial_scale_candidate"], entry["radial_scale_baseline"]
            text += (
                f" where its stack's scale is {own_c:+.3g}: off by "
                f"{entry['radial_candidate'] - own_c:+.3g}, the reference's by "
                f"{entry['radial_baseline'] - own_b:+.3g}"
            )
        text += f" (bounds {low:+.3g} to {high:+.3g})"
    return text


SETTINGS = {"k": K, "z": Z, "radial_share": RADIAL_SHARE, "slack_rel": SLACK_REL,
            "slack_loss": SLACK_LOSS, "slack_router": SLACK_ROUTER}  # fmt: skip
