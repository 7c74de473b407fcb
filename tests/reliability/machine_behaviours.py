"""What the randomized machine draws per child and request: a scripted ``Behaviour``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from machine_shapes import BLOCK, FOREVER, MAX_PROMPT

from kvcompose.testing.scripted import Behaviour

_DEFAULT = Behaviour()


class B(Behaviour):
    """A ``Behaviour`` that prints only what differs from the default (falsifying examples
    stay readable); ``delay_free_if_loading`` is shown as ``delay_while_loading``."""

    def __repr__(self) -> str:
        parts = []
        for name in Behaviour.__dataclass_fields__:
            value = getattr(self, name)
            if name == "delay_free_if_loading":
                if self.delay_free and value:
                    parts.append("delay_while_loading")
                continue
            if value != getattr(_DEFAULT, name):
                if value is True:
                    parts.append(name)
                elif name == "raise_in":
                    parts.append(f"raise_in={sorted(value)}")
                else:
                    parts.append(f"{name}={value!r}")
        return f"B({', '.join(parts)})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


@dataclass(frozen=True)
class Gen:
    """What the behaviour generator may draw in one example."""

    breakers: bool  # contract breakers allowed (violations expected, no crash)
    deadline_zero: bool  # node lookup deadline ~0 s (1 ns): a second None is a miss
    policy: str  # kv_load_failure_policy
    aligned: bool = False  # hits mostly on block boundaries (stitch shapes)
    #: leaves under ``on_error: fail``: their raises must reach vLLM (the example ends there)
    fail_leaves: frozenset[str] = frozenset()


#: Worker-side methods a child may raise in (see ``kvcompose.testing.scripted``).
WORKER_RAISES = (
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
)


#: The strategies a draw uses, built once: hypothesis validates a strategy the first time it
#: is drawn from, and building them on every draw took 5.4 s of a 22 s profiled sequence
#: (2.2 s built once).
_KIND = st.sampled_from(("miss", "sync", "async"))
_TOKENS = st.one_of(
    st.integers(1, MAX_PROMPT), st.sampled_from((BLOCK, 2 * BLOCK, 3 * BLOCK, 5 * BLOCK))
)
_PENDING = {
    False: st.one_of(st.just(0), st.integers(1, 3)),
    True: st.one_of(st.just(0), st.integers(1, 3), st.just(FOREVER)),  # deadline_zero
}
_LOAD = st.sampled_from(("ok", "ok", "fail", "invalid"))
_WORKER_RAISE = st.sampled_from(WORKER_RAISES)
_UP_TO = {n: st.integers(0, n) for n in (3, 5, 7, 15)}
_ONE_TO = {n: st.integers(1, n) for n in (4, MAX_PROMPT)}


@functools.cache
def _params(leaf_name: str) -> st.SearchStrategy[dict[str, int] | None]:
    """The ``kv_transfer_params`` child ``leaf_name`` may return (``ScriptedConnector``
    copies them before use, so one dict serves every draw)."""
    return st.sampled_from((None, {f"p.{leaf_name}": 1}))


@functools.cache  # one strategy per child and generator, like the strategies it draws from
@st.composite
def behaviours(draw: st.DrawFn, leaf_name: str, gen: Gen, rank: int = 0) -> Behaviour:
    kind = draw(_KIND, label=f"{leaf_name}.kind")
    tokens = 0
    if kind != "miss" and gen.aligned:
        unaligned = draw(_UP_TO[7], label=f"{leaf_name}.unaligned") == 0
        # later children tend to hold more, so that three segments stitch too
        ladder = min((rank + 1 + draw(_UP_TO[3])) * BLOCK, MAX_PROMPT - BLOCK)
        tokens = draw(_ONE_TO[MAX_PROMPT]) if unaligned else ladder
    elif kind != "miss":
        tokens = draw(_TOKENS)
    # holds what earlier requests of its prompt family stored (partial prefixes included)
    stores = kind != "miss" and draw(_UP_TO[3], label=f"{leaf_name}.stores") == 3
    pending = draw(_PENDING[gen.deadline_zero])
    load = "ok"
    invalid_block = 0
    load_steps = 1
    if kind != "miss":
        load = draw(_LOAD)
        if load != "ok":
            invalid_block = draw(_UP_TO[3])
    if kind == "async":
        load_steps = draw(_ONE_TO[4])
    delay = draw(_UP_TO[3]) == 0
    send_steps = draw(_ONE_TO[4]) if delay else 1
    params = draw(_params(leaf_name))
    raise_in: set[str] = set()
    if draw(_UP_TO[15]) == 0:
        raise_in.add("get_num_new_matched_tokens")
    if (tokens == 0 or raise_in) and draw(_UP_TO[15]) == 0:
        # only where the child cannot own the load: an owner's alloc error must propagate
        raise_in.add("update_state_after_alloc")
    if draw(_UP_TO[15]) == 0:
        raise_in.add("request_finished")
    if draw(_UP_TO[7], label=f"{leaf_name}.worker_raise") == 0:
        raise_in.add(draw(_WORKER_RAISE, label=f"{leaf_name}.worker_method"))
    b = B(
        tokens=tokens,
        is_async=kind == "async",
        pending_lookups=pending,
        load=load,
        invalid_block=invalid_block,
        load_steps=load_steps,
        delay_free=delay,
        send_steps=send_steps,
        params=params,
        raise_in=frozenset(raise_in),
        delay_free_if_loading=False,
        stores=stores,
    )
    if gen.breakers:
        b.delay_free_if_loading = delay and draw(st.booleans())
        b.break_zero_async = draw(_UP_TO[5]) == 0
        b.break_rogue_recv = draw(_UP_TO[5]) == 0
        b.break_duplicate_recv = kind == "async" and draw(_UP_TO[3]) == 0
        b.break_rogue_send = draw(_UP_TO[5]) == 0
    return b


def is_breaker(b: Behaviour) -> bool:
    return (
        b.break_zero_async
        or b.break_rogue_recv
        or b.break_duplicate_recv
        or b.break_rogue_send
        or (b.delay_free and b.delay_free_if_loading)
    )
