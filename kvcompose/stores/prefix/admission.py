"""Which saves a store accepts: its admission rule, and the frequency sketch it reads.

A small fast tier that saves every new prompt fills with chunks seen once and evicts the
ones that recur; an admission rule keeps those out (Dynamo KVBM's ``presence``/
``presence_lfu`` filters, SGLang HiCache's selective write-through do the same). The rule
is per store: ``admit_min_prompt_tokens`` (short prompts are cheap to recompute),
``admit_min_seen`` (a chunk is saved once ``K`` requests have carried it, counted in a
count-min sketch of fixed size that halves its counters now and then, so old popularity
fades) and ``admit_when`` (only requests that meet a route rule's conditions: a
``kv_transfer_params`` key, prompt-length bounds, a predicate). Chunks another tier
loaded for the request are saved whatever the rule says when the store has
``promote: true`` (see :mod:`kvcompose.stores.prefix.scheduler`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcompose.tree.conditions import (
    Predicate,
    RequestCondition,
    describe_condition,
    load_predicate,
    matches,
)

if TYPE_CHECKING:
    from kvcompose.stores.prefix.config import PrefixStoreConfig

logger = logging.getLogger(__name__)


class FrequencySketch:
    """Count-min sketch over chunk keys with periodic halving (TinyLFU's "reset").

    ``depth`` rows of ``width`` small counters; a key's count is the minimum of its
    counters (an over-estimate only through collisions). After ``reset_every`` additions
    (default ``10 * width``) every counter is halved.
    """

    def __init__(self, width: int = 1 << 14, depth: int = 4, reset_every: int | None = None):
        self.width = width
        self.depth = depth
        self._rows = [bytearray(width) for _ in range(depth)]
        self._adds = 0
        self._reset_every = reset_every or 10 * width

    def _slots(self, key: str) -> list[int]:
        digest = hashlib.blake2b(key.encode("ascii"), digest_size=4 * self.depth).digest()
        return [
            int.from_bytes(digest[4 * i : 4 * i + 4], "little") % self.width
            for i in range(self.depth)
        ]

    def add(self, key: str) -> None:
        for row, slot in zip(self._rows, self._slots(key), strict=True):
            if row[slot] < 255:
                row[slot] += 1
        self._adds += 1
        if self._adds >= self._reset_every:
            self._halve()

    def add_all(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.add(key)

    def count(self, key: str) -> int:
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key), strict=True))

    def _halve(self) -> None:
        for row in self._rows:
            for i, v in enumerate(row):
                if v:
                    row[i] = v >> 1
        self._adds = 0


@dataclass(frozen=True)
class AdmissionRule:
    """A store's admission rule (from its config); ``everything`` admits every save."""

    min_prompt_tokens: int = 0
    min_seen: int = 1
    promote: bool = False
    #: Only requests meeting these conditions are saved (None: every request).
    when: RequestCondition | None = None
    predicate: Predicate | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, config: PrefixStoreConfig) -> AdmissionRule:
        """The rule a store's config sets; its ``admit_when`` predicate imported now, so a
        wrong name fails the engine's start with one line instead of every save."""
        when = config.admit_when
        try:
            predicate = load_predicate(when.predicate) if when is not None else None
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"PrefixStoreConnector: admit_when.predicate {when.predicate!r} "  # type: ignore[union-attr]
                f"cannot be loaded: {exc}"
            ) from None
        return cls(
            config.admit_min_prompt_tokens, config.admit_min_seen, config.promote, when, predicate
        )

    @property
    def everything(self) -> bool:
        return self.min_prompt_tokens <= 0 and self.min_seen <= 1 and self.when is None

    def selects(self, request: Any) -> bool:
        """Whether ``admit_when`` selects vLLM's ``request`` (raises when it cannot be
        judged; see ``kvcompose.tree.conditions.matches``)."""
        return self.when is None or matches(self.when, self.predicate, request)

    def describe(self) -> str:
        """One line for ``kvcompose explain``."""
        parts = []
        if self.min_prompt_tokens > 0:
            parts.append(f"prompts >= {self.min_prompt_tokens} tokens")
        if self.min_seen > 1:
            parts.append(f"chunks seen >= {self.min_seen} times")
        if self.when is not None:
            parts.append(f"requests where {describe_condition(self.when)}")
        rule = " and ".join(parts) if parts else "every save"
        if self.promote:
            rule += "; chunks another tier loaded are promoted into it"
        return rule


class Admission:
    """A store's admission decisions: its rule, the sketch the rule reads, and the judgement
    of ``admit_when`` (a condition that cannot be judged rejects, logged once)."""

    def __init__(self, rule: AdmissionRule) -> None:
        self.rule = rule
        self.sketch = FrequencySketch() if rule.min_seen > 1 else None
        self._warned = False

    def seen(self, keys: Iterable[str]) -> None:
        """A request carrying these chunk keys arrived (counted once per request)."""
        if self.sketch is not None:
            self.sketch.add_all(keys)

    def selects(self, request: Any) -> bool:
        """``admit_when`` for vLLM's ``request`` (the caller keeps the answer per request)."""
        try:
            return self.rule.selects(request)
        except Exception as exc:  # a user predicate or malformed params
            if not self._warned:
                self._warned = True
                logger.error(
                    "PrefixStoreConnector: admit_when failed on request %s: %s; "
                    "its saves are rejected (logged once)",
                    getattr(request, "request_id", "?"),
                    exc,
                )
            return False

    def admits(self, key: str, prompt_len: int, selected: bool) -> bool:
        """Whether a chunk not stored yet may be saved, by the rule alone (promotion aside)."""
        rule = self.rule
        return (
            prompt_len >= rule.min_prompt_tokens
            and selected
            and (self.sketch is None or self.sketch.count(key) >= rule.min_seen)
        )
