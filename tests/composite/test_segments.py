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


def test_a_cut_inside_a_segment_that_cannot_be_cut_is_refused():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, False, True), (1, 32, 96, True, False)), "", 0)
    with pytest.raises(LedgerError, match="cannot be cut"):
        ledger.allocated("r", 48)


def test_more_than_promised_is_refused():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, False, True), (1, 32, 64, False, True)), "", 0)
    with pytest.raises(LedgerError, match="more than"):
        ledger.allocated("r", 80)


def test_the_receive_settles_every_async_segment_and_excludes_the_failed_child():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, True, True), (1, 32, 64, True, True)), "", 0)
    ledger.allocated("r", 64)
    ledger.recv_finished("r", False, frozenset({1}))
    record = ledger.get("r")
    assert record.state is LoadState.FAILED
    assert [s.state for s in record.segments] == [SegmentState.LOADED, SegmentState.FAILED]
    assert record.excluded == frozenset({1})
    # vLLM resets and looks the request up again: allowed from FAILED
    ledger.decide("r", 0, 32, True, "", 0)
    assert ledger.get("r").segments == ()


def test_invalid_blocks_exclude_the_segment_that_wrote_them():
    ledger = Ledger()
    ledger.decide_stitch("r", segments((0, 0, 32, False, True), (1, 32, 64, False, True)), "", 0)
    record = ledger.allocated("r", 64)
    record.segments[0].block_ids, record.segments[1].block_ids = (5, 6), (7, 8)
    ledger.exclude_owners_of_blocks({8})
    assert record.excluded == frozenset({1})
