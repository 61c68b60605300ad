"""The in-place comparison (`harness.compare.inplace`) against the whole-tensor one it replaced.

`twinpipe compare` used to gather every rank's gradients into whole-model float32 copies
in the parent and compare those; now each rank reduces its own rows to scalars. The
figures must be the same: on real stacks' gradients (EP shards, data-parallel copies,
FSDP2 row shards), every figure agrees with the same sums taken on the assembled whole
tensors to 1e-12 relative, the relative L2 error with the old whole-tensor computation to
1e-12 relative, and ``1 - cos`` with the old formula within that formula's own rounding
(``1 - a.b / (|a||b|)`` cannot resolve less than about 1e-14 on these tensors; the new one,
``(d2 - (|a| - |b|)^2) / (2 |a||b|)``, has no such floor).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.compare.inplace import Comparer, RankPlace, Sums, compare_sums, pair_sums, pieces
from harness.compare.stacks import shadow_update
from harness.compare.tolerances import compare_tensors
from models.network import SeededWeights, build_model, is_expert_parameter, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch, make_layout, synthetic_batch


# ------------------------------------------------ the old whole-tensor comparison
def _old_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom, diff = b.norm().item(), (a - b).norm().item()
    if denom == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / denom


def _old_one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    na, nb = a.norm().item(), b.norm().item()
    if na == 0 and nb == 0:
        return 0.0
    if na == 0 or nb == 0:
        return 1.0
    return max(0.0, 1.0 - (a @ b).item() / (na * nb))


def _assemble(per_rank: list[dict], stack: str, ep: int) -> dict[str, torch.Tensor]:
    """The old harness's whole-model tensors: experts from dp-block 0 by ep-rank, the rest
    from dp-rank 0."""
    full, shards = {}, {}
    for result in per_rank:
        _, dp_rank, ep_rank = result["coords"]
        for name, tensor in result[stack].items():
            if is_expert_parameter(name):
                if dp_rank < ep:
                    shards.setdefault(name, {})[ep_rank] = tensor
            elif dp_rank == 0:
                full[name] = tensor
    for name, parts in shards.items():
        full[name] = torch.cat([parts[r] for r in sorted(parts)], dim=0)
    return full


OLD_COS_RESOLUTION = 1e-13
"""What ``1 - a.b / (|a||b|)`` resolves: a float64 dot product of n terms carries about
sqrt(n) ulps of error, 3.5e-15 measured on a 32,768-element tensor, whatever the true value."""


def _assert_same(new: dict[str, Sums], base: dict, cand: dict) -> None:
    assert set(new) == set(base) == set(cand)
    for name, sums in new.items():
        whole = pair_sums(cand[name], base[name])  # the same sums on the assembled tensors
        assert sums.count == whole.count == base[name].numel(), name
        for field in ("rel", "one_minus_cos", "radial"):
            assert getattr(sums, field) == pytest.approx(getattr(whole, field), rel=1e-12), name
        old_cos = _old_one_minus_cos(cand[name], base[name])
        assert sums.rel == pytest.approx(_old_rel(cand[name], base[name]), rel=1e-12), name
        assert abs(sums.one_minus_cos - old_cos) <= 1e-12 * old_cos + OLD_COS_RESOLUTION, name


# --------------------------------------------------------------------- units
def test_rows_are_worst_first():
    """`compare_sums` and `compare_tensors` order rows by 1 - cos, largest first: every
    check that takes ``[0]`` takes the worst parameter (#21)."""
    gen = torch.Generator().manual_seed(0)
    base = {f"p{i}": torch.randn(50, generator=gen) for i in range(6)}
    noise = [1e-6, 1e-2, 1e-4, 3e-1, 1e-8, 1e-3]
    cand = {n: t + s * torch.randn(50, generator=gen) for (n, t), s in zip(base.items(), noise)}
    rows = compare_tensors(base, cand)
    assert rows[0].name == "p3"  # the noisiest
    assert rows[0].one_minus_cos == max(r.one_minus_cos for r in rows)
    assert [r.one_minus_cos for r in rows] == sorted((r.one_minus_cos for r in rows), reverse=True)
    sums = {n: pair_sums(cand[n], base[n]) for n in base}
    assert compare_sums(sums)[0].name == "p3"


def test_pieces_merge_to_the_whole_tensor_figures():
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(37, 11, generator=gen)
    a = b + 1e-3 * torch.randn(37, 11, generator=gen)
    whole = pair_sums(a, b, chunk=64)
    merged = Sums()
    for rows in ((0, 5), (5, 20), (20, 37)):
        merged.merge(pair_sums(a[slice(*rows)], b[slice(*rows)], chunk=7))
    assert merged.count == whole.count == a.numel()
    for field in ("rel", "one_minus_cos", "radial"):
        assert getattr(merged, field) == pytest.approx(getattr(whole, field), rel=1e-12)
    assert whole.rel == pytest.approx(_old_rel(a, b), rel=1e-12)
    assert whole.one_minus_cos == pytest.approx(_old_one_minus_cos(a, b), rel=1e-9)


def test_one_minus_cos_has_no_cancellation():
    """A pure scale difference has cos = 1 exactly; an orthogonal one of size e gives
    1 - cos = e^2 / 2 to first order, far below what 1 - a.b/(|a||b|) resolves."""
    gen = torch.Generator().manual_seed(2)
    b = torch.randn(4096, generator=gen, dtype=torch.float64)
    assert pair_sums(b * (1 + 1e-7), b).one_minus_cos < 1e-20
    ortho = torch.randn(4096, generator=gen, dtype=torch.float64)
    ortho -= (ortho @ b) / (b @ b) * b
    ortho *= 1e-9 * b.norm() / ortho.norm()
    expected = 1 - 1 / math.sqrt(1 + 1e-18)
    assert pair_sums(b + ortho, b).one_minus_cos == pytest.approx(expected, rel=1e-6)


def test_radial_part_sees_a_scale_error_the_l2_error_hides():
    gen = torch.Generator().manual_seed(3)
    truth = torch.randn(100_000, generator=gen, dtype=torch.float64)
    noisy = truth + 1e-2 * truth.abs() * torch.randn(100_000, generator=gen, dtype=torch.float64)
    scaled = noisy * 1.01
    noise, bug = pair_sums(noisy, truth), pair_sums(scaled, truth)
    assert bug.rel < 1.5 * noise.rel  # the L2 error barely moves
    assert abs(noise.radial) < 1e-4 and bug.radial == pytest.approx(0.01, rel=0.02)


def test_nonfinite_is_infinite_error():
    a = torch.tensor([1.0, float("nan"), 3.0])
    sums = pair_sums(a, torch.ones(3))
    assert not sums.finite and math.isinf(sums.rel) and math.isinf(sums.one_minus_cos)


@pytest.mark.parametrize(
    ("dp_rank", "ep", "whole", "experts_count", "others_count"),
    [
        (0, 1, False, True, True),
        (1, 1, False, False, False),  # DP = 2, EP = 1: rank 1 holds replicas of everything
        (1, 2, False, True, False),  # EP = 2: its expert shard is its own, the rest a copy
        (2, 2, False, False, False),  # DP = 4, EP = 2: the second block of EP ranks
        (3, 1, True, True, True),  # the oracle (whole) defers to the other side's rule
    ],
)
def test_pieces_count_each_row_once(dp_rank, ep, whole, experts_count, others_count):
    """Data-parallel copies count once (as `models.runtime.reduce_gradients` reduces
    them): a non-expert tensor on dp-rank 0, an expert shard on the first EP block. A copy
    counted twice leaves 1 - cos and the relative error of that tensor unchanged, so
    only this rule, and the element counts, can see it."""
    part = build_model(preset("tiny-qwen3-moe"))
    got = pieces(part, RankPlace(dp_rank, ep, whole), lambda name, p: p)
    experts = {n: piece.counts for n, piece in got.items() if is_expert_parameter(n)}
    others = {n: piece.counts for n, piece in got.items() if not is_expert_parameter(n)}
    assert experts and others
    assert set(experts.values()) == {experts_count}
    assert set(others.values()) == {others_count}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shadow_update_is_the_real_step_bit_for_bit(dtype):
    """The candidate's update computed on the side, chunk by chunk, equals AdamW's own
    step on the whole parameter, bit for bit (with moments from an earlier step)."""
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.Linear(70, 5)).to(dtype)
    optimizer = OptimizerConfig(lr=1e-2).build(model.parameters())
    for _ in range(2):  # the second step has moments to read
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        shadow = shadow_update(optimizer, model, dict(grads), chunk=256)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # untouched
        optimizer.step()
        for name, param in model.named_parameters():
            assert torch.equal(shadow[name], param.detach()), name


