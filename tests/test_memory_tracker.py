"""harness.memory.MemoryTracker on CPU: planted allocations whose peak is known to the byte
(and on CUDA, marked ``gpu``: the allocator's statistics against the same plant)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from harness.memory import MemoryTracker


def u8(nbytes: int, device: str = "cpu") -> torch.Tensor:
    """A fresh storage of exactly ``nbytes`` bytes."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def test_planted_allocations_and_resize_free_give_the_exact_peak_and_moment():
    tracker = MemoryTracker("cpu")
    with tracker.step():
        tracker.mark("F", 0)
        a = u8(1000)  # 1000
        tracker.mark("F", 1)
        b = u8(3000)  # 4000
        a.untyped_storage().resize_(0)  # 3000: the early free of the optimized stack
        tracker.mark("B", 1)
        c = u8(1500)  # 4500 <- peak
        del b  # 1500
        tracker.mark("B", 0)
        d = u8(2900)  # 4400, not a new peak
        del c, d
    assert tracker.peak_bytes == 4500
    assert tracker.peak_moment == {"phase": "B", "micro_batch": 1}
    assert tracker.breakdown() == {
        "parameters": 0,
        "gradients": 0,
        "optimizer_state": 0,
        "activations": 4500,
        "total": 4500,
    }
    peaks = [(e["phase"], e["micro_batch"], e["peak_bytes"]) for e in tracker.timeline]
    assert peaks == [
        ("start", None, 0),
        ("F", 0, 1000),
        ("F", 1, 4000),
        ("B", 1, 4500),
        ("B", 0, 4400),
    ]
    assert a.untyped_storage().nbytes() == 0


def test_without_resize_tracking_the_peak_would_differ():
    """The same plant without the resize_(0) free peaks higher: the free is what counts."""
    tracker = MemoryTracker("cpu")
    with tracker.step():
        a = u8(1000)
        b = u8(3000)
        c = u8(1500)
        del a, b, c
    assert tracker.peak_bytes == 5500


def test_storage_resized_back_up_and_tensor_resize_are_counted():
    tracker = MemoryTracker("cpu")
    with tracker.step():
        a = u8(1000)
        storage = a.untyped_storage()
        storage.resize_(0)  # 0
        b = u8(600)  # 600
        storage.resize_(1000)  # 1600: re-materialised
        b.resize_(0)  # Tensor.resize_ never shrinks a storage: still 1600
        b.resize_(900)  # grows b's storage through the dispatcher: 1900 <- peak
        del a, storage  # 900
        c = u8(300)  # 1200
        del b, c
    assert tracker.peak_bytes == 1900


def test_storage_from_before_the_step_counts_from_its_first_use():
    old = u8(700)
    tracker = MemoryTracker("cpu")
    with tracker.step():
        a = u8(100)  # 100 (old is not known yet)
        total = old.sum()  # old is seen: 100 + 700 + 8 (int64 sum)
        old.untyped_storage().resize_(0)  # 108
        b = u8(50)  # 158
        del a, b, total
    assert tracker.peak_bytes == 808
    assert old.untyped_storage().nbytes() == 0


def test_breakdown_classifies_registered_parameters_gradients_and_optimizer_state():
    weight = torch.randn(100)  # 400 bytes, registered before the step
    state: dict[str, torch.Tensor] = {}
    tracker = MemoryTracker("cpu")
    tracker.register(parameters=[weight], optimizer_state=state)
    with tracker.step():
        tracker.mark("F", 0)
        activation = u8(1000)  # 1400
        tracker.mark("B", 0)
        weight.grad = torch.ones(100)  # 1800 (a gradient, found at the next mark)
        tracker.mark("step", None)
        state["momentum"] = torch.zeros(50)  # 2000 <- peak, state created inside the step
        del activation  # 1000
        tracker.mark("after", None)
        weight.grad = None  # 600
        extra = u8(900)  # 1500
        del extra
    assert tracker.peak_bytes == 2000
    assert tracker.peak_moment == {"phase": "step", "micro_batch": None}
    assert tracker.breakdown() == {
        "parameters": 400,
        "gradients": 400,
        "optimizer_state": 200,
        "activations": 1000,
        "total": 2000,
    }
    assert tracker.summary()["peak_moment"] == {"phase": "step", "micro_batch": None}


