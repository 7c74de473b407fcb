"""What a lookup policy decides, as one abstract class: the node's lookup
(``kvcompose.composite.lookup.Lookup``) asks the children, checks their answers through the
guard and records the decision; the policy says which children are asked, where each is
asked, and how their answers become the plan.

Every policy answers two ways (``tests/composite/test_hot_paths.py`` holds them to one
answer on random draws):

- the general rule, for any request: the lookup asks the candidates in order, each where the
  policy says (``start``) unless it says not to (``cannot_ask``); each hit, cut where a sync
  load would leave vLLM nothing to compute (``synced``), is offered to the plan in the making
  (``refuses``, ``take``), and ``finish`` makes the plan;
- the common case (``settle``), where the candidates are fixed and every child is asked at
  the local hit: the lookup's one fast loop hands over the hits, and the policy records the
  decision as the general rule would: one child's load straight into the ledger and the
  counters the lookup keeps (this runs for every request with a hit: a call less on it is
  measurable), a plan of several segments through the lookup (``LookupHost.record``).

A policy that prices its plans by load times (``fastest``) carries a cost model (``costs``,
``LoadTimes``); the node's worker half then times each load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvcompose.composite.segments import Segment

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from kvcompose import tree as nodes
    from kvcompose.composite.ledger import Ledger
    from kvcompose.composite.stats import NodeCounters
    from kvcompose.tree.ranges import RangeSupport

#: A miss, as vLLM's contract spells it.
MISS = (0, False)

Answer = tuple[int | None, bool]
Plan = tuple[Segment, ...]
#: A hit of the common case: the child, where its hit ends, whether it loads async.
Hit = tuple[int, int, bool]


class Pending:
    """A child answered ``None`` before the lookup could decide."""


PENDING = Pending()


class Recompute(tuple):  # type: ignore[type-arg]
    """``fastest``'s plan of no load, chosen over hits (a miss without hits weighs nothing)."""


#: The recompute plan: an empty plan that ``fastest`` weighed and counts.
RECOMPUTE: Plan = Recompute()


@dataclass(frozen=True)
class Candidates:
    """The children a request's lookup asks, in order, and why (the ledger's reason)."""

    children: tuple[int, ...]
    reason: str


class ChildChoice(Protocol):
    """Which children a node asks for a request: chain and fan-out always the same ones
    (``fixed``), route by its rules (``kvcompose.composite.policies.route``)."""

    fixed: Candidates | None

    def candidates(self, request: Request) -> Candidates: ...


class FixedChoice:
    """The same candidates for every request (chain: every child; fan-out: ``load_from``)."""

    def __init__(self, candidates: Candidates) -> None:
        self.fixed: Candidates | None = candidates

    def candidates(self, request: Request) -> Candidates:
        return self.fixed  # type: ignore[return-value]


class LookupHost(Protocol):
    """What a policy calls back on the lookup that holds it (asking, the guard's cut, the
    record of a plan stay the lookup's)."""

    def ask(self, child: int, request: Request, at: int) -> Answer: ...

    def leave_one(self, child: int, request: Request, at: int, tokens: int) -> int: ...

    def record(
        self, req_id: str, found: Plan, reason: str, local: int, record: Any
    ) -> tuple[int, bool]: ...


class LoadTimes(Protocol):
    """A policy's model of load times, fed by the scheduler half (``fastest``'s ``Costs``):
    each step's scheduled tokens, the worker half's times of loads, the requests whose loads
    will not be timed."""

    def step(self, scheduled_tokens: int) -> None: ...

    def timed(self, times: Mapping[tuple[str, int], float]) -> list[tuple[Any, float]]: ...

    def forget(self, req_id: str, *, in_flight_only: bool = False) -> None: ...


@dataclass(frozen=True)
class PolicySetting:
    """What a node's policy is built from (fixed for the node's life)."""

    tree: nodes.Composite
    choice: ChildChoice
    supports: tuple[RangeSupport, ...]
    block_size: int
    #: the node's ledger and counters, which the lookup keeps (the common case writes to them)
    ledger: Ledger
    counters: NodeCounters
    #: ``first`` asks the children after the first hit too (the first hit still owns), as
    #: vLLM's MultiConnector does: a child that pins or prefetches on lookup relies on it
    ask_every_child: bool = False
    #: to price loads (``fastest``): the model's KV bytes a token; None where nothing is priced
    vllm_config: VllmConfig | None = None


