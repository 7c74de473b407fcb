"""The worker half's signals for stitched loads, driven directly (the tiny model has one KV
cache group, so the several-groups path cannot be reached through vLLM's scheduler here)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.composite.guard import Guard
from kvcompose.composite.metadata import CompositeMetadata, StitchLoad
from kvcompose.composite.worker import WorkerSignals


def results(recv=(), failed=()) -> KVConnectorTransferResults:
    out = KVConnectorTransferResults()
    out.finished_recving = set(recv) | set(failed)
    out.failed_recving = set(failed)
    return out


def signals(block_level: bool) -> tuple[WorkerSignals, Guard]:
    guard = Guard("root", ["a", "b", "c"], strict=False, on_error=["miss"] * 3)
    sig = WorkerSignals(guard)
    sig.on_metadata(
        CompositeMetadata(
            (None, None, None),
            stitches={"r": StitchLoad(waits=(0, 2), blocks={0: (1, 2), 1: (3,), 2: (4, 5)})},
            sync_segments={"r": ((1, (3,)),)},
            block_level_failures=block_level,
        )
    )
    return sig, guard


def test_one_receive_once_every_async_segment_reported():
    sig, guard = signals(block_level=True)
    out = sig.combine([results(recv={"r"}), None, None])
    assert not out.finished_recving
    assert sig.live() == {"stitches_in_flight": {"r": [2]}}
    out = sig.combine([None, None, results(recv={"r"})])
    assert out.finished_recving == {"r"} and not out.failed_recving
    assert sig.live() == {} and not guard.violations
    assert sig.take_failed_blocks() == set()


def test_a_failed_segment_goes_up_as_its_blocks_on_one_group():
    sig, _ = signals(block_level=True)
    sig.combine([results(recv={"r"}), None, None])
    out = sig.combine([None, None, results(failed={"r"})])
    assert out.finished_recving == {"r"} and not out.failed_recving
    assert sig.take_failed_blocks() == {4, 5}
    assert sig.take_segment_failures() == {"r": frozenset({2})}


def test_a_failed_segment_fails_the_request_on_several_groups():
    sig, _ = signals(block_level=False)
    out = sig.combine([results(failed={"r"}), None, results(recv={"r"})])
    assert out.finished_recving == {"r"} and out.failed_recving == {"r"}
    assert sig.take_failed_blocks() == set()
    assert sig.take_segment_failures() == {"r": frozenset({0})}


def test_a_child_raising_fails_its_own_segments_only():
    sig, _ = signals(block_level=True)
    sig.fail_loads_of(1)  # the sync segment's child: its blocks are bad
    assert sig.take_failed_blocks() == {3}
    sig.fail_loads_of(2)  # an async segment's child: its segment failed, no report awaited
    out = sig.combine([results(recv={"r"}), None, None])
    assert out.finished_recving == {"r"}
    assert sig.take_failed_blocks() == {4, 5}


def test_a_receive_from_a_child_with_no_segment_is_a_violation():
    sig, guard = signals(block_level=True)
    out = sig.combine([None, results(recv={"r"}), None])
    assert not out.finished_recving
    assert guard.violations[("b", "unexpected_recv")] == 1