def test_gradient_is_counted_as_gradient_even_if_the_peak_precedes_its_accumulation():
    """A post-accumulate-grad hook names autograd's gradients; replay applies it at the peak."""
    weight = nn.Parameter(torch.randn(256))  # 1024 bytes
    tracker = MemoryTracker("cpu")
    tracker.register(parameters=[weight])
    with tracker.step():
        tracker.mark("B", 0)
        (weight * 3.0).sum().backward()
    # Peak: weight + the gradient 3*ones (1024) + the ones_like seed and scalar temporaries.
    breakdown = tracker.breakdown()
    assert breakdown["parameters"] == 1024
    assert breakdown["gradients"] == 1024
    assert breakdown["optimizer_state"] == 0
    assert breakdown["total"] == tracker.peak_bytes
    assert (
        sum(breakdown[k] for k in ("parameters", "gradients", "optimizer_state", "activations"))
        == breakdown["total"]
    )


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tracker=None) -> None:
    torch.manual_seed(1)
    x = torch.randn(16, 32)
    if tracker:
        tracker.mark("F", 0)
    loss = model(x).square().mean()
    if tracker:
        tracker.mark("B", 0)
    loss.backward()
    if tracker:
        tracker.mark("optimizer", None)
    optimizer.step()
    del loss, x


def test_real_training_step_agrees_with_torch_mem_tracker_and_categories_are_exact():
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer = _model_and_optimizer()
    torch_tracker = MemTracker()
    torch_tracker.track_external(model, optimizer)
    with torch_tracker:
        _train_step(model, optimizer)
    torch_peak = max(v["Total"] for v in torch_tracker.get_tracker_snapshot("peak").values())

    model, optimizer = _model_and_optimizer()
    tracker = MemoryTracker("cpu")
    tracker.register(parameters=model, optimizer_state=optimizer)
    with tracker.step():
        _train_step(model, optimizer, tracker)
    assert tracker.peak_bytes == torch_peak

    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    breakdown = tracker.breakdown()
    # The first SGD step creates the momentum buffers: the peak is in the optimizer step.
    assert tracker.peak_moment == {"phase": "optimizer", "micro_batch": None}
    assert breakdown["parameters"] == parameter_bytes
    assert breakdown["gradients"] == parameter_bytes
    assert breakdown["optimizer_state"] == parameter_bytes
    assert breakdown["total"] == tracker.peak_bytes


def test_two_consecutive_steps_each_have_their_own_peak():
    model, optimizer = _model_and_optimizer()
    tracker = MemoryTracker("cpu")
    tracker.register(parameters=model, optimizer_state=optimizer)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    with tracker.step():
        _train_step(model, optimizer, tracker)
        big = u8(10_000_000)  # dwarfs everything in step 1
        tracker.mark("big", None)
        del big
    first = tracker.breakdown()
    assert first["activations"] >= 10_000_000

    # Gradients and momentum survive into step 2: they are there from its start.
    with tracker.step():
        tracker.mark("F", 0)
        a = u8(1000)
        a.untyped_storage().resize_(0)
        b = u8(800)
        del a, b
    second = tracker.breakdown()
    assert second == {
        "parameters": parameter_bytes,
        "gradients": parameter_bytes,
        "optimizer_state": parameter_bytes,
        "activations": 1000,
        "total": 3 * parameter_bytes + 1000,
    }
    assert tracker.peak_moment == {"phase": "F", "micro_batch": 0}

    optimizer.zero_grad(set_to_none=True)  # between steps: frees seen, not logged
    with tracker.step():
        c = u8(10)
        del c
    assert tracker.peak_bytes == 2 * parameter_bytes + 10
    assert tracker.peak_moment == {"phase": "start", "micro_batch": None}


def test_resize_is_restored_after_the_step_even_on_error():
    original = torch.UntypedStorage.resize_
    tracker = MemoryTracker("cpu")
    with pytest.raises(ValueError, match="boom"), tracker.step():
        assert torch.UntypedStorage.resize_ is not original
        raise ValueError("boom")
    assert torch.UntypedStorage.resize_ is original
    with tracker.step():  # usable again
        x = u8(5)
        del x
    assert tracker.peak_bytes == 5


def test_misuse_gets_clear_errors():
    tracker = MemoryTracker("cpu")
    with pytest.raises(RuntimeError, match="no finished step"):
        _ = tracker.peak_bytes
    with pytest.raises(RuntimeError, match="outside"):
        tracker.mark("F", 0)
    with tracker.step():
        with pytest.raises(RuntimeError, match="do not nest"), tracker.step():
            pass
        other = MemoryTracker("cpu")
        with pytest.raises(RuntimeError, match="another MemoryTracker"), other.step():
            pass
    with pytest.raises(ValueError, match="device='banana'"):
        MemoryTracker("banana")
    with pytest.raises(ValueError, match="'meta' is not supported"):
        MemoryTracker("meta")