class LookupPolicy(ABC):
    """A lookup policy: which children are asked, where, and how the answers become a plan
    (a tuple of segments, ``kvcompose.composite.segments``; one segment is an owner's load,
    several a stitched load). Register a new one in ``kvcompose.composite.policies.factory``."""

    #: the ``policy`` of a chain that selects it (fan-out and route take ``first``)
    name: ClassVar[str]
    #: a child answering ``None`` holds the decision of the children after it (they are not
    #: asked); False: the rest are asked first, and the decision waits all the same
    stops_at_pending: ClassVar[bool] = True
    #: each child is asked where the plan so far ends (``start``), not at the local hit
    asks_where_plan_ends: ClassVar[bool] = False
    #: the worker half times each load (``costs`` is set)
    times_loads: ClassVar[bool] = False
    #: the common case (``settle``) exists: fixed candidates all asked at the local hit
    has_fast_path: ClassVar[bool] = True
    #: ``settle`` is handed every hit, not only the longest
    weighs_every_hit: bool = False

    def __init__(self, setting: PolicySetting) -> None:
        self.choice = setting.choice
        #: the candidates of every request where they do not hang on it (chain, fan-out)
        self.fixed = setting.choice.fixed
        #: ``candidates(request)``: the children asked for a request, in order, and why
        self.candidates = setting.choice.candidates
        self.supports = setting.supports
        self.block_size = setting.block_size
        self.counters = setting.counters
        #: the node's ledger: the common case records one child's load in it as the lookup's
        #: ``record`` would (no segment object: the ledger keeps only its owner)
        self.ledger = setting.ledger
        #: the common case stops at the first hit
        self.stops_at_hit = False
        #: the load-time model (``times_loads``), None otherwise
        self.costs: LoadTimes | None = None
        #: the common case's reason (its candidates are fixed)
        self.fixed_reason = "" if self.fixed is None else self.fixed.reason

    #: the lookup that asks for this policy (``attach``)
    host: LookupHost

    def attach(self, host: LookupHost) -> None:
        """The lookup that asks for this policy (``settle`` records plans through it)."""
        self.host = host

    # ------------------------------------------------------------ the general rule
    def start(self, local: int, plan: Sequence[Segment]) -> int:
        """Where the next child is asked."""
        return local

    def cannot_ask(self, child: int, at: int, plan: Sequence[Segment]) -> str | None:
        """Why ``child`` is not asked at ``at`` (the debug trace's words); None: it is."""
        return None

    def synced(self, is_async: bool, plan: Sequence[Segment]) -> bool:
        """Whether a hit joining ``plan`` loads before vLLM schedules the request (then it
        must leave vLLM a token to compute: ``Guard.leave_one_token``)."""
        return not is_async

    def refuses(self, segment: Segment, plan: Sequence[Segment]) -> str | None:
        """Why a hit's ``segment`` cannot join ``plan`` (the trace's words); None: it can."""
        return None

    @abstractmethod
    def take(self, plan: list[Segment], segment: Segment) -> bool:
        """Offer a hit's ``segment`` to the plan in the making; True: ask no further child."""

    def finish(
        self, request: Request, local: int, plan: list[Segment], trace: list[str] | None
    ) -> Plan:
        """The decided plan from the hits ``take`` kept."""
        return tuple(plan)

    # ------------------------------------------------------------ the common case
    def settle(
        self,
        request: Request,
        local: int,
        child: int,
        end: int,
        is_async: bool,
        hits: list[Hit] | None,
        any_async: bool,
        num_tokens: int,
    ) -> Answer:
        """The common case's decision (every candidate asked at ``local``, in order, at
        least one hit), recorded as ``finish`` and the lookup's ``record`` would record it;
        vLLM's answer. The fast loop hands over what it saw without making objects it need
        not (a list and a call per hit cost more than the rest of a one-owner decision):

        - ``child``, ``end``, ``is_async``: the longest hit (the first of the longest; the
          first hit where the policy stops at it);
        - ``hits``, ``any_async``: every hit in order, and whether one is async, where the
          policy ``weighs_every_hit`` (else None, False);
        - ``num_tokens``: ``request.num_tokens`` where a sync hit read it, else 0 (it is a
          property: read once at the most).

        Overrides leave the types to this declaration (one signature, not one a policy)."""
        raise NotImplementedError(f"{self.name} has no common case (``has_fast_path``)")

    # ------------------------------------------------------------ bookkeeping hooks
    def repeat(self, req_id: str) -> None:  # noqa: B027 (a hook most policies leave empty)
        """``req_id`` is asked again before its allocation: its plan never started."""

    def decided(self, req_id: str, plan: Plan, counted: bool) -> None:  # noqa: B027
        """A decision of the general rule is recorded (``counted``: not a repeat)."""
