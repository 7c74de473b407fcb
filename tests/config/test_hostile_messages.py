"""Hostile input, continued (see ``test_hostile.py``): values a config must not
hold, and messages that must be right and short, through ``load_config``,
``tree_from_extra_config`` and the CLI as a process."""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from config_helpers import EXAMPLES, ROOT
from hostile_helpers import LEAF, assert_clean_error, cli, from_extra, load

from kvcompose.config import tree_from_extra_config
from kvcompose.config.limits import MAX_DEPTH
from kvcompose.tree import Chain

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- accepted wrongly


def test_duplicate_json_keys_refused_on_files_and_stdin(tmp_path: Path) -> None:
    text = b'{"tree": {"leaf": {"connector": "A",\n  "connector": "B"}}}'
    (tmp_path / "dup.json").write_bytes(text)
    message = "tree.leaf.connector: duplicate key 'connector' (first set on line 1)"
    assert_clean_error(cli("validate", "dup.json", cwd=tmp_path), f"dup.json:2: {message}")
    assert_clean_error(cli("validate", "-", cwd=tmp_path, stdin=text), f"<stdin>:2: {message}")
    (tmp_path / "dup.yaml").write_bytes(text)  # JSON in a .yaml file: YAML refuses it too
    assert_clean_error(cli("validate", "dup.yaml", cwd=tmp_path), f"dup.yaml:2: {message}")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (datetime.date(2024, 1, 31), "date"),
        (b"bytes", "bytes"),
        (float("nan"), "nan is not a JSON value"),
        (float("inf"), "inf is not a JSON value"),
        ({1, 2}, "set"),
        (object(), "object"),
    ],
)
def test_python_values_that_are_not_json(value: Any, shown: str) -> None:
    message = from_extra({"tree": {"leaf": {"connector": "X", "extra_config": {"v": value}}}})
    assert message.startswith("kv_connector_extra_config: tree.leaf.extra_config.v: ")
    assert shown in message


def test_override_values_must_be_json() -> None:
    extra = {"tree": {"leaf": {"name": "a", "connector": "X"}}}
    message = from_extra(extra, env={"KVCOMPOSE_SET": "a.extra_config.d=2024-01-31"})
    assert message.startswith("KVCOMPOSE_SET 'a.extra_config.d=2024-01-31': ")
    assert "not a JSON value" in message
    message = from_extra({**extra, "set": {"a.extra_config.r": math.inf}})
    assert "inf is not a JSON value" in message


def test_nested_kvcompose_trees_are_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("inner.yaml").write_text("tree:\n  route:\n    children: [{leaf: {connector: X}}]\n")
    outer = {
        "tree": {
            "chain": {
                "children": [
                    {"leaf": {"connector": "ExampleConnector"}},
                    {"leaf": {"connector": "KVCompose", "extra_config": {"config": "inner.yaml"}}},
                ]
            }
        }
    }
    assert from_extra(outer) == (
        "inner.yaml:2: tree.route: missing required key 'default' (name of the child used "
        "when no rule matches) (in the tree of kv_connector_extra_config: "
        "tree.chain.children[1].leaf)"
    )
    Path("inner.yaml").write_text(LEAF)
    tree = tree_from_extra_config(outer, env={}, check_vllm=False)
    assert isinstance(tree, Chain) and tree.children[1].extra_config == {"config": "inner.yaml"}


# --------------------------------------------------------------------------- messages


def test_symlink_loop(tmp_path: Path) -> None:
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    message = f"{loop}: too many levels of symbolic links (a symlink loop?)"
    assert load(str(loop)) == message
    assert_clean_error(cli("validate", str(loop), cwd=tmp_path), message)
    assert from_extra({"config": str(loop)}) == f"kv_connector_extra_config: config: {message}"


def test_missing_file_named_by_extra_config() -> None:
    assert from_extra({"config": "/no/such/tree.yaml"}) == (
        "kv_connector_extra_config: config: /no/such/tree.yaml: no such file"
    )