@pytest.mark.gpu  # reads the CUDA allocator's statistics
def test_cuda_peak_from_allocator_statistics():
    tracker = MemoryTracker("cuda")
    weight = torch.randn(1024, device="cuda")
    tracker.register(parameters=[weight])
    with tracker.step():
        tracker.mark("F", 0)
        a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        tracker.mark("B", 0)
        b = torch.empty(1 << 21, dtype=torch.uint8, device="cuda")
        del a, b
        tracker.mark("W", None)
    assert tracker.peak_bytes >= (1 << 20) + (1 << 21) + 4096
    assert tracker.peak_moment == {"phase": "B", "micro_batch": 0}
    assert tracker.breakdown()["parameters"] == 4096
    assert tracker.breakdown()["total"] == tracker.peak_bytes


@pytest.mark.gpu
def test_cuda_allocator_sees_the_planted_peak_the_cpu_tracker_sees():
    """The CPU test's plant (allocations, a ``resize_(0)`` free, a peak and a later lower
    moment) on the GPU, in 512-byte multiples (the caching allocator's granule, so nothing
    is rounded): the CUDA backend finds the same peak, moment and timeline up to the peak
    as the CPU backend, above what was in use as the step began. (After the step's peak
    the allocator's one maximum says nothing per phase: the CUDA timeline's last entry
    keeps its start bytes.)"""
    peaks = {}
    for device in ("cpu", "cuda"):
        tracker = MemoryTracker(device)
        with tracker.step():
            tracker.mark("F", 0)
            a = u8(1024, device)  # 1024
            tracker.mark("F", 1)
            b = u8(3072, device)  # 4096
            a.untyped_storage().resize_(0)  # 3072
            tracker.mark("B", 1)
            c = u8(1536, device)  # 4608 <- peak
            del b  # 1536
            tracker.mark("B", 0)
            d = u8(2560, device)  # 4096, not a new peak
            del c, d
        before = tracker.timeline[0]["start_bytes"]  # in use as the step began (CPU: 0)
        timeline = [(e["phase"], e["micro_batch"], e["peak_bytes"] - before)
                    for e in tracker.timeline]  # fmt: skip
        peaks[device] = (tracker.peak_bytes - before, tracker.peak_moment, timeline)
    assert peaks["cpu"][:2] == (4608, {"phase": "B", "micro_batch": 1})
    assert peaks["cuda"][:2] == peaks["cpu"][:2]
    assert peaks["cpu"][2][:4] == [("start", None, 0), ("F", 0, 1024), ("F", 1, 4096),
                                   ("B", 1, 4608)]  # fmt: skip
    assert peaks["cuda"][2][:4] == peaks["cpu"][2][:4]


@pytest.mark.gpu  # cuBLAS's workspaces live in the CUDA allocator
def test_cuda_cublas_workspaces_are_reported_apart_from_activations():
    tracker = MemoryTracker("cuda")
    weight = torch.randn(256, 256, device="cuda")
    tracker.register(parameters=[weight])
    for _ in range(2):  # each step clears the workspaces and allocates its own
        with tracker.step():
            tracker.mark("F", 0)
            out = weight @ weight
            del out
        breakdown = tracker.breakdown()
        assert breakdown["workspaces"] > 0, breakdown  # cuBLAS's, allocated inside the step
        named = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
        assert named + breakdown["activations"] + breakdown["workspaces"] == breakdown["total"]
        assert breakdown["activations"] < breakdown["workspaces"]  # out: 256 KiB


def test_a_free_made_by_another_thread_counts_at_the_last_use():
    """gloo's worker thread can hold the last reference to a collective's buffer and free
    it whenever it next gets the GIL: the tracker records such a free where the step's
    own thread last used the storage, so the peak does not depend on the scheduler."""
    tracker = MemoryTracker("cpu")
    held: list[torch.Tensor] = []
    with tracker.step():
        tracker.mark("F", 0)
        a = u8(1000)  # 1000
        a.add_(1)  # its last use
        held.append(a)
        del a
        tracker.mark("F", 1)
        b = u8(3000)  # 4000 if ``a`` counted until the other thread let it go
        c = u8(500)
        worker = threading.Thread(target=held.clear)  # the last reference, dropped there
        worker.start()
        worker.join()
        tracker.mark("B", 1)
        d = u8(200)  # 3700
        del b, c, d
    assert tracker.peak_bytes == 3700
    assert tracker.peak_moment == {"phase": "B", "micro_batch": 1}
    assert tracker.breakdown()["activations"] == 3700
    peaks = [(e["phase"], e["start_bytes"], e["peak_bytes"]) for e in tracker.timeline]
    assert peaks == [("start", 0, 0), ("F", 0, 1000), ("F", 0, 3500), ("B", 3500, 3700)]
