"""Known bugs, planted in the optimized stack on purpose, to show the verdict catches them.

A comparison that never fails proves nothing. Each bug here is one a kernel author could
plausibly ship, and each is small: nothing crashes, the loss moves little or not at all.
`twinpipe compare --plant NAME` plants one in every rank (the optimized stack's ops are
patched in the rank processes, nowhere else; one bug also patches the reference's) and must
exit 1; the same command without ``--plant`` must exit 0. `tests/test_planted.py` runs them
on the tiny presets and docs/compare.md gives the commands at real widths.

- ``activation-round-to-zero``: the expert activation's bfloat16 output truncated
  (rounded toward zero) instead of rounded to nearest even, as a Triton store of a float32
  value does without `optimized.ops._triton.cast_rne`;
- ``cross-entropy-grad-1.01``: the fused loss's gradient 1% too large (a wrong
  normalisation); the loss itself is right;
- ``attention-drops-sink``: the attention kernel ignores GPT-OSS's sink logits;
- ``attention-drops-window``: the attention kernel ignores the sliding window;
- ``attention-frozen-sink``: the attention's forward uses the sinks, but its backward gives
  them no gradient, so they never train (what a kernel without the sinks' gradient, such as
  FlashAttention-4's ``learnable_sink`` path in one peer, ships);
- ``dispatch-wrong-expert``: one routed token of every expert dispatch is computed by the
  next local expert instead of its own;
- ``group-score-from-max``: DeepSeek-V3's group-limited routing scores each group by its
  best expert (DeepSeek-V2's rule) instead of the sum of its two best; the optimized stack's
  routers get it (`models.network.Router.group_score`) as its runner builds them.
- ``nan-to-zero-store``: the expert activations' bfloat16 stores, forward and backward, map
  NaN to zero, as the kernels' rounding once did on GPUs (a GPU's NaN ``0x7FFFFFFF`` carried
  into the sign bit). No NaN arises in a correct run at any width the tests use, so this bug
  brings its own: the first element of every activation's input is NaN, in both stacks (and
  the float32 truth). The reference's loss and gradients turn NaN, the planted stack's stay
  finite: a stack that silently zeroes NaNs must fail, never pass;
- the routing controls' bugs peers shipped (`harness.compare.planted_balancing`): the expert
  bias moved every micro-batch, from counts not summed over DP or kept in bfloat16, on no
  rank whose first chunk is dense, or by a forward-only pass; the aux-loss gradient scaled
  by 1/M twice or by the DP size;
- multi-token prediction's bugs (`harness.compare.planted_mtp`): the depth one short, the
  concatenation swapped, the embedding's gradient kept out, the loss not divided by D,
  the targets wrapped around.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.compare.planted_balancing import BALANCING_PATCHES, BALANCING_PLANTS
from harness.compare.planted_mtp import MTP_PATCHES, MTP_PLANTS

PLANTS = (
    "activation-round-to-zero",
    "cross-entropy-grad-1.01",
    "attention-drops-sink",
    "attention-drops-window",
    "attention-frozen-sink",
    "dispatch-wrong-expert",
    "group-score-from-max",
    "nan-to-zero-store",
    *BALANCING_PLANTS,
    *MTP_PLANTS,
)


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 values cut to bfloat16 by dropping the low 16 bits (rounding toward zero); a
    NaN stays NaN (dropping the bits of one whose payload is all low would give infinity)."""
    x = x.float().contiguous()
    truncated = (x.view(torch.int32) & -65536).view(torch.float32)
    return torch.where(x.isnan(), x, truncated).to(torch.bfloat16)


class _TruncatedOutput(torch.autograd.Function):
    """Forward: a float32 activation stored to bfloat16 toward zero; backward: as is."""

    @staticmethod
    def forward(ctx, x32):
        return round_toward_zero(x32)

    @staticmethod
    def backward(ctx, grad):
        return grad.float()


def _activation_round_to_zero(ops_class: type) -> Iterator[tuple[Any, str, Any]]:
    for name in ("silu_and_mul", "clamped_swiglu"):
        original = getattr(ops_class, name)

        def planted(self, x, *args, _original=original, **kwargs):
            if x.dtype != torch.bfloat16:
                return _original(self, x, *args, **kwargs)
            return _TruncatedOutput.apply(_original(self, x.float(), *args, **kwargs))

        yield ops_class, name, planted


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _cross_entropy_grad(scale: float) -> Iterator[tuple[Any, str, Any]]:
    import optimized.pipeline.dualpipev as dualpipev  # noqa: PLC0415

    original = dualpipev.linear_cross_entropy

    def planted(hidden, weight, labels, **kwargs):
        out = original(hidden, weight, labels, **kwargs)
        if isinstance(out, tuple):  # (loss, z_loss) with return_z_loss=True
            return (_ScaleGradient.apply(out[0], scale), *out[1:])
        return _ScaleGradient.apply(out, scale)

    yield dualpipev, "linear_cross_entropy", planted


