"""The worker half's signals for stitched loads, driven directly (the tiny model has one KV
cache group, so the several-groups path cannot be reached through vLLM's scheduler here)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.composite.guard import Guard
from kvcompose.composite.metadata import CompositeMetadata, StitchLoad
from kvcompose.composite.worker_signals import WorkerSignals


def results(recv=(), failed=()) -> KVConnectorTransferResults:
    out = KVConnectorTransferResults()
    out.finished_recving = set(recv) | set(failed)
    out.failed_recving = set(failed)
    return out


def signals(**stitch: object) -> tuple[WorkerSignals, Guard]:
    """A parked stitched load of ``r``: child 0 and 2 async, child 1 sync."""
    guard = Guard("root", ["a", "b", "c"], strict=False, on_error=["miss"] * 3)
    sig = WorkerSignals(guard)
    sig.on_metadata(
        CompositeMetadata(
            (None, None, None),
            stitches={
                "r": StitchLoad(waits=(0, 2), blocks={0: (1, 2), 1: (3,), 2: (4, 5)}, **stitch)
            },
            sync_segments={"r": ((1, (3,)),)},
        )
    )
    return sig, guard


def test_one_receive_once_every_async_segment_reported():
    sig, guard = signals()
    out = sig.combine([results(recv={"r"}), None, None])
    assert not out.finished_recving
    assert sig.live() == {"stitches_in_flight": {"r": [2]}}
    out = sig.combine([None, None, results(recv={"r"})])
    assert out.finished_recving == {"r"} and not out.failed_recving
    assert sig.live() == {} and not guard.violations
    assert sig.take_failed_blocks() == set()


def test_a_failed_segment_is_hidden_from_vllm_and_told_to_the_scheduler_half():
    sig, _ = signals()
    sig.combine([results(recv={"r"}), None, None])
    out = sig.combine([None, None, results(failed={"r"})])
    assert out.finished_recving == {"r"} and not out.failed_recving
    assert sig.take_failed_blocks() == set()
    assert sig.take_segment_failures() == {"r": frozenset({2})}


def test_what_the_scheduler_half_gave_up_goes_up_with_the_rounds_receive():
    sig, _ = signals(invalid=(4, 5))
    sig.combine([results(recv={"r"}), None, None])
    assert sig.take_failed_blocks() == set()  # not before the round's receive
    out = sig.combine([None, None, results(recv={"r"})])
    assert out.finished_recving == {"r"} and not out.failed_recving
    assert sig.take_failed_blocks() == {4, 5}
    sig, _ = signals(failed=True)  # several KV cache groups: the request fails
    out = sig.combine([results(recv={"r"}), None, results(recv={"r"})])
    assert out.finished_recving == {"r"} and out.failed_recving == {"r"}
    assert sig.take_failed_blocks() == set()


def test_a_child_raising_fails_its_own_segments_only():
    sig, _ = signals()
    sig.fail_loads_of(1)  # the sync segment's child
    sig.fail_loads_of(2)  # an async segment's child: no report awaited
    out = sig.combine([results(recv={"r"}), None, None])
    assert out.finished_recving == {"r"} and not out.failed_recving
    assert sig.take_failed_blocks() == set()
    assert sig.take_segment_failures() == {"r": frozenset({1, 2})}


def test_a_sync_stitch_that_was_not_parked_passes_its_failures_up():
    guard = Guard("root", ["a", "b"], strict=False, on_error=["miss"] * 2)
    sig = WorkerSignals(guard)
    sig.on_metadata(CompositeMetadata((None, None), sync_segments={"r": ((0, (1,)), (1, (2, 3)))}))
    sig.fail_loads_of(1)
    assert sig.take_failed_blocks() == {2, 3}
    assert sig.take_segment_failures() == {}


def test_invalid_blocks_inside_a_segment_fail_that_segment():
    """A child reporting blocks of its segment invalid (a sync load's way to fail), while the
    round is in flight or after its receive went up in the same step."""
    sig, _ = signals()
    assert sig.stitches.claim_errors(1, {3, 99}) == {99}  # 99 is no stitch's
    assert sig.stitches.claim_errors(0, {4}) == {4}  # child 2's block, reported by child 0
    out = sig.combine([results(recv={"r"}), None, results(recv={"r"})])
    assert out.finished_recving == {"r"}
    assert sig.stitches.claim_errors(2, {5}) == set()  # after the receive, same step
    assert sig.take_segment_failures() == {"r": frozenset({1, 2})}
    assert sig.stitches.claim_errors(2, {5}) == {5}  # a later step: no longer a stitch's


def test_a_receive_from_a_child_with_no_segment_is_a_violation():
    sig, guard = signals()
    out = sig.combine([None, results(recv={"r"}), None])
    assert not out.finished_recving
    assert guard.violations[("b", "unexpected_recv")] == 1