# ------------------------------------------------------------- on real stacks
def _old_named(part: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in part.named_parameters():
        tensor = param.grad
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().float().clone()
    return out


def _gradients_worker(models, parallels, states, sides):
    """Both stacks' gradients of one step on every model (each in its own dtype, one
    layout): the in-place sums, and the tensors the old harness would have shipped to the
    parent."""
    from harness.compare.stacks import stack_class

    layout = make_layout(parallels[0])
    place = RankPlace(layout.dp_rank, layout.ep)
    out = []
    for model, parallel, state in zip(models, parallels, states, strict=True):
        stacks = {}
        for side in sides:
            stack = stack_class(side)(model, parallel, layout, state, OptimizerConfig())
            stack.forward_backward(*synthetic_batch(model, parallel, 0))
            stacks[side] = stack
        grads = {
            side: pieces(stack.part, place, lambda name, p: p.grad)
            for side, stack in stacks.items()
        }
        sums = Comparer().compare(grads[sides[1]], grads[sides[0]])
        result = {"coords": (layout.pp_rank, layout.dp_rank, layout.ep_rank), "sums": sums}
        result.update({side: _old_named(stack.part) for side, stack in stacks.items()})
        out.append(result)
    return out


FAMILIES = ("tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "sides", "cases"),
    [
        (
            (2, 2, 2),
            ("reference", "optimized"),
            [("tiny-deepseek-v2", "float32")] + [(n, "bfloat16") for n in FAMILIES],
        ),
        ((1, 2, 1), ("optimized", "optimized-fsdp"), [(n, "float32") for n in FAMILIES]),
    ],
    ids=["layout-2-2-2", "layout-1-2-1-fsdp"],
)
def test_in_place_equals_the_whole_tensor_comparison(layout, sides, cases):
    """On the tiny presets: EP shards (2,2,2), FSDP2 row shards and expert replicas
    (1,2,1 with FSDP2: the experts are sharded over their two replicas). Each family at
    both layouts, in both dtypes and with both pairs of sides (pairwise: float32 at
    (2,2,2) needs one family; it ran all three before). One launch per layout: its
    cases run one after another in it."""
    pp, dp, ep = layout
    parallels = [
        ParallelConfig(
            pp=pp, dp=dp, ep=ep, micro_batches=2 * pp, micro_batch_size=1, seq_len=16, dtype=dtype
        )
        for _, dtype in cases
    ]
    names = [name for name, _ in cases]
    models = [preset(n) for n in names]
    states = [SeededWeights(m, seed=5) for m in models]
    world = parallels[0].world_size
    per_rank = launch(_gradients_worker, world, (models, parallels, states, sides))
    for index in range(len(names)):
        results = [r[index] for r in per_rank]
        sums = results[0]["sums"]
        assert all(r["sums"] == sums for r in results)  # every rank has the figures
        base = _assemble(results, sides[0], ep)
        cand = _assemble(results, sides[1], ep)
        _assert_same(sums, base, cand)
        assert max(s.one_minus_cos for s in sums.values()) > 0  # the stacks do differ
