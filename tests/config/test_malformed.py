"""The malformed-config corpus: every file fails with exactly its expected one-line message.

A YAML case ends with ``# expect: MESSAGE`` (or ``# expect-prefix:`` where the tail depends on
the installed vLLM); a JSON case has a ``NAME.json.expect`` file. ``{file}`` stands for the
path as given. ``# needs: vllm`` marks checks that import vLLM; ``# env: VAR=value`` sets an
environment variable for the case.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from config_helpers import MALFORMED, vllm_importable

from kvcompose.config import ConfigError, load_config

CASES = sorted(p for p in MALFORMED.iterdir() if p.suffix in (".yaml", ".json"))


def expectation(path: Path) -> tuple[str, bool, bool, dict[str, str]]:
    """(message, exact, needs vLLM, env)."""
    text = path.read_text()
    meta = Path(str(path) + ".expect").read_text() if path.suffix == ".json" else text
    match = re.search(r"^#? ?(expect|expect-prefix): (.*)$", meta, re.M)
    assert match, f"{path.name}: no expected message"
    message = match.group(2).replace("{file}", str(path))
    env = dict(m.groups() for m in re.finditer(r"^# env: (\w+)=(.*)$", text, re.M))
    return message, match.group(1) == "expect", "# needs: vllm" in meta, env


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 30
    pure = [p for p in CASES if not expectation(p)[2]]
    assert len(pure) >= 30, "at least 30 cases must run without vLLM"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_malformed_message(path: Path) -> None:
    message, exact, needs, env = expectation(path)
    if needs and not vllm_importable():
        pytest.skip("needs vLLM")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env=env, check_vllm=needs)
    got = str(info.value)
    assert "\n" not in got
    if exact:
        assert got == message
    else:
        assert got.startswith(message)


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_malformed_via_cli(path: Path, run_cli) -> None:
    message, exact, needs, env = expectation(path)
    if needs and not vllm_importable():
        pytest.skip("needs vLLM")
    # validate skips vLLM unless asked (the fast default); the vLLM cases ask
    args = ["validate", str(path)] + (["--check-vllm"] if needs else [])
    code, out, err = run_cli(*args, env=env)
    assert code == 1
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0] == message if exact else lines[0].startswith(message)


def test_expected_messages_name_the_file_and_line() -> None:
    """Messages from files carry ``file:line:`` wherever the parser knows the line."""
    without_line = {"empty-file.yaml", "top-level-list.yaml"}
    for path in CASES:
        message, _, _, env = expectation(path)
        if path.name in without_line or env:
            continue
        assert re.match(re.escape(str(path)) + r":\d+: ", message), path.name