def _attention(ops_class: type, drop: str) -> Iterator[tuple[Any, str, Any]]:
    original = ops_class.attention

    def planted(self, q, k, v, scaling, window=None, sinks=None):
        if drop == "sink":
            sinks = None
        else:
            window = None
        return original(self, q, k, v, scaling, window, sinks)

    yield ops_class, "attention", planted


def _frozen_sink() -> Iterator[tuple[Any, str, Any]]:
    from optimized.ops import FlashAttention  # noqa: PLC0415

    def planted(sinks, lse, delta):
        return torch.zeros_like(sinks)

    yield FlashAttention, "sink_gradient", staticmethod(planted)


def _dispatch_wrong_expert(ops_class: type) -> Iterator[tuple[Any, str, Any]]:
    original = ops_class.to_expert_order

    def planted(self, tokens, expert_ids, num_experts, rows=None):
        if expert_ids.numel() and num_experts > 1:
            expert_ids = expert_ids.clone()
            expert_ids[0] = (expert_ids[0] + 1) % num_experts
            rows = None  # the host's counts no longer match: group by the (wrong) ids
        return original(self, tokens, expert_ids, num_experts, rows=rows)

    yield ops_class, "to_expert_order", planted


def _group_score_from_max() -> Iterator[tuple[Any, str, Any]]:
    import optimized.pipeline.runner as runner  # noqa: PLC0415
    from models.network import Router, max_group_scores  # noqa: PLC0415

    original = runner.build_part

    def planted(*args, **kwargs):
        part = original(*args, **kwargs)
        for module in part.modules():
            if isinstance(module, Router):
                module.group_score = max_group_scores
        return part

    yield runner, "build_part", planted


def _nan_first(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its first element NaN (no gradient flows to that element)."""
    if x.numel() == 0:
        return x
    first = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    first.view(-1)[0] = True
    return torch.where(first, torch.full((), float("nan"), dtype=x.dtype, device=x.device), x)


def _zero_nan(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x.isnan(), 0.0) if x.dtype == torch.bfloat16 else x


class _NanToZeroStore(torch.autograd.Function):
    """Forward: a bfloat16 store that writes NaN as zero; backward: as is."""

    @staticmethod
    def forward(ctx, x):
        return _zero_nan(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _NanToZeroGradientStore(torch.autograd.Function):
    """Forward: as is; backward: the input gradient's bfloat16 store writes NaN as zero."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _zero_nan(grad)


def _nan_to_zero_store(reference_class: type, optimized_class: type):
    for name in ("silu_and_mul", "clamped_swiglu"):
        reference, optimized = getattr(reference_class, name), getattr(optimized_class, name)

        def born(self, x, *args, _original=reference, **kwargs):
            return _original(self, _nan_first(x), *args, **kwargs)

        def zeroed(self, x, *args, _original=optimized, **kwargs):
            x = _NanToZeroGradientStore.apply(_nan_first(x))
            return _NanToZeroStore.apply(_original(self, x, *args, **kwargs))

        yield reference_class, name, born
        yield optimized_class, name, zeroed


@contextmanager
def planted(name: str | None) -> Iterator[None]:
    """Bug ``name`` planted in the optimized stack of this process while the block runs
    (``None``: nothing planted)."""
    if name is None:
        yield
        return
    from optimized.ops import OptimizedOps  # noqa: PLC0415
    from reference.ops import ReferenceOps  # noqa: PLC0415

    patches: dict[str, Callable[[], Iterator[tuple[Any, str, Any]]]] = {
        "activation-round-to-zero": lambda: _activation_round_to_zero(OptimizedOps),
        "cross-entropy-grad-1.01": lambda: _cross_entropy_grad(1.01),
        "attention-drops-sink": lambda: _attention(OptimizedOps, "sink"),
        "attention-drops-window": lambda: _attention(OptimizedOps, "window"),
        "attention-frozen-sink": _frozen_sink,
        "dispatch-wrong-expert": lambda: _dispatch_wrong_expert(OptimizedOps),
        "group-score-from-max": _group_score_from_max,
        "nan-to-zero-store": lambda: _nan_to_zero_store(ReferenceOps, OptimizedOps),
        **BALANCING_PATCHES,
        **MTP_PATCHES,
    }
    if name not in patches:
        raise ValueError(f"unknown planted bug {name!r}; expected one of {PLANTS}")
    saved = []
    try:
        for owner, attribute, replacement in patches[name]():
            # The owner's own entry (a staticmethod stays one), or none: it inherits it.
            saved.append((owner, attribute, vars(owner).get(attribute, _INHERITED)))
            setattr(owner, attribute, replacement)
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            if original is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)


_INHERITED = object()
"""What a patched attribute was where its owner inherited it (restored by deleting it)."""
