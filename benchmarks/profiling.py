"""A pytest plugin: a torch.profiler trace of a whole benchmark run.

``pytest BENCHMARKS -p benchmarks.profiling --profile-dir DIR`` (what ``twinpipe bench
--profile DIR`` runs) profiles the session with `optimized.train.profile_region`:
``DIR/bench.trace.json`` is a Chrome trace (open it in Perfetto, https://ui.perfetto.dev, or
chrome://tracing) with each benchmark marked by its test id, and ``DIR/bench.top_ops.md``
the top kernels (on a GPU) and host ops by self time. A plugin rather than a conftest, so
that any benchmark folder can be profiled.

The device is where the benchmarks compute (`models.runtime.triton_device`: what
``twinpipe bench --device`` handed the run): its kernels are recorded on a GPU.
"""

from __future__ import annotations

import contextlib

import pytest

PROFILE_LABEL = "bench"
_profile = contextlib.ExitStack()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--profile-dir",
        metavar="DIR",
        help="write a torch.profiler trace of the run (DIR/bench.trace.json) and its top ops "
        "(DIR/bench.top_ops.md)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    folder = session.config.getoption("--profile-dir")
    if folder:
        from models.runtime import triton_device
        from optimized.train import profile_region

        device = triton_device()
        title = f"twinpipe bench on {device}"
        _profile.enter_context(profile_region(folder, PROFILE_LABEL, device, title))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Each benchmark marked in the trace by its test id (when profiling)."""
    if not item.config.getoption("--profile-dir"):
        return (yield)
    from torch.profiler import record_function

    with record_function(item.nodeid):
        return (yield)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _profile.close()  # writes the trace and the table
