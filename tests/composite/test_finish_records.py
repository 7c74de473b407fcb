"""The post-finish state machine (``kvcompose.composite.ledger.Finishes``) on its own: every
path of the diagram in the module docstring, in both orders. The scheduler-level tests in
``tests/reliability/test_regressions.py`` drive the same machine through vLLM's scheduler."""

from __future__ import annotations

from kvcompose.composite.finishes import Finishes, FinishState, Signal


def test_nothing_expected_leaves_no_record() -> None:
    finishes = Finishes()
    finishes.finished("r", None, ())
    assert len(finishes) == 0
    assert finishes.received("r") == ((), Signal.PASS)
    assert finishes.sent("r") == ((), Signal.PASS)


def test_abort_while_loading_without_a_delay_passes_the_receive_to_the_owner() -> None:
    finishes = Finishes()
    finishes.finished("r", (2,), ())
    assert finishes.get("r").state is FinishState.AWAITING_RECV  # type: ignore[union-attr]
    assert finishes.sent("r") == ((), Signal.PASS)  # not expected: unchanged
    assert finishes.received("r") == ((2,), Signal.PASS)
    assert len(finishes) == 0


def test_a_delayed_free_passes_the_send_to_the_delaying_children() -> None:
    finishes = Finishes()
    finishes.finished("r", None, (0, 1))
    assert finishes.received("r") == ((), Signal.PASS)  # not expected: unchanged
    assert finishes.sent("r") == ((0, 1), Signal.PASS)
    assert len(finishes) == 0


def test_receive_first_is_held_and_the_send_goes_up() -> None:
    finishes = Finishes()
    finishes.finished("r", (1,), (0,))
    assert finishes.received("r") == ((1,), Signal.HOLD)
    assert finishes.get("r").state is FinishState.RECEIVED_AWAITING_SENDS  # type: ignore[union-attr]
    assert finishes.received("r") == ((), Signal.HOLD)  # a duplicate stays held
    assert finishes.sent("r") == ((0,), Signal.PASS)
    assert len(finishes) == 0


def test_send_first_is_held_until_the_receive_releases_it() -> None:
    finishes = Finishes()
    finishes.finished("r", (1,), (0,))
    assert finishes.sent("r") == ((0,), Signal.HOLD)
    assert finishes.snapshot() == {
        "r": {"state": "sent_awaiting_recv", "loaders": [1], "senders": [0]}
    }
    assert finishes.sent("r") == ((), Signal.HOLD)  # a duplicate stays held
    assert finishes.received("r") == ((1,), Signal.RELEASE_SEND)
    assert len(finishes) == 0


def test_a_stitched_load_passes_the_receive_to_every_child_still_loading() -> None:
    finishes = Finishes()
    finishes.finished("r", (0, 2), (1,))
    assert finishes.received("r") == ((0, 2), Signal.HOLD)
    assert finishes.sent("r") == ((1,), Signal.PASS)
    assert len(finishes) == 0


def test_a_load_in_flight_with_no_async_loader_left_still_awaits_its_receive() -> None:
    """A stitch whose grant cut every async segment: vLLM parked the request, the worker
    signals the end itself, and no child's receive it is."""
    finishes = Finishes()
    finishes.finished("r", (), (0,))
    assert finishes.sent("r") == ((0,), Signal.HOLD)
    assert finishes.received("r") == ((), Signal.RELEASE_SEND)
    assert len(finishes) == 0
