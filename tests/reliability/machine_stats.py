"""Figures over every example the randomized machine ran in this process (conftest.py
writes them out)."""

from __future__ import annotations

from collections import Counter

STATS: Counter[str] = Counter()
