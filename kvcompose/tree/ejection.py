"""A child's outlier-ejection rule: when its parent stops asking it, and for how long.

A child whose lookups fail (raise, or answer slower than ``slow_ms``, or still answer "still
looking" at the node's lookup deadline) ``failures`` times in a row is *ejected*: its parent
skips it in lookups for ``backoff_s`` seconds, then asks it once again. An answer in time puts
it back; another failure ejects it for twice as long (at most ``max_backoff_s``). Service
meshes call this outlier detection (Envoy's ``consecutive_5xx`` and ``base_ejection_time``).

The rule lives on the child, as ``on_error`` does; ``kvcompose.composite.guard`` applies it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_FAILURES = 3
DEFAULT_SLOW_MS = 1000.0
DEFAULT_BACKOFF_S = 10.0
DEFAULT_MAX_BACKOFF_S = 300.0


class EjectRule(BaseModel):
    """When a parent stops asking this child to look requests up, and for how long."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    failures: int = Field(
        DEFAULT_FAILURES,
        ge=1,
        le=1000,
        description="Failed lookups in a row that eject the child (a raise, an answer "
        "slower than `slow_ms`, or 'still looking' at the node's lookup deadline).",
    )
    slow_ms: float = Field(
        DEFAULT_SLOW_MS,
        gt=0,
        allow_inf_nan=False,
        description="A lookup that takes longer than this (ms) counts as failed; its answer "
        "is still used.",
    )
    backoff_s: float = Field(
        DEFAULT_BACKOFF_S,
        gt=0,
        allow_inf_nan=False,
        description="Seconds an ejected child is skipped before it is asked once again; "
        "each ejection in a row doubles it.",
    )
    max_backoff_s: float = Field(
        DEFAULT_MAX_BACKOFF_S,
        gt=0,
        allow_inf_nan=False,
        description="The longest back-off, however many ejections in a row.",
    )

    def backoff(self, ejections: int) -> float:
        """The back-off of the ``ejections``-th ejection in a row (1 for the first)."""
        return min(self.backoff_s * 2 ** min(ejections - 1, 30), self.max_backoff_s)

    def describe(self) -> str:
        """One line for ``kvcompose explain``."""
        return (
            f"eject after {self.failures} failed lookup{'s' if self.failures != 1 else ''} "
            f"(raise or > {self.slow_ms:g} ms) for {self.backoff_s:g} s, doubling to at most "
            f"{self.max_backoff_s:g} s"
        )


EjectField = Annotated[
    EjectRule | None,
    Field(
        description="Outlier ejection: skip this child in its parent's lookups for "
        "`backoff_s` after `failures` failed calls in a row (a raise, a lookup slower than "
        "`slow_ms`, 'still looking' at the lookup deadline), then ask it once again; a failed "
        "trial doubles the back-off, up to `max_backoff_s`. "
        f"`{{failures, slow_ms, backoff_s, max_backoff_s}}`, defaults {DEFAULT_FAILURES}, "
        f"{DEFAULT_SLOW_MS:g} ms, {DEFAULT_BACKOFF_S:g} s, {DEFAULT_MAX_BACKOFF_S:g} s "
        "(docs/concepts.md, 'When a child raises'). Unset: never ejected.",
    ),
]