def test_encoding_errors_and_nul_bytes_name_their_line(tmp_path: Path) -> None:
    (tmp_path / "latin1.yaml").write_bytes(LEAF.encode() + b"    engine_id: caf\xe9\n")
    (tmp_path / "nul.yaml").write_bytes(LEAF.encode() + b"    engine_id: a\x00b\n")
    (tmp_path / "utf16.yaml").write_bytes(LEAF.encode("utf-16"))
    cases = {
        "latin1.yaml": "latin1.yaml:4: not UTF-8 text: byte 0xe9 at column 19 cannot be decoded",
        "nul.yaml": "nul.yaml:4: NUL byte at column 17: a config is text, is this a binary file?",
        "utf16.yaml": "utf16.yaml:1: UTF-16 text: save the config as UTF-8",
    }
    for name, message in cases.items():
        assert load(str(tmp_path / name)) == str(tmp_path / message)
        assert_clean_error(cli("validate", name, cwd=tmp_path), message)
        stdin = (tmp_path / name).read_bytes()
        assert_clean_error(
            cli("validate", "-", cwd=tmp_path, stdin=stdin), message.replace(name, "<stdin>")
        )


def test_a_bom_is_read_the_same_on_files_and_stdin(tmp_path: Path) -> None:
    for name, text in (
        ("bom.json", '{"tree": {"leaf": {"connector": "ExampleConnector"}}}'),
        ("bom.yaml", LEAF),
    ):
        data = b"\xef\xbb\xbf" + text.encode()
        (tmp_path / name).write_bytes(data)
        assert cli("validate", name, cwd=tmp_path)[:2] == (
            0,
            f"{name}: ok (1 nodes, 1 leaf; vLLM not checked)\n",
        )
        assert cli("validate", "-", cwd=tmp_path, stdin=data)[:2] == (
            0,
            "-: ok (1 nodes, 1 leaf; vLLM not checked)\n",
        )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 400, 100_000])
def test_deep_nesting_gives_a_short_message(levels: int, tmp_path: Path) -> None:
    nested = "[" * levels + "]" * levels
    (tmp_path / "deep.yaml").write_text(f"{LEAF}    extra_config: {{x: {nested}}}\n")
    (tmp_path / "deep.json").write_text(
        f'{{"tree": {{"leaf": {{"connector": "X", "extra_config": {{"x": {nested}}}}}}}}}'
    )
    for name in ("deep.yaml", "deep.json"):
        message = load(str(tmp_path / name))
        assert len(message) < 300, message
        assert "nested" in message and "deep" in message
        assert_clean_error(cli("validate", name, cwd=tmp_path), prefix=False)
    value: Any = []
    for _ in range(min(levels, 5000)):
        value = [value]
    message = from_extra({"tree": {"leaf": {"connector": "X", "extra_config": {"x": value}}}})
    assert message.endswith(f"nested more than {MAX_DEPTH} levels deep") and len(message) < 300


def test_huge_values_are_not_echoed_whole(tmp_path: Path) -> None:
    name = "A" * 1_000_000
    (tmp_path / "name.yaml").write_text(f"tree:\n  leaf:\n    connector: {name}\n")
    assert load(str(tmp_path / "name.yaml")) == (
        f"{tmp_path}/name.yaml:3: tree.leaf.connector: too long (1000000 characters; at most 200)"
    )
    message = from_extra({"tree": {"leaf": {"connector": "X", name: 1}}})
    assert message.startswith("kv_connector_extra_config: tree.leaf.AAAA")
    # the key is shortened; the rest is the list of the leaf's allowed keys
    assert len(message) < 450 and "unknown key 'AAAA" in message
    message = from_extra(
        {"tree": {"route": {"default": name, "children": [{"leaf": {"connector": "X"}}]}}}
    )
    assert len(message) < 400 and "default 'AAAA" in message
    assert_clean_error(cli("validate", "name.yaml", cwd=tmp_path))


