"""Mutated configs through every CLI verb: each ends in exit 0 (accepted) or 1 (a clean
error), never 3 (an internal error), a raise or a minutes-long run.

The seeds are the shipped examples and the hostile corpus; each case mutates one seed's
parsed data (a value replaced by a hostile one, a key dropped or added, a subtree moved or
repeated) or its text (a line dropped, re-indented or duplicated, a YAML or JSON token
inserted, the text cut), and runs one verb on it, sometimes with a ``--set`` or
``--no-env``. The cases are drawn from fixed seeds, so a failure replays;
``KVCOMPOSE_FUZZ_CASES`` sets how many each seed draws (default 60).
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HOSTILE_DIR = ROOT / "tests" / "config" / "hostile"
CASES = int(os.environ.get("KVCOMPOSE_FUZZ_CASES", "60"))

HOSTILE_VALUES: list[Any] = [
    None, -1, 0, 1, 2**70, 1e308, float("inf"), "", " ", "\x00", "é", [], {}, [None],
    {"": 1}, True, False, "a" * 3000, "../../etc/passwd", "/dev/zero", "${HOME}",
    "${KVCOMPOSE_UNSET_VARIABLE}", "${KVCOMPOSE_X:-fallback}", "0x10", "nan", 0.5,
    {"leaf": {}}, {"chain": {}}, {"route": None}, {"kind": "leaf"},
    {"leaf": {"name": "n", "connector": "ExampleConnector"}}, "MultiConnector",
    "kvcompose.compat", "os", "builtins", "kvcompose.testing.scripted",
]  # fmt: skip
KEYS = (
    "name", "kind", "policy", "children", "leaf", "chain", "fanout", "route", "rules", "save",
    "connector", "module_path", "extra_config", "include", "on_error", "tree", "version",
    "kv_role", "engine_id", "hma", "strict", "not_a_key",
)  # fmt: skip
TOKENS = ("{", "}", "[", "]", ":", "- ", "&a ", "*a", "!!str ", "\t", "#", "'", '"', "\\", "|")
VERBS = (
    ("validate",), ("validate", "--all-errors"), ("validate", "--strict"),
    ("validate", "--check-vllm"), ("explain",), ("vllm-args",), ("vllm-args", "--python"),
    ("convert",), ("convert", "--to", "multiconnector"),
    ("convert", "--to", "multiconnector", "--compat"),
)  # fmt: skip
SETS = ("tiers.policy=longest", "=", "x", ".b=2", "a.b.c.d=null", "tiers.lookup_timeout_s=-1")


def seeds() -> list[tuple[str, str]]:
    files = [*sorted((ROOT / "examples").rglob("*")), *sorted(HOSTILE_DIR.iterdir())]
    return [(p.suffix, p.read_text()) for p in files if p.suffix in (".yaml", ".json")]


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if len(prefix) > 30:  # an alias that contains itself
        return
    yield prefix
    if isinstance(data, dict | list):
        for key, value in data.items() if isinstance(data, dict) else enumerate(data):
            yield from _paths(value, (*prefix, key))


def _at(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def mutate_data(data: Any, rng: random.Random) -> Any:
    data = copy.deepcopy(data)
    for _ in range(rng.randint(1, 3)):
        every = [p for p in _paths(data) if p]
        if not every:
            break
        path = rng.choice(every)
        parent, key = _at(data, path[:-1]), path[-1]
        op = rng.random()
        if op < 0.4:
            parent[key] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
        elif op < 0.55:
            del parent[key]
        elif op < 0.7 and isinstance(parent, dict):
            parent[rng.choice(KEYS)] = copy.deepcopy(rng.choice([*HOSTILE_VALUES, parent[key]]))
        elif op < 0.8 and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        elif op < 0.9:
            parent[key] = copy.deepcopy(_at(data, rng.choice(every)))
        else:
            parent[key] = [copy.deepcopy(parent[key])] * rng.randint(0, 3)
    return data


def mutate_text(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    if not lines:
        return text
    i = rng.randrange(len(lines))
    op = rng.random()
    if op < 0.25:
        del lines[i]
    elif op < 0.45:
        lines[i] = "  " + lines[i]
    elif op < 0.6:
        lines[i] = lines[i].lstrip()
    elif op < 0.7:
        lines.insert(i, rng.choice(lines))
    elif op < 0.85:
        j = rng.randrange(len(lines[i]) + 1)
        lines[i] = lines[i][:j] + rng.choice(TOKENS) + lines[i][j:]
    else:
        return text[: rng.randrange(len(text))]
    return "".join(lines)


def mutant(suffix: str, text: str, rng: random.Random) -> str:
    if rng.random() < 0.4:
        return mutate_text(text, rng)
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
        mutated = mutate_data(data, rng)
        return json.dumps(mutated) if suffix == ".json" else yaml.safe_dump(mutated)
    except Exception:  # the seed itself is hostile (an alias loop, a date): mutate its text
        return mutate_text(text, rng)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_configs_end_in_a_clean_answer(
    seed: int, tmp_path: Path, run_cli: Callable[..., tuple[int, str, str]]
) -> None:
    for p in HOSTILE_DIR.iterdir():  # the corpus includes its neighbours by relative path
        (tmp_path / p.name).write_bytes(p.read_bytes())
    rng = random.Random(seed)
    pool = seeds()
    bad = []
    for case in range(CASES):
        suffix, text = rng.choice(pool)
        text = mutant(suffix, text, rng)
        argv = [*rng.choice(VERBS)]
        if rng.random() < 0.2:
            argv += ["--set", rng.choice(SETS)]
        if rng.random() < 0.1:
            argv.append("--no-env")
        path = tmp_path / f"case{suffix}"
        path.write_text(text)
        t0 = time.perf_counter()
        code, _, err = run_cli(*argv, str(path))
        took = time.perf_counter() - t0
        if code not in (0, 1) or took > 30:
            saved = tmp_path / f"bad-{case}{suffix}"
            saved.write_text(text)
            bad.append(f"case {case}: {argv} exit {code} in {took:.1f} s: {err.strip()[:300]}")
    assert not bad, "\n".join(bad)
