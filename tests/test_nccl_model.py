"""A CPU model of NCCL's rules over the project's own DualPipeV schedules: a device-wide sync
inside a step hangs a pipeline of three or more ranks (`models.runtime.device_sync`).

gloo completes a send without its receive, so no multi-process CPU run can show this. The
`tests.test_p2p_order.FifoNetwork` (the pipeline's ranks as threads of this process, the
schedules' real ``step()``, sends matched to receives in order per pair, tags ignored) keeps
NCCL's two rules:

- a send completes only when the peer's receive has run (a receive runs once posted);
- a device-wide sync (``torch.cuda.synchronize``, the autotuner's timing, ``empty_cache``,
  the allocator's out-of-memory retry) waits for every send and receive the rank posted.

Every run of `tests.test_p2p_order` (both stacks, PP 2 to 8, M = 2 PP and 2 PP + 3) fails on
any device sync inside a step. Here, cheaply: the reference schedule with its parts on the
meta device (shapes only: the messages do not depend on the values) at PP 2 to 8 and Ms that
are and are not multiples of 2 PP passes the model; a device sync planted at each rank's
first backward passes at PP 2 and deadlocks at PP 3 and more, the report naming the ranks
and the actions they wait in; the optimized stack's real step deadlocks the same way at PP 3.

The structural alternative, receives posted as soon as their peer's send exists (DualPipe
pairs them in ``batch_isend_irecv``), is not needed: without a planted sync both schedules
pass the model, so the fix is that no step ever syncs the device (everything compiled,
tuned and connected before step 1: docs/gpus.md).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from models.network import SeededWeights, build_part
from models.runtime import device_sync, even_partition, rank_chunks
from reference.dualpipev import ReferenceDualPipeV
from reference.ops import ReferenceOps
from tests._ranks import on_cpu_rank
from tests.test_p2p_order import (
    FifoNetwork,
    P2PFailure,
    _batches,
    _config,
    _layout,
    _one_thread,
    build_schedules,
    run_pipeline,
    whole_model,
)


def _cpu_schedules(pp: int) -> tuple[list, object]:
    """The reference's schedules over a tiny dense model (plain torch: no interpreter)."""
    config = replace(_config(pp), mlp_only_layers=list(range(2 * pp)))
    stages = even_partition(config.num_hidden_layers, 2 * pp)
    schedules = []
    for pp_rank in range(pp):
        chunks = rank_chunks(stages, pp_rank)
        ops = ReferenceOps()
        part = build_part(
            config, SeededWeights(config), chunks[0] + chunks[1], embedding=pp_rank == 0,
            head=pp_rank == 0, ops=ops,
        )  # fmt: skip
        schedules.append(ReferenceDualPipeV(part, chunks, _layout(pp_rank, pp), ops))
    return schedules, config


def _small_batches(config, m: int) -> list:
    return _batches(config, m)


def sync_at_first_backward(schedules: list):
    """A plant: each rank syncs its device at the start of its first backward action."""
    synced: set[int] = set()

    def plant(rank: int, moment: str) -> None:
        action = moment.split(":")[-1]
        if "B" in action and rank not in synced:
            synced.add(rank)
            device = next(schedules[rank].part.parameters()).device
            device_sync(device, f"planted sync at rank {rank}'s first backward")

    return plant


@pytest.mark.parametrize(
    "pp",
    [pytest.param(pp, marks=[pytest.mark.slow] if pp > 5 else []) for pp in range(2, 9)],
    ids=lambda pp: f"pp{pp}",
)
def test_schedule_passes_nccl_rules_and_a_planted_sync_hangs_pp3_up(pp):
    """Without a sync, at an M no multiple of 2 PP (`tests.test_p2p_order` runs 2 PP and
    2 PP + 3, both stacks): no deadlock, nothing left over, no sync in the step. With a sync
    at each rank's first backward, communicators made before the step: PP 2 completes (its
    syncs still reported: any sync in a step is a failure), PP >= 3 deadlocks, rank 0 waiting
    in its first B1 for an F0 send that rank 1 receives only after rank 0's next send. With
    communicators made lazily inside the step, as NCCL does without a warm-up, PP 2 hangs too:
    a rank blocks creating one while its peer waits in the sync."""
    with _one_thread():
        _planted_reference(pp)


def _planted_reference(pp: int) -> None:
    schedules, config = _cpu_schedules(pp)
    if pp <= 4:
        m = 3 * pp + 1
        run_pipeline(schedules, _small_batches(config, m), "dualpipev", network=_connected(pp))
    batches = _small_batches(config, 2 * pp + 1)
    network = _connected(pp)
    plant = sync_at_first_backward(schedules)
    if pp == 2:
        run_pipeline(schedules, batches, "dualpipev", plant=plant, network=network)
        assert sorted((r, reason) for r, _, reason in network.syncs) == [
            (r, f"planted sync at rank {r}'s first backward") for r in (0, 1)
        ], network.syncs
        with pytest.raises(P2PFailure, match=r"deadlock: .*creates the \w+ communicator"):
            run_pipeline(schedules, batches, "dualpipev", plant=sync_at_first_backward(schedules))
        return
    with pytest.raises(P2PFailure) as failure:
        run_pipeline(schedules, batches, "dualpipev", plant=plant, network=network)
    message = str(failure.value)
    assert "deadlock" in message, message
    assert (
        "rank 0 device sync (planted sync at rank 0's first backward) at nB1W1F1:B1 "
        "micro-batch 0 waits send" in message
    ), message
    assert "on forward0 0->1" in message, message


def _connected(pp: int) -> FifoNetwork:
    return FifoNetwork(pp, connected=True)


def test_optimized_step_hangs_on_a_planted_sync_at_pp3():
    """The optimized stack's real step (kernels through the interpreter) at PP 3, M = 7: the
    same deadlock, found at the first backward (the run stops there: cheap)."""
    on_cpu_rank(_optimized_planted, 3)


@_one_thread()
def _optimized_planted(pp: int) -> None:
    config = _config(pp)
    schedules = build_schedules("optimized", config, pp, whole_model(config).state_dict())
    network = _connected(pp)
    with pytest.raises(P2PFailure, match=r"deadlock: rank 0 device sync .* at nB1W1F1:B1"):
        run_pipeline(
            schedules, _batches(config, 2 * pp + 1), "dualpipev",
            plant=sync_at_first_backward(schedules), network=network,
        )  # fmt: skip
    assert {rank for rank, _, _ in network.syncs} >= {0, 1}
