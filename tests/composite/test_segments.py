"""The segment state machine and the ledger's stitched records, without vLLM's scheduler
(cuts the CPU scheduler cannot be made to produce: vLLM rounds grants only for models with
bounded prefix replay)."""

from __future__ import annotations

import pytest

from kvcompose.composite.ledger import Ledger, LedgerError, LoadState
from kvcompose.composite.segments import Segment, SegmentState


def segments(*specs: tuple[int, int, int, bool, bool]) -> tuple[Segment, ...]:
    return tuple(
        Segment(child, start, end, is_async, "native" if cut else "last_segment", cut)
        for child, start, end, is_async, cut in specs
    )


def test_a_smaller_grant_cuts_the_straddling_segment_and_drops_the_rest():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, False, True), (1, 32, 96, True, True)), "", 0)
    record = ledger.allocated("r", 48)
    assert record.state is LoadState.LOADING  # vLLM parked it: the answer was async
    a, b = record.segments
    assert (a.start, a.end, b.start, b.end) == (0, 32, 32, 48)
    ledger.decide_stitch(
        "s", segments((0, 0, 32, False, True), (1, 32, 96, True, True), (2, 96, 128, True, True)),
        "", 0,
    )  # fmt: skip
    record = ledger.allocated("s", 32)
    assert [s.state for s in record.segments[1:]] == [SegmentState.DROPPED] * 2
    assert record.loaders() == (0,)


def test_a_zero_grant_drops_every_segment():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 16, 32, False, True), (1, 32, 64, True, True)), "", 16)
    record = ledger.allocated("r", 0)
    assert record.state is LoadState.NO_LOAD
    assert all(not s.active for s in record.segments)


def test_a_cut_inside_a_segment_that_cannot_be_cut_drops_it_and_gives_up_its_part():
    """A grant ending inside an uncuttable segment: the segment is dropped (its child hears 0),
    the grant's part from its start is given up, and its child is skipped on a re-lookup."""
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, False, True), (1, 32, 96, True, False)), "", 0)
    record = ledger.allocated("r", 48)
    assert record.state is LoadState.LOADING  # vLLM parked it: the answer was async
    assert [s.state for s in record.segments] == [SegmentState.LOADED, SegmentState.DROPPED]
    assert record.lost_from == 32 and record.load_end == 48
    assert record.excluded == frozenset({1})
    ledger.recv_finished("r", False)
    assert record.state is LoadState.FAILED  # part of the grant was not loaded


def test_more_than_promised_is_refused():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, False, True), (1, 32, 64, False, True)), "", 0)
    with pytest.raises(LedgerError, match="more than"):
        ledger.allocated("r", 80)


def test_a_failed_segment_holds_the_request_for_a_recovery():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, True, True), (1, 32, 64, True, True)), "", 0)
    record = ledger.allocated("r", 64)
    record.awaiting = (0, 1)
    ledger.segments_failed("r", frozenset({1}))  # the worker's metadata, before the receive
    assert record.state is LoadState.LOADING and record.excluded == frozenset({1})
    ledger.recv_finished("r", False)
    assert record.state is LoadState.RECOVERING
    assert [s.state for s in record.segments] == [SegmentState.LOADED, SegmentState.FAILED]
    with pytest.raises(LedgerError, match="recovering"):
        ledger.decide("r", 0, 32, True, "", 0)  # vLLM keeps it parked: no lookup
    reload = Segment(2, 32, 64, True, "native", True, state=SegmentState.LOADING, reload=True)
    ledger.recovered(record, (reload,), None)
    assert record.state is LoadState.LOADING and record.receivers() == (2,)
    assert record.segments[1].state is SegmentState.REPLACED
    ledger.recv_finished("r", False)
    assert record.state is LoadState.LOADED and record.lost_from is None


def test_a_recovery_that_gives_up_ends_failed_and_allows_a_re_lookup():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, True, True), (1, 32, 64, True, True)), "", 0)
    record = ledger.allocated("r", 64)
    ledger.segments_failed("r", frozenset({0}))
    ledger.recv_finished("r", False)
    ledger.recovered(record, (), 0)
    assert record.state is LoadState.LOADING and record.receivers() == ()
    ledger.recv_finished("r", False)
    assert record.state is LoadState.FAILED and record.lost_from == 0
    ledger.decide("r", 1, 32, True, "", 0)  # vLLM reset it and looks it up again
    assert ledger.get("r").segments == () and ledger.get("r").excluded == frozenset({0})


def test_invalid_blocks_exclude_the_segment_that_wrote_them():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, False, True), (1, 32, 64, False, True)), "", 0)
    record = ledger.allocated("r", 64)
    record.segments[0].block_ids, record.segments[1].block_ids = (5, 6), (7, 8)
    ledger.exclude_owners_of_blocks({8})
    assert record.excluded == frozenset({1})
