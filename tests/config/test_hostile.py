"""Hostile and careless input: every config, file and value a user (or an attacker) can hand
kvcompose ends in a one-line ``ConfigError`` or a correct acceptance, within bounded time
and memory, the same through the CLI (a real process: exit 1, nothing on stdout, no
traceback) and through ``tree_from_extra_config`` (the path vLLM's engine takes).

The corpus in ``hostile/`` holds the small cases, each with its expected message (a YAML
case ends with ``# expect: MESSAGE``, a JSON case has ``NAME.json.expect``; ``{file}`` is
the file's name, the tests run in that directory). Large and binary inputs are generated
here: bombs, huge files, includes, huge integers, the internal form. Values that must be
refused and the wording of messages are in ``test_hostile_messages.py``; the cases
that import connector modules are in ``test_hostile_vllm.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from config_helpers import ROOT
from hostile_helpers import HOSTILE, LEAF, assert_clean_error, cli, from_extra, load

from kvcompose.config import load_config, tree_from_extra_config
from kvcompose.config.limits import MAX_ALIAS_NODES, MAX_FILE_BYTES, MAX_INCLUDE_DEPTH
from kvcompose.tree import TREE_KEY, Chain, Leaf

pytestmark = pytest.mark.timeout(60)

CASES = sorted(p for p in HOSTILE.iterdir() if p.suffix in (".yaml", ".json"))


def expected(path: Path) -> str:
    meta = Path(str(path) + ".expect").read_text() if path.suffix == ".json" else path.read_text()
    match = re.search(r"^#? ?expect: (.*)$", meta, re.M)
    assert match, f"{path.name}: no expected message"
    return match.group(1).replace("{file}", path.name)


# --------------------------------------------------------------------------- the corpus


def test_corpus_covers_the_classes() -> None:
    assert len(CASES) >= 20


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_corpus_in_process(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(HOSTILE)
    message = expected(path)
    assert load(path.name) == message
    # what vLLM's engine does with {"config": FILE}: the same message, except for a
    # --kv-transfer-config, which is no document to name there
    via_extra = from_extra({"config": path.name})
    if path.name.startswith("args-"):
        assert via_extra.endswith(
            "'KVCompose' is the kvcompose connector itself: name a "
            "kvcompose document here, not a --kv-transfer-config"
        )
    else:
        assert via_extra == message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_corpus_through_the_cli(path: Path) -> None:
    assert_clean_error(cli("validate", path.name, cwd=HOSTILE), expected(path))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name",
    [
        "date-in-extra-config.yaml",
        "binary-in-extra-config.yaml",
        "nan-in-extra-config.yaml",
        "inf-timeout.yaml",
        "set-in-extra-config.yaml",
        "nan.json",
    ],
)
def test_values_that_are_not_json_stop_vllm_args_and_convert_cleanly(name: str) -> None:
    """Refused when the config is read, so vllm-args and convert never fail half-way
    (``TypeError: not JSON serializable``) or print ``NaN``."""
    message = expected(HOSTILE / name)
    assert_clean_error(cli("vllm-args", "--offline", "--json", name, cwd=HOSTILE), message)
    assert_clean_error(cli("convert", "--offline", name, cwd=HOSTILE), message)


# --------------------------------------------------------------------------- hangs, memory


def alias_bomb(levels: int = 10, fan: int = 10) -> str:
    """A "billion laughs": ``levels`` anchors, each a list of ``fan`` aliases to the one
    before (``fan ** levels`` nodes once expanded)."""
    lines = [
        "version: 1",
        "kv_role: kv_both",
        "tree:",
        "  leaf:",
        "    connector: ExampleConnector",
        "    extra_config:",
        "      l0: &l0 [" + ", ".join(["lol"] * fan) + "]",
    ]
    for i in range(1, levels):
        lines.append(f"      l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]")
    return "\n".join(lines) + "\n"


BOMB_MESSAGE = re.compile(
    rf"bomb\.yaml:\d+: tree\.leaf\.extra_config\.l\d+\[\d+\]: aliases or shared "
    rf"objects expand this config by more than {MAX_ALIAS_NODES:,} nodes \(an alias bomb\?\)"
)


@pytest.mark.timeout(60)
def test_alias_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """Loaded in a process limited to 1 GiB of address space: the old line-map walker
    followed every alias and ran out of memory."""
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    code = (
        "import resource, time\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from kvcompose.config import ConfigError, load_config\n"
        "start = time.process_time()\n"
        "try:\n"
        "    load_config('bomb.yaml', env={}, check_vllm=False)\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "print(time.process_time() - start)\n"
        # the peak RSS of this process image (ru_maxrss may count the forking parent's)
        "status = open('/proc/self/status').read()\n"
        "print(status.split('VmHWM:')[1].split()[0])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    message, seconds, peak_kib = proc.stdout.splitlines()
    assert BOMB_MESSAGE.match(message), message
    assert float(seconds) < 2
    assert int(peak_kib) < 300 * 1024
    assert BOMB_MESSAGE.match(assert_clean_error(cli("validate", "bomb.yaml", cwd=tmp_path)))


@pytest.mark.timeout(30)
def test_alias_bomb_through_extra_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    monkeypatch.chdir(tmp_path)
    assert BOMB_MESSAGE.match(from_extra({"config": "bomb.yaml"}))


@pytest.mark.timeout(30)
def test_shared_python_objects_are_counted_like_aliases() -> None:
    """The same bomb as Python objects (a dict from an API user): bounded too."""
    value: Any = ["lol"] * 10
    for _ in range(12):
        value = [value] * 10
    message = from_extra({"tree": {"leaf": {"connector": "X", "extra_config": {"v": value}}}})
    assert message.startswith("kv_connector_extra_config: tree.leaf.extra_config.v")
    assert message.endswith(
        f"aliases or shared objects expand this config by more than {MAX_ALIAS_NODES:,} nodes "
        "(an alias bomb?)"
    )


def test_a_few_shared_blocks_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "tree:\n  chain:\n    children:\n"
        "      - leaf: {connector: ExampleConnector, extra_config: &c "
        "{shared_storage_path: /kv, sizes: [1, 2]}}\n"
        "      - leaf: {connector: ExampleConnector, extra_config: *c}\n"
    )
    tree = load_config(str(path), env={}, check_vllm=False).tree
    assert isinstance(tree, Chain)
    assert (
        tree.children[0].extra_config
        == tree.children[1].extra_config
        == {"shared_storage_path": "/kv", "sizes": [1, 2]}
    )
    shared = {"p": [1, 2]}
    tree = tree_from_extra_config(
        {
            "tree": {
                "chain": {
                    "children": [
                        {"leaf": {"connector": "A", "extra_config": shared}},
                        {"leaf": {"connector": "B", "extra_config": shared}},
                    ]
                }
            }
        },
        env={},
        check_vllm=False,
    )
    assert isinstance(tree, Chain) and tree.children[1].extra_config == {"p": [1, 2]}


def test_yaml_merge_keys_build_what_pyyaml_builds(tmp_path: Path) -> None:
    import yaml

    text = (
        "kv_role: kv_both\n"
        "tree:\n  leaf:\n    connector: ExampleConnector\n    extra_config:\n"
        "      a: &a {path: /a, size: 1}\n      b: &b {size: 2, mode: x}\n"
        "      merged: {<<: [*a, *b], size: 3, '<<': literal}\n"
        "      numbers: [0o17, 1_000, 1:30, 0x1f, 1.5e3, 3.0, -7, 2.5]\n"
    )
    path = tmp_path / "merge.yaml"
    path.write_text(text)
    tree = load_config(str(path), env={}, check_vllm=False).tree
    assert isinstance(tree, Leaf)
    assert tree.extra_config == yaml.safe_load(text)["tree"]["leaf"]["extra_config"]


@pytest.mark.timeout(60)
def test_file_size_limit(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("w") as fh:  # 5 MiB of comments after a valid document
        fh.write(LEAF)
        line = "# " + "x" * 1022 + "\n"
        for _ in range(5 * 1024):
            fh.write(line)
    limit = f"{MAX_FILE_BYTES // (1 << 20)} MiB"
    message = load(str(big))
    assert message.startswith(f"{big}: too large for a config file (5.0 MiB, more than {limit})")
    huge = tmp_path / "huge.json"
    with huge.open("wb") as fh:  # 50 MiB, sparse: refused from its size, never read whole
        fh.truncate(50 << 20)
    start = time.process_time()
    assert load(str(huge)) == f"{huge}: too large for a config file (50 MiB, more than {limit})"
    assert time.process_time() - start < 1
    assert_clean_error(cli("validate", str(big), cwd=tmp_path), message)
    assert_clean_error(
        cli("validate", "-", cwd=tmp_path, stdin=big.read_bytes()),
        f"<stdin>: too large for a config file (larger than {limit})",
    )
    assert (
        from_extra({"config": str(big)}) == f"kv_connector_extra_config: config: {big}: "
        f"too large for a config file (5.0 MiB, more "
        f"than {limit})"
    )


@pytest.mark.timeout(30)
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_dev_zero_is_refused() -> None:
    limit = f"{MAX_FILE_BYTES // (1 << 20)} MiB"
    assert load("/dev/zero") == f"/dev/zero: too large for a config file (larger than {limit})"
    assert_clean_error(
        cli("validate", "/dev/zero", cwd=ROOT),
        f"/dev/zero: too large for a config file (larger than {limit})",
    )


@pytest.mark.timeout(60)
def test_a_fifo_is_read_when_written_and_refused_when_nobody_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from kvcompose.config import limits

    monkeypatch.setattr(limits, "PIPE_WAIT_S", 0.5)
    fifo = tmp_path / "tree.yaml"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert load(str(fifo)) == (
        f"{fifo}: nothing was written to this pipe for 0.5 s (a FIFO no process writes to?)"
    )
    assert time.monotonic() - started < 20  # opening it does not wait for a writer

    text = f"version: 1\nkv_role: kv_both\n{LEAF}"

    def write() -> None:
        time.sleep(0.2)
        with open(fifo, "w") as fh:
            fh.write(text[:20])
            fh.flush()
            time.sleep(0.2)
            fh.write(text[20:])

    writer = threading.Thread(target=write)
    writer.start()
    config = load_config(str(fifo), env={}, check_vllm=False)
    writer.join()
    assert isinstance(config.tree, Leaf)


def test_a_long_or_empty_file_name_never_hides_the_reason(tmp_path: Path) -> None:
    from kvcompose.config.limits import MAX_LABEL

    long_name = "x" * 5000
    line = assert_clean_error(cli("validate", long_name, cwd=tmp_path))
    assert line.endswith("x: cannot read: File name too long"), line
    assert len(line) < MAX_LABEL + 60
    deep = "d/" * 1000 + "tree.yaml"
    line = assert_clean_error(cli("validate", deep, cwd=tmp_path))
    assert line.startswith("d/d/") and line.endswith("d/tree.yaml: no such file"), line
    assert_clean_error(cli("validate", "", cwd=tmp_path), "'': no such file")


def children_config(n: int) -> str:
    lines = ["version: 1", "kv_role: kv_both", "tree:", "  chain:", "    children:"]
    lines += [
        "      - leaf: {connector: ExampleConnector, extra_config: "
        f"{{shared_storage_path: /kv/{i}}}}}"
        for i in range(n)
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(120)
def test_ten_thousand_children_load_in_linear_time(tmp_path: Path) -> None:
    """Unnamed children named ``ExampleConnector-2``, ``-3``, ...: once quadratic."""
    times = {}
    for n in (2_500, 10_000):
        path = tmp_path / f"c{n}.yaml"
        path.write_text(children_config(n))
        start = time.process_time()
        config = load_config(str(path), env={}, check_vllm=False)
        times[n] = time.process_time() - start
        assert len(config.tree.children) == n  # type: ignore[union-attr]
        assert config.tree.children[-1].name == f"ExampleConnector-{n}"  # type: ignore[union-attr]
    assert times[10_000] < 10 * times[2_500] + 0.5, times  # 4x the input, not 16x the time
    code, out, err = cli("validate", "c10000.yaml", cwd=tmp_path)
    assert (code, err) == (0, "") and out.startswith("c10000.yaml: ok (10001 nodes")


@pytest.mark.timeout(60)
def test_many_producers_and_rules_are_checked_in_linear_time() -> None:
    """The params-clash and reference checks once compared every leaf with every other."""
    n = 20_000
    producers = {
        "tree": {
            "chain": {
                "children": [
                    {"leaf": {"connector": "A", "params_keys": [f"k{i}"]}} for i in range(n)
                ]
            }
        }
    }
    rules = {
        "tree": {
            "route": {
                "default": "c0",
                "rules": [{"param": "p", "equals": i, "child": f"c{i}"} for i in range(n)],
                "children": [{"leaf": {"name": f"c{i}", "connector": "A"}} for i in range(n)],
            }
        }
    }
    for doc in (producers, rules):
        start = time.process_time()
        load_config(doc, env={}, check_vllm=False)
        assert time.process_time() - start < 20  # ~1 s; quadratic was minutes


@pytest.mark.timeout(30)
def test_includes_nest_boundedly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    depth = MAX_INCLUDE_DEPTH + 2
    for i in range(depth):
        inner = (
            f"{{config: f{i + 1}.yaml}}"
            if i + 1 < depth
            else "{tree: {leaf: {connector: ExampleConnector}}}"
        )
        Path(f"f{i}.yaml").write_text(
            f"tree:\n  leaf:\n    connector: KVCompose\n    extra_config: {inner}\n"
        )
    message = load("f0.yaml")
    assert f"configs include each other more than {MAX_INCLUDE_DEPTH} levels deep" in message
    Path(f"f{MAX_INCLUDE_DEPTH - 1}.yaml").write_text(LEAF)  # deep, but within the limit
    assert load_config("f0.yaml", env={}, check_vllm=False).tree.connector == "KVCompose"


def test_env_config_file_that_includes_itself(tmp_path: Path) -> None:
    """A nested KVCompose leaf with no tree reads KVCOMPOSE_CONFIG_FILE, as vLLM would:
    when that is the same file, the load would never end."""
    path = tmp_path / "env.yaml"
    path.write_text("tree:\n  leaf: {connector: KVCompose}\n")
    env = {"KVCOMPOSE_CONFIG_FILE": str(path)}
    assert load(str(path), env=env) == (
        f"KVCOMPOSE_CONFIG_FILE: {path} includes itself ({_rel(path)} -> {_rel(path)}) (in the "
        f"tree of {path}:2: tree.leaf)"
    )
    assert from_extra({}, env=env) == load(str(path), env=env)


def _rel(path: Path) -> str:
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


# --------------------------------------------------------------------------- internal errors


def test_recursive_python_structures() -> None:
    extra: dict[str, Any] = {"shared_storage_path": "/kv"}
    extra["self"] = extra
    assert from_extra({"tree": {"leaf": {"connector": "X", "extra_config": extra}}}) == (
        "kv_connector_extra_config: tree.leaf.extra_config.self: refers to a mapping or list "
        "that contains it (a recursive structure cannot be written as JSON)"
    )


@pytest.mark.timeout(30)
def test_huge_integers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digits = "9" * 5000
    (tmp_path / "int.yaml").write_text(f"{LEAF}    kv_port: {digits}\n")
    (tmp_path / "int.json").write_text(
        f'{{"tree": {{"leaf": {{"connector": "X",\n "kv_port": {digits}}}}}}}'
    )
    monkeypatch.chdir(tmp_path)
    assert (
        load("int.yaml") == "int.yaml:4: tree.leaf.kv_port: integer is too large "
        "(more than 100 digits)"
    )
    assert (
        load("int.json") == "int.json:2: tree.leaf.kv_port: integer is too large "
        "(more than 100 digits)"
    )
    assert_clean_error(cli("validate", "int.json", cwd=tmp_path), load("int.json"))
    assert from_extra({"tree": {"leaf": {"connector": "X", "kv_port": int(digits[:200])}}}) == (
        "kv_connector_extra_config: tree.leaf.kv_port: integer is too large (more than 100 digits)"
    )
    (tmp_path / "ok.yaml").write_text(LEAF)
    message = load("ok.yaml", env={"KVCOMPOSE_SET": f"ExampleConnector.kv_port={digits}"})
    assert message.startswith("KVCOMPOSE_SET 'ExampleConnector.kv_port=99999")
    assert message.endswith("...': integer is too large (more than 100 digits)")


@pytest.mark.parametrize(
    "internal",
    [
        {"kind": "chain"},
        {
            "kind": "route",
            "name": "r",
            "default": "nope",
            "children": [{"kind": "leaf", "name": "a", "connector": "X"}],
        },
        {
            "kind": "chain",
            "name": "c",
            "children": [
                {"kind": "leaf", "name": "a", "connector": "X"},
                {"kind": "leaf", "name": "a", "connector": "X"},
            ],
        },
        {"kind": "fanout", "name": "f", "load_from": 3, "children": []},
        [1, 2],
        "tree",
    ],
)
def test_internal_form_is_checked(internal: Any) -> None:
    """The subtree a composite hands a nested one is trusted nowhere: bad ones (a test
    helper's mistake, or a hand-written kvcompose_tree) are refused with a message, never a
    KeyError or TypeError."""
    message = from_extra({TREE_KEY: internal})
    assert message.startswith(f"kv_connector_extra_config: {TREE_KEY}: malformed internal tree: ")