def test_help_mentions_standard_input() -> None:
    for verb in ("validate", "explain", "vllm-args", "convert"):
        proc = subprocess.run(
            [sys.executable, "-m", "kvcompose.cli", verb, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0
        assert "or - to read standard input" in " ".join(proc.stdout.split())


STORE_LEAF = """\
tree:
  leaf:
    connector: PrefixStoreConnector
    module_path: kvcompose.stores
    extra_config: {path: /tmp/kv, admit_when: {param: tenant}}
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", ["example", "store-leaf"])
def test_validate_answers_without_importing_vllm(config: str, tmp_path: Path) -> None:
    """The fast default: ``validate`` checks a plain config from the file alone, a kvcompose
    store leaf's ``extra_config`` included (read by the store's model, not its connector)."""
    path = EXAMPLES / "two-disk-tiers.yaml"
    if config == "store-leaf":
        path = tmp_path / "store.yaml"
        path.write_text(STORE_LEAF)
    code = (
        "import sys, time\n"
        "start = time.process_time()\n"
        "from kvcompose.cli.main import main\n"
        f"status = main(['validate', {str(path)!r}])\n"
        "print(status, 'vllm' in sys.modules, 'torch' in sys.modules, "
        "time.process_time() - start)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    status, vllm, torch, seconds = proc.stdout.splitlines()[-1].split()
    assert (status, vllm, torch) == ("0", "False", "False"), proc.stderr[-2000:]
    assert float(seconds) < 3  # a fraction of a second on an idle machine


def test_a_kvcompose_args_file_named_by_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("args.json").write_text(
        json.dumps(
            {
                "kv_connector": "KVCompose",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"tree": {"leaf": {"connector": "X"}}},
            }
        )
    )
    assert from_extra({"config": "args.json"}) == (
        "args.json:1: kv_connector: 'KVCompose' is the kvcompose connector itself: name a "
        "kvcompose document here, not a --kv-transfer-config"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"tree": {"leaf": {"connector": X}}}', "1: JSON syntax error: unquoted text 'X': JSON"),
        ("{'tree': {}}", "1: JSON syntax error: a single-quoted string: JSON strings are in"),
        ('{"tree": {"leaf": {\n "connector": "X",\n}}}', "2: JSON syntax error: a trailing comma"),
        ('{"a": &x 1, "b": *x}', "1: JSON syntax error: an alias (*name) is YAML, not JSON"),
        ('{"a": !!str 1}', "1: JSON syntax error: unquoted text '1'"),
        ("tree:\n  leaf: {}\n", "1: JSON syntax error: a YAML block mapping or list"),
    ],
)
def test_json_files_hold_json_only(text: str, message: str, tmp_path: Path) -> None:
    """A .json file is read by the YAML parser, as JSON: the YAML JSON has not is refused
    with its line (a trailing comma too, which vLLM's json.loads would refuse)."""
    (tmp_path / "c.json").write_text(text)
    assert load(str(tmp_path / "c.json")).startswith(f"{tmp_path / 'c.json'}:{message}")


def test_json_numbers_are_json_numbers(tmp_path: Path) -> None:
    """``1e-3`` is a number in JSON (YAML 1.1 reads it as text), in a file and on stdin."""
    from kvcompose.config import load_config

    text = (
        '{"tree": {"chain": {"lookup_timeout_s": 1e-3, "children": '
        '[{"leaf": {"connector": "ExampleConnector"}}]}}}'
    )
    (tmp_path / "c.json").write_text(text)
    tree = load_config(str(tmp_path / "c.json"), env={}, check_vllm=False).tree
    assert tree.lookup_timeout_s == 0.001  # type: ignore[union-attr]
    assert cli("validate", "-", cwd=tmp_path, stdin=text.encode())[0] == 0
    # flow-style YAML on standard input is YAML
    flow = b"{tree: {leaf: {connector: ExampleConnector}}}"
    assert cli("validate", "-", cwd=tmp_path, stdin=flow)[0] == 0


def test_the_reader_without_libyaml(tmp_path: Path) -> None:
    """PyYAML without libyaml (its own parser, slower) reads the same data and refuses the
    same things with the same messages."""
    (tmp_path / "dup.yaml").write_text(f"{LEAF}    engine_id: no\n    engine_id: b\n")
    (tmp_path / "c.json").write_text('{"tree": {"leaf": {"connector": "X",}}}')
    code = (
        "import yaml\n"
        "del yaml.CSafeLoader\n"
        "from kvcompose.config import ConfigError, load_config\n"
        "for name in ('dup.yaml', 'c.json'):\n"
        "    try:\n"
        "        load_config(name, env={}, check_vllm=False)\n"
        "    except ConfigError as exc:\n"
        "        print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.splitlines() == [
        "dup.yaml:5: tree.leaf.engine_id: duplicate key 'engine_id' (first set on line 4)",
        "c.json:1: JSON syntax error: a trailing comma is not JSON (column 36)",
    ], proc.stderr[-2000:]
    for name, line in zip(("dup.yaml", "c.json"), proc.stdout.splitlines(), strict=True):
        assert load(str(tmp_path / name)) == f"{tmp_path}/{line}"  # what libyaml's reads say
