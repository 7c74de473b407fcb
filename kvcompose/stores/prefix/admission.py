"""Which saves a store accepts: its admission rule, and the frequency sketch it reads.

A small fast tier that saves every new prompt fills with chunks seen once and evicts the
ones that recur; an admission rule keeps those out (Dynamo KVBM's ``presence``/
``presence_lfu`` filters, SGLang HiCache's selective write-through do the same). The rule
is per store: ``admit_min_prompt_tokens`` (short prompts are cheap to recompute) and
``admit_min_seen`` (a chunk is saved once ``K`` requests have carried it, counted in a
count-min sketch of fixed size that halves its counters now and then, so old popularity
fades). Chunks another tier loaded for the request are saved whatever the rule says when
the store has ``promote: true`` (see :mod:`kvcompose.stores.prefix.scheduler`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass


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

    @property
    def everything(self) -> bool:
        return self.min_prompt_tokens <= 0 and self.min_seen <= 1

    def describe(self) -> str:
        """One line for ``kvcompose explain``."""
        parts = []
        if self.min_prompt_tokens > 0:
            parts.append(f"prompts >= {self.min_prompt_tokens} tokens")
        if self.min_seen > 1:
            parts.append(f"chunks seen >= {self.min_seen} times")
        rule = " and ".join(parts) if parts else "every save"
        if self.promote:
            rule += "; chunks another tier loaded are promoted into it"
        return rule
